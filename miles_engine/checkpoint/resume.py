"""Between a running stack and its checkpoints: what a checkpoint records about the run, and
how a resumed run finds its requeued tasks again.

"Same data order" means the same task stream (seeded shuffle per epoch) continued from the
checkpointed cursor, with the same group ids (``task_id@position``). In ``sync`` mode that also
fixes which groups each step trains on. Under ``one_step_off`` / ``fully_async`` the groups a
step takes depend on episode timing, so a resumed run trains the same groups exactly once, but
not necessarily in the same steps as an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.rollout.tasks import TaskStream
from miles_engine.checkpoint.store import RolloutState
from miles_engine.checkpoint.compat import fingerprint, layout

log = logging.getLogger(__name__)


def tokenizer_sha256(tokenizer: Any) -> str:
    """A digest of the policy tokenizer (token ids must mean the same thing after a resume)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    to_str = getattr(backend, "to_str", None)
    text = to_str() if callable(to_str) else json.dumps(backend.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_info(config: dict[str, Any], tokenizer_sha: str, weight_version: int,
                  rollout: RolloutState) -> dict[str, Any]:
    return {"weight_version": weight_version, "fingerprint": fingerprint(config, tokenizer_sha),
            "tokenizer_sha256": tokenizer_sha, "layout": layout(config), "config": config,
            "rollout": {"cursor": rollout.cursor, "buffered": [g.group_id for g in rollout.buffered],
                        "requeued": [f"{task}@{pos}" for pos, task in rollout.requeued]}}


def requeued_refs(tasks: TaskStream, rollout: RolloutState, path: Path) -> list[tuple[int, Any]]:
    """The task refs of a checkpoint's requeued groups; the task list must not have changed."""
    out = []
    for position, task_id in rollout.requeued:
        ref = tasks.at(position)
        if ref.id != task_id:
            raise ConfigError(f"cannot resume from {path}: task stream position {position} was task {task_id!r} "
                              f"but is now {ref.id!r} (the environment's task list or rollout.task_seed changed)")
        out.append((position, ref))
    if out:
        log.info("resume: %d group(s) that were running at the checkpoint are requeued: %s", len(out),
                 ", ".join(f"{t}@{p}" for p, t in rollout.requeued))
    return out
