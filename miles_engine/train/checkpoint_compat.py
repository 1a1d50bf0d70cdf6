"""What a checkpoint may be resumed with: the same parallel layout and a compatible recipe.

The recipe's keys split three ways. ``LAYOUT_KEYS`` describe how the trainer is laid out
(placement, FSDP ranks, device); ``MUTABLE`` keys may change on resume (run length, logging,
concurrency, timeouts: nothing that changes the model, the optimizer, the data order or the
algorithm); every other key is part of the recipe fingerprint and must be equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

LAYOUT_KEYS = ("placement.trainer", "trainer.parallel.world_size", "trainer.parallel.device")
# engines, fleet, weights: engines start from the trainer's weights (pushed in full at the first push
# of every run), so the fleet and how weights reach it may change on resume
# placement.backend / placement.ray: the same ranks in actors or in local processes save the same state
# trainer.true_on_policy: the same model and updates, only the forward's rounding differs (engines follow it)
# eval: except the train / eval split of the training tasks (checked on its own: evaluation/splits.py)
# rollout.mode: groups restored from the checkpoint are trained first in either mode (a step-0 checkpoint has none)
# trainer.backend / trainer.megatron: both backends save the same HF-named trainer state (any TP / PP / EP
# shard layout loads it: miles_engine/trainer/megatron/state.py); trainer.megatron.checkpoint_format=dist
# writes Megatron's own format, which only the megatron backend reads (refused with one error at restore),
# at any TP / PP / EP: megatron to megatron, the world size may change too (see check)
MUTABLE = ("description", "eval", "metrics", "run", "sft", "sandbox.options", "engines", "fleet", "weights",
           "placement.backend", "placement.ray", "trainer.backend", "trainer.megatron",
           "rollout.mode", "rollout.max_inflight", "rollout.poll_s", "rollout.episode_timeout_s",
           "buffer.capacity_groups", "trainer.num_threads", "trainer.sft.num_threads", "trainer.parallel.start_timeout_s",
           "trainer.parallel.step_timeout_s", "session_server.diagnose_every", "session_server.otel",
           "session_server.max_sessions", "trainer.true_on_policy", "session_server.host",
           "session_server.port")


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _is_mutable(key: str) -> bool:
    return any(key == m or key.startswith(m + ".") for m in MUTABLE)


def layout(config: Mapping[str, Any]) -> dict[str, Any]:
    flat = flatten(config)
    return {k: flat.get(k) for k in LAYOUT_KEYS}


def recipe_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that must be equal on resume."""
    return {k: v for k, v in flatten(config).items() if not _is_mutable(k) and k not in LAYOUT_KEYS}


def fingerprint(config: Mapping[str, Any], tokenizer_sha256: str) -> str:
    text = json.dumps({"recipe": recipe_keys(config), "tokenizer": tokenizer_sha256}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    missing = "<absent>"
    return [f"  {k}: checkpoint {old.get(k, missing)!r}, now {new.get(k, missing)!r}"
            for k in keys if old.get(k, missing) != new.get(k, missing)]


def _backend(config: Mapping[str, Any]) -> Any:
    return (config.get("trainer") or {}).get("backend", "torch")


def check(manifest: Mapping[str, Any], config: Mapping[str, Any], tokenizer_sha256: str, path: Path) -> None:
    """Refuse (one :class:`ConfigError` naming every difference) unless ``config`` may resume ``path``."""
    old, new = dict(manifest["layout"]), layout(config)
    if _backend(manifest["config"]) == _backend(config) == "megatron":  # the ranks reshard: any world size
        old.pop("trainer.parallel.world_size", None)
        new.pop("trainer.parallel.world_size", None)
    lines = _diff(old, new)
    if lines:
        raise ConfigError(f"cannot resume from {path}: it was written with a different parallel layout\n"
                          + "\n".join(lines) + "\nresume with the checkpoint's layout (override those keys back) "
                          "or start a new run")
    from miles_engine.evaluation.splits import resume_split_change

    split_change = resume_split_change(manifest["config"], dict(config))
    if split_change:
        raise ConfigError(f"cannot resume from {path}: {split_change}")
    if manifest["fingerprint"] == fingerprint(config, tokenizer_sha256):
        return
    lines = _diff(recipe_keys(manifest["config"]), recipe_keys(config))
    if manifest["tokenizer_sha256"] != tokenizer_sha256:
        lines.append(f"  tokenizer (sha256 of its JSON): checkpoint {manifest['tokenizer_sha256'][:16]}..., "
                     f"now {tokenizer_sha256[:16]}...")
    if not lines:  # written when more keys were fingerprinted (MUTABLE has grown since): nothing differs
        return
    raise ConfigError(f"cannot resume from {path}: the recipe is incompatible with the one it was written with\n"
                      + "\n".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
                      + f"\nonly these keys may change on resume: {', '.join(MUTABLE)}")
