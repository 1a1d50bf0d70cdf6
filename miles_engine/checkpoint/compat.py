"""What a checkpoint may be resumed with: the same parallel layout and a compatible recipe.

The recipe's keys split three ways. ``LAYOUT_KEYS`` describe how the trainer is laid out
(placement, FSDP ranks, device); the keys of ``MAY_CHANGE`` may change on resume (each with why:
run length, logging, concurrency, timeouts, how the engines are fed; nothing that changes the
model, the optimizer, the data order or the algorithm); every other key is part of the recipe
fingerprint and must be equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

LAYOUT_KEYS = ("placement.trainer", "trainer.parallel.world_size", "trainer.parallel.device")

# The keys that may change on resume (a key and everything under it), and why each may.
_SERVING = "engines start from the trainer's weights (pushed in full at the first push of every run)"
_CONCURRENCY = "concurrency, timeouts and logging: nothing that changes the model, the updates or the data order"
MAY_CHANGE: dict[str, str] = {
    "description": "text only",
    "eval": "evaluation reads the weights, never changes them; the train / eval split of the training tasks is "
            "checked on its own (a rule the caller passes: evaluation.splits.resume_split_change)",
    "metrics": _CONCURRENCY,
    "run": "run length, output and checkpoint cadence",
    "sft": "SFT happens before RL step 0: an RL checkpoint is past it (an SFT checkpoint checks its own keys)",
    "sandbox.options": "where episodes run, not what they are",
    "engines": _SERVING,
    "fleet": _SERVING,
    "weights": _SERVING,
    "placement.backend": "the same ranks in actors or in local processes save the same state",
    "placement.ray": "the same ranks in actors or in local processes save the same state",
    "trainer.backend": "both backends save the same HF-named trainer state, which any TP / PP / EP layout loads "
                       "(trainer/megatron/state.py); checkpoint_format=dist is Megatron's own format, which only "
                       "the megatron backend reads (refused with one error at restore)",
    "trainer.megatron": "the same: megatron to megatron, the world size may change too (see check)",
    "trainer.true_on_policy": "the same model and updates, only the forward's rounding differs (engines follow it)",
    "precision": "the trainer's master weights and optimizer state are full precision in every format: a new "
                 "contract quantises from them at the next push (a resume without an override keeps the format: "
                 "it loads the run's config.yaml)",
    "rollout.mode": "groups restored from the checkpoint are trained first in either mode",
    "rollout.on_update": "what a push does to the requests running at that moment; every token keeps its version",
    "rollout.max_inflight": _CONCURRENCY,
    "rollout.poll_s": _CONCURRENCY,
    "rollout.episode_timeout_s": _CONCURRENCY,
    "buffer.capacity_groups": _CONCURRENCY,
    "trainer.offload": "where the trainer's state waits between steps; training is bit-identical",
    "trainer.offload_dir": "where the trainer's state waits between steps; training is bit-identical",
    "trainer.optimizer_state": "where the optimizer state lives; training and checkpoints are bit-identical",
    "trainer.optimizer_state_dir": "where the optimizer state lives; training and checkpoints are bit-identical",
    "trainer.optimizer_bucket_mb": "how much optimizer state an update holds at once; bit-identical",
    "trainer.num_threads": _CONCURRENCY,
    "trainer.sft.num_threads": _CONCURRENCY,
    "trainer.parallel.start_timeout_s": _CONCURRENCY,
    "trainer.parallel.step_timeout_s": _CONCURRENCY,
    "session_server.diagnose_every": _CONCURRENCY,
    "session_server.otel": _CONCURRENCY,
    "session_server.max_sessions": _CONCURRENCY,
    "session_server.host": "where the session server listens",
    "session_server.port": "where the session server listens",
}
# A rule of a caller's: ``rule(checkpoint_config, config) -> why it may not resume | None``.
ResumeRule = Callable[[dict[str, Any], dict[str, Any]], "str | None"]


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
    return any(key == m or key.startswith(m + ".") for m in MAY_CHANGE)


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


def check(manifest: Mapping[str, Any], config: Mapping[str, Any], tokenizer_sha256: str, path: Path,
          rules: Sequence[ResumeRule] = ()) -> None:
    """Refuse (one :class:`ConfigError` naming every difference) unless ``config`` may resume ``path``;
    ``rules`` are the callers' own conditions, checked after the layout."""
    old, new = dict(manifest["layout"]), layout(config)
    if _backend(manifest["config"]) == _backend(config) == "megatron":  # the ranks reshard: any world size
        old.pop("trainer.parallel.world_size", None)
        new.pop("trainer.parallel.world_size", None)
    lines = _diff(old, new)
    if lines:
        raise ConfigError(f"cannot resume from {path}: it was written with a different parallel layout\n"
                          + "\n".join(lines) + "\nresume with the checkpoint's layout (override those keys back) "
                          "or start a new run")
    for rule in rules:
        why = rule(dict(manifest["config"]), dict(config))
        if why:
            raise ConfigError(f"cannot resume from {path}: {why}")
    if manifest["fingerprint"] == fingerprint(config, tokenizer_sha256):
        return
    lines = _diff(recipe_keys(manifest["config"]), recipe_keys(config))
    if manifest["tokenizer_sha256"] != tokenizer_sha256:
        lines.append(f"  tokenizer (sha256 of its JSON): checkpoint {manifest['tokenizer_sha256'][:16]}..., "
                     f"now {tokenizer_sha256[:16]}...")
    if not lines:  # written when more keys were fingerprinted (MAY_CHANGE has grown since): nothing differs
        return
    raise ConfigError(f"cannot resume from {path}: the recipe is incompatible with the one it was written with\n"
                      + "\n".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
                      + f"\nonly these keys may change on resume: {', '.join(MAY_CHANGE)}")
