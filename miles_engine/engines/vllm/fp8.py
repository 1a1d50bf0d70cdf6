"""The precision contract's ``fp8`` on a vLLM server: the policy saved as a fine-grained FP8
checkpoint (the first stage, :mod:`miles_engine.precision.checkpoint`) that vLLM loads as is, and
the rule that makes vLLM compute with exactly the quantizer's values.

vLLM fuses some linear layers into one (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` ->
``gate_up_proj``) and concatenates their 128x128 scale tiles. A weight whose rows are not a
multiple of 128 (SmolLM2's 192-row ``k_proj``) leaves the next weight's rows under tiles that
scaled other rows: vLLM then computes with other values than the trainer's quantizer (measured:
log-prob gap 0.35 against our FP8 engine, 0.018 with those layers kept in high precision). And a
fused layer holds one format, so its parts are all quantised or all kept. Both are refused here,
naming the weights and the exception to add.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

TILE = 128
# the linear layers vLLM's model definitions pack into one (their ``packed_modules_mapping``)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_group_problems(shapes: Mapping[str, tuple[int, ...]], quantised: Iterable[str]) -> list[str]:
    """Why the FP8 weights ``quantised`` (of a model whose weight shapes are ``shapes``) cannot be
    served by vLLM's fused layers with their own scales: one line per fused group at fault."""
    quantised = set(quantised)
    problems, seen = [], set()
    for name in sorted(shapes):
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        for group in FUSED:
            if leaf not in group or (owner, group) in seen:
                continue
            seen.add((owner, group))
            members = [f"{owner}.{m}.weight" for m in group if f"{owner}.{m}.weight" in shapes]
            held = [m for m in members if m in quantised]
            pattern = _pattern(owner, group)
            if held and len(held) != len(members):
                kept = [m for m in members if m not in quantised]
                problems.append(f"vLLM fuses {', '.join(members)} into one layer of one format, and {held[0]} is "
                                f"fp8 while {kept[0]} is kept in high precision: keep all or none of them (add "
                                f"{pattern} to precision.exceptions)")
            elif held and any(shapes[m][0] % TILE for m in held[:-1]):
                rows = ", ".join(f"{m} {shapes[m][0]}" for m in held)
                problems.append(f"vLLM fuses {', '.join(held)} into one layer and concatenates their {TILE}x{TILE} "
                                f"scale tiles, but their rows ({rows}) are not all multiples of {TILE}: the fused "
                                f"tiles would scale rows of two weights, not the quantizer's values. Keep them in "
                                f"high precision: add {pattern} to precision.exceptions")
    return problems


def _pattern(owner: str, group: tuple[str, ...]) -> str:
    """The exception patterns of a fused group in every layer, quoted: ``model.layers.3.self_attn`` +
    (q, k, v) -> ``'model.layers.*.self_attn.[qkv]_proj.weight'``."""
    owner = re.sub(r"\.\d+(?=\.|$)", ".*", owner)
    heads = [m.removesuffix("_proj") for m in group]
    if all(len(h) == 1 for h in heads):
        return f"'{owner}.[{''.join(heads)}]_proj.weight'"
    return ", ".join(f"'{owner}.{m}.weight'" for m in group)


def save_fp8_policy(model: Any, dest: Path, exceptions: Iterable[str]) -> str:
    """``model`` as the FP8 checkpoint vLLM serves (once per run: an existing one is reused);
    a contract vLLM cannot keep is one ConfigError before any server starts."""
    from miles_engine.precision.checkpoint import save_quantized
    from miles_engine.precision.quantizer import QuantizeError
    from miles_engine.precision.targets import quantized_weights

    exceptions = list(exceptions)
    try:
        names = quantized_weights(model, "fp8", exceptions)
    except QuantizeError as exc:
        raise ConfigError(str(exc)) from None
    problems = fused_group_problems({n: tuple(t.shape) for n, t in model.state_dict().items()}, names)
    if problems:
        shown = problems[:3] + ([f"and {len(problems) - 3} more groups"] if len(problems) > 3 else [])
        raise ConfigError("precision.rollout='fp8' on vllm engines: " + "; ".join(shown))
    if (dest / "config.json").is_file() and _contract(dest) == ("fp8", exceptions):
        return str(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_quantized(model, tmp, "fp8", exceptions)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return str(dest)


def _contract(directory: Path) -> tuple[str, list[str]] | None:
    from miles_engine.precision.checkpoint import contract_of

    try:
        record = contract_of(json.loads((directory / "config.json").read_text()))
    except (OSError, ValueError):
        return None
    return None if record is None else (record["format"], list(record["exceptions"]))


def check_model_path(directory: str, exceptions: Iterable[str]) -> None:
    """``options.model_path`` under ``precision.rollout=fp8``: a directory written under this contract."""
    found = _contract(Path(directory))
    want = ("fp8", list(exceptions))
    if found != want:
        said = "a full-precision or unreadable checkpoint" if found is None else \
            f"format {found[0]!r} with exceptions {found[1]}"
        raise ConfigError(f"engines.N.options.model_path={directory!r} is {said}; precision.rollout='fp8' needs the "
                          f"FP8 checkpoint of this contract (exceptions {want[1]}): leave model_path unset (the run "
                          f"writes it) or write it with `miles convert --format fp8`")
