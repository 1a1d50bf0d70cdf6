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


def policy_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's HF tensors of a trainer state dict (either backend)."""
    model = state.get("model") or {}
    out = {k[len("policy."):]: v for k, v in model.items() if k.startswith("policy.")}
    if not out:
        raise ValueError("the state has no policy tensors (model['policy.*'])")
    return out


def to_hf_dir(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], source: Any,
              out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write ``tensors`` (HF names) as a model directory with ``source``'s config."""
    from miles_engine.engines.embedded.loading import load_model

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
