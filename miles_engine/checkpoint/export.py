"""``miles export RUN_DIR [--merged] DEST``: a run's newest checkpoint as a Hugging Face directory.

The base model is the run's model source (``model.path``: an HF directory, a GGUF file or
``package:``); the checkpoint holds the policy (full fine-tuning) or its LoRA adapters. With
``--merged`` (implied without LoRA) DEST is a plain model directory (``config.json``,
``model.safetensors``, the tokenizer with its chat template) that ``transformers`` loads and
generates from; without it, a LoRA run exports a peft adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors`` + the tokenizer). DEST is written
under a temporary name and renamed into place: never half-written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles_engine import checkpoint
from miles_engine.errors import ConfigError
from miles_engine.models.source import chat_template, resolve
from miles_engine.trainer import lora


def _run_config(run_dir: Path) -> dict[str, Any]:
    file = run_dir / "config.yaml"
    if not file.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml - not a training run directory")
    return yaml.safe_load(file.read_text()) or {}


POLICY_PREFIX = "policy."  # the trainer's state dict holds the policy under this module name


@dataclass
class PolicyWeights:
    """A checkpoint's policy tensors under Hugging Face names (LoRA runs: base and adapters)."""

    path: Path
    step: int
    weight_version: int
    tensors: dict[str, Any]
    tokenizer_sha256: str | None


def read_policy(path: Path, *, base: Any = None, label: str = "checkpoint") -> PolicyWeights:
    """The policy of one checkpoint directory (``RUN_DIR/checkpoints/step_NNNNNNNN``), checked as a
    resume checks it. Megatron's distributed format is read through its shards onto ``base`` (the
    run's model source); without one it is refused, naming ``miles export``."""
    if not (path / "manifest.json").is_file():
        raise ConfigError(f"{label} {path}: no manifest.json there; pass a checkpoint directory "
                          f"(RUN_DIR/checkpoints/step_NNNNNNNN)")
    loaded = checkpoint.load(path)
    state, manifest = loaded.trainer_state, loaded.manifest
    if state.get("dist_checkpoint_path"):  # Megatron's distributed format (any TP / PP / EP)
        if base is None:
            raise ConfigError(f"{label} {path}: written in Megatron's distributed format "
                              f"(trainer.megatron.checkpoint_format=dist); convert it to a Hugging Face directory "
                              f"first (`miles export RUN_DIR DEST`) and use that")
        from miles_engine.trainer.megatron.convert import dist_policy_tensors

        tensors = dist_policy_tensors(state["dist_checkpoint_path"], base)
    else:
        model = state.get("model") or {}
        tensors = {k.removeprefix(POLICY_PREFIX): v for k, v in model.items() if k.startswith(POLICY_PREFIX)}
        if not tensors:
            raise ConfigError(f"{label} {path}: trainer.pt holds no '{POLICY_PREFIX}*' policy tensors")
    version = manifest.get("weight_version", state["weight_version"])  # the trainer state's when the manifest has none
    return PolicyWeights(path, loaded.step, int(version), tensors, manifest.get("tokenizer_sha256"))


def merge_adapters(base: dict[str, Any], adapters: dict[str, Any], scaling: float) -> dict[str, Any]:
    """``base`` (HF names) with ``W + scaling * B @ A`` for every adapted module."""
    merged = dict(base)
    for module in lora.adapted_modules(adapters):
        name = f"{module}.weight"
        if name not in base:
            raise ConfigError(f"checkpoint adapter {module!r} has no base weight {name!r} in the model source")
        full = {**adapters, f"{module}.base_layer.weight": base[name]}
        merged[name] = lora.engine_tensors({k: v for k, v in full.items() if k.startswith(module + ".")},
                                           scaling)[name]
    return merged


def _save_tokenizer(source: Any, dest: Path) -> None:
    from transformers import AutoTokenizer

    d = source.directory
    if source.kind == "gguf":
        tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name, local_files_only=True)
    elif d is not None and ((d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()):
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    else:
        return
    template = chat_template(source)
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(dest))


def save_model(model: Any, dest: Path, fmt: str = "full", exceptions: Sequence[str] = ()) -> None:
    """``model`` as a Hugging Face directory, its weights in ``fmt`` (the first stage of the precision
    contract: :mod:`miles_engine.precision.checkpoint`; ``miles_engine.models.loading`` reads it back)."""
    if fmt == "full":
        model.save_pretrained(str(dest), safe_serialization=True)
        return
    from miles_engine.precision.checkpoint import save_quantized

    save_quantized(model, dest, fmt, exceptions)


def export_run(run_dir: str | Path, dest: str | Path, *, merged: bool = False, fmt: str | None = None) -> Path:
    """``fmt``: the weights' format (default: the run's ``precision.rollout``, what its engines served)."""
    from miles_engine.models.loading import load_model

    run_dir, dest = Path(run_dir), Path(dest)
    if dest.is_file() or (dest.is_dir() and any(dest.iterdir())):
        raise ConfigError(f"export destination {dest} exists and is not empty")
    cfg = _run_config(run_dir)
    precision = cfg.get("precision") or {}
    fmt = fmt or precision.get("rollout") or "full"
    spec = (cfg.get("model") or {}).get("path")
    if not spec:
        raise ConfigError(f"{run_dir}: the run trained a from-scratch policy (model.path unset); export needs a "
                          f"model source (an HF directory, a GGUF file or package:<module>) as its base")
    opts = lora.LoraOptions(**((cfg.get("trainer") or {}).get("lora") or {}))
    if fmt != "full" and opts.enabled and not merged:
        raise ConfigError(f"--format {fmt} quantises a model's weights: a LoRA run exports them with --merged "
                          f"(an adapter directory is not quantised)")
    newest = checkpoint.latest(run_dir)
    if newest is None:
        raise ConfigError(f"{run_dir}: no checkpoint under {checkpoint.checkpoint_dir(run_dir)} to export")
    policy = read_policy(newest, base=spec)
    state, step = policy.tensors, policy.step
    source = resolve(spec)
    model, _ = load_model(spec, dtype="float32")
    base = {k: v for k, v in model.state_dict().items()}
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if opts.enabled and not merged:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in lora.adapter_file_state(state).items()},
                      str(tmp / "adapter_model.safetensors"))
            targets = sorted({m.rsplit(".", 1)[-1] for m in lora.adapted_modules(state)})
            (tmp / "adapter_config.json").write_text(json.dumps({
                "peft_type": "LORA", "base_model_name_or_path": str(source.path or spec), "r": opts.rank,
                "lora_alpha": opts.alpha, "lora_dropout": opts.dropout, "target_modules": targets, "bias": "none",
                "task_type": "CAUSAL_LM", "inference_mode": True}, indent=1))
        else:
            weights = merge_adapters(base, lora.adapter_state(state), opts.scaling) if opts.enabled else state
            missing = sorted(set(base) - set(weights))
            if missing and not opts.enabled:
                raise ConfigError(f"checkpoint of {run_dir} lacks policy tensors {missing[:5]}")
            model.load_state_dict(weights, strict=True)
            save_model(model, tmp, fmt, precision.get("exceptions") or ())
        _save_tokenizer(source, tmp)
        (tmp / "miles_export.json").write_text(json.dumps(
            {"run": str(run_dir), "step": step, "source": spec, "merged": merged or not opts.enabled, "format": fmt,
             "lora": opts.model_dump() if opts.enabled else None}, indent=1))
        if dest.is_dir():
            dest.rmdir()  # empty (checked above)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
