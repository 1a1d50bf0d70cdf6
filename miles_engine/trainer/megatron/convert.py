"""A Megatron-backend checkpoint (or any HF-named tensors) as a Hugging Face model directory.

    state = trainer.state_dict()                      # or the trainer state of a run checkpoint
    to_hf_dir(policy_tensors(state), "tiny:qwen3", "out/hf")

The model part of the backend's checkpoints is already under HF names (see :mod:`.state`), so
conversion is: an HF model of the source's config, those tensors loaded strictly, then
``save_pretrained`` into a temporary directory renamed into place (never a half-written one).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from miles_engine.models.loading import load_model
from miles_engine.trainer.factory import create_trainer
from miles_engine.trainer.megatron.dist_checkpoint import load_policy


def policy_tensors(state: Mapping[str, Any], source: Any = None) -> dict[str, torch.Tensor]:
    """The policy's HF tensors of a trainer state dict (either backend). A state in Megatron's
    distributed format (``checkpoint_format=dist``, as :func:`miles_engine.checkpoint.store.load`
    returns it) is read by one Megatron rank at TP=1 built from ``source`` (the run's model)."""
    if state.get("dist_checkpoint_path"):
        if source is None:
            raise ValueError("a Megatron distributed checkpoint needs the model source to convert")
        return dist_policy_tensors(state["dist_checkpoint_path"], source)
    model = state.get("model") or {}
    out = {k[len("policy."):]: v for k, v in model.items() if k.startswith("policy.")}
    if not out:
        raise ValueError("the state has no policy tensors (model['policy.*'])")
    return out


def to_hf_dir(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], source: Any,
              out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write ``tensors`` (HF names) as a model directory with ``source``'s config."""
    named = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
    model, _ = load_model(source, dtype=dtype)
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - named.keys()), sorted(named.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"tensors do not fit {type(model).__name__}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in named.items()}, strict=True)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def dist_policy_tensors(directory: str | Path, source: Any) -> dict[str, torch.Tensor]:
    """The policy's HF tensors of a Megatron distributed checkpoint directory (any TP / PP / EP it
    was written with): one TP=1 rank of ``source``'s model loads it, resharded, and gathers."""
    with create_trainer(source, {"backend": "megatron"}, world_size=1) as trainer:
        trainer.call(_load_policy, str(directory))
        return dict(trainer.named_tensors())


def _load_policy(trainer: Any, directory: str) -> None:
    load_policy(trainer, directory)
