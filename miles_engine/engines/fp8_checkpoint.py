"""The precision contract's ``fp8`` on a vLLM or SGLang server: the policy saved as a fine-grained
FP8 checkpoint (the first stage, :mod:`miles_engine.precision.checkpoint`) that the server loads as
is, the rule that makes it compute with exactly the quantizer's values, and what it holds (the
weight metadata a server that does not publish its own is given).

Both fuse some linear layers into one (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` ->
``gate_up_proj``: their models' ``packed_modules_mapping`` / ``stacked_params_mapping``) and
concatenate their 128x128 scale tiles. A weight whose rows are not a multiple of 128 (SmolLM2's
192-row ``k_proj``) leaves the next weight's rows under tiles that scaled other rows: the server
then computes with other values than the trainer's quantizer (measured on vLLM: log-prob gap 0.35
against our FP8 engine, 0.018 with those layers kept in high precision). And a fused layer holds
one format, so its parts are all quantised or all kept. Both are refused here, naming the weights
and the exception to add.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_engine.errors import ConfigError

if TYPE_CHECKING:
    from miles_engine.engines.protocol import TensorMeta

TILE = 128
# the linear layers vLLM and SGLang model definitions pack into one
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
FUSED_AS = {FUSED[0]: "qkv_proj", FUSED[1]: "gate_up_proj"}  # the fused parameter's name
SERVERS = {"vllm": "vLLM", "sglang": "SGLang"}


def fused_group_problems(shapes: Mapping[str, tuple[int, ...]], quantised: Iterable[str],
                         server: str = "vLLM") -> list[str]:
    """Why the FP8 weights ``quantised`` (of a model whose weight shapes are ``shapes``) cannot be
    served by ``server``'s fused layers with their own scales: one line per fused group at fault."""
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
                problems.append(f"{server} fuses {', '.join(members)} into one layer of one format, and {held[0]} is "
                                f"fp8 while {kept[0]} is kept in high precision: keep all or none of them (add "
                                f"{pattern} to precision.exceptions)")
            elif held and any(shapes[m][0] % TILE for m in held[:-1]):
                rows = ", ".join(f"{m} {shapes[m][0]}" for m in held)
                problems.append(f"{server} fuses {', '.join(held)} into one layer and concatenates their {TILE}x{TILE} "
                                f"scale tiles, but their rows ({rows}) are not all multiples of {TILE}: the fused "
                                f"tiles would scale rows of two weights, not the quantizer's values. Keep them in "
                                f"high precision: add {pattern} to precision.exceptions")
    return problems


RECEIVED_FORMATS = ("full", "fp8")


def server_refusal(kind: str, weight_format: str, kv_cache: str, dtype: str, *, formats_why: str,
                   kv_flag: str) -> str | None:
    """Why a ``kind`` server (vllm, sglang) cannot keep this precision contract (None: it can): it
    receives the FP8 checkpoint's weights with bfloat16 activations, and no FP8 KV cache of ours."""
    server = SERVERS[kind]
    if weight_format not in RECEIVED_FORMATS:
        return (f"precision.rollout={weight_format!r}: {kind} engines receive {', '.join(RECEIVED_FORMATS)} "
                f"({formats_why}); kinds embedded and server hold every format")
    if kv_cache != "full":
        return (f"precision.kv_cache={kv_cache!r}: {server}'s FP8 KV cache ({kv_flag}) scales a whole layer's keys "
                f"and values with one number, not the contract's scale per token and head, so it would attend over "
                f"other values; kinds embedded and server hold it")
    if weight_format == "fp8" and dtype != "bfloat16":
        return (f"precision.rollout='fp8' with dtype {dtype!r}: {server}'s FP8 linear kernels take bfloat16 "
                f"activations; set the group's dtype to bfloat16")
    return None


def fused_scale_rows(name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int, int, int] | None:
    """Where part ``name`` of a fused layer finds its tile scales once fused (the server holds one
    ``<owner>.qkv_proj.weight_scale_inv``, the parts' tiles stacked in order): that name, the
    part's first tile row, its tile rows and the fused parameter's; None for a weight not fused."""
    owner, _, leaf = name.removesuffix(".weight").rpartition(".")
    for group in FUSED:
        if leaf in group:
            tiles = [-(-shapes.get(f"{owner}.{m}.weight", (0,))[0] // TILE) for m in group]
            at = group.index(leaf)
            return f"{owner}.{FUSED_AS[group]}.weight_scale_inv", sum(tiles[:at]), tiles[at], sum(tiles)
    return None


def _pattern(owner: str, group: tuple[str, ...]) -> str:
    """The exception patterns of a fused group in every layer, quoted: ``model.layers.3.self_attn`` +
    (q, k, v) -> ``'model.layers.*.self_attn.[qkv]_proj.weight'``."""
    owner = re.sub(r"\.\d+(?=\.|$)", ".*", owner)
    heads = [m.removesuffix("_proj") for m in group]
    if all(len(h) == 1 for h in heads):
        return f"'{owner}.[{''.join(heads)}]_proj.weight'"
    return ", ".join(f"'{owner}.{m}.weight'" for m in group)


def save_fp8_policy(model: Any, dest: Path, exceptions: Iterable[str], kind: str = "vllm") -> str:
    """``model`` as the FP8 checkpoint a ``kind`` server loads (once per run: an existing one is
    reused); a contract the server cannot keep is one ConfigError before any server starts."""
    from miles_engine.precision.checkpoint import save_quantized
    from miles_engine.precision.quantizer import QuantizeError
    from miles_engine.precision.targets import is_stacked, quantized_weights

    exceptions = list(exceptions)
    try:
        names = quantized_weights(model, "fp8", exceptions)
    except QuantizeError as exc:
        raise ConfigError(str(exc)) from None
    stacked = sorted(n for n in names if is_stacked(n))
    if stacked:
        raise ConfigError(f"precision.rollout='fp8' on {kind} engines: {SERVERS.get(kind, kind)} loads a MoE layer's "
                          f"FP8 experts one by one by name (mlp.experts.N.gate_proj.weight and their scales), and "
                          f"this policy's experts are stacked ({stacked[0]}); keep them in high precision: add "
                          f"'*.mlp.experts.*' to precision.exceptions (kinds embedded and server quantise them)")
    problems = fused_group_problems({n: tuple(t.shape) for n, t in model.state_dict().items()}, names,
                                    SERVERS.get(kind, kind))
    if problems:
        shown = problems[:3] + ([f"and {len(problems) - 3} more groups"] if len(problems) > 3 else [])
        raise ConfigError(f"precision.rollout='fp8' on {kind} engines: " + "; ".join(shown))
    if (dest / "config.json").is_file() and _contract(dest) == ("fp8", exceptions):
        return str(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_quantized(model, tmp, "fp8", exceptions)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return str(dest)


def policy_checkpoint(model: Any, dest: Path, exceptions: Iterable[str], kind: str) -> str:
    """The policy (an instance, or a path / spec loaded once here) as ``kind``'s FP8 checkpoint."""
    if not hasattr(model, "state_dict"):
        from miles_engine.models.loading import load_model

        model = load_model(str(model), dtype="float32")[0]
    return save_fp8_policy(model, dest, exceptions, kind)


def held_metadata(directory: str | Path, dtype: str) -> list[TensorMeta]:
    """What a server holds once it loaded the FP8 checkpoint ``directory`` computing in ``dtype``:
    every tensor of the model (the safetensors headers: nothing is read), the FP8 ones with format
    ``fp8`` (so a push ships the quantizer's codes and scales for them), the scales themselves not
    listed (they travel as their weight's part)."""
    from safetensors import safe_open

    from miles_engine.engines.protocol import TensorMeta
    from miles_engine.precision.checkpoint import SCALE_SUFFIX, scale_name

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                shapes[name] = (tuple(piece.get_shape()), piece.get_dtype())
    if not shapes:
        raise ConfigError(f"{directory}: no safetensors files (an FP8 checkpoint holds model.safetensors)")
    out = []
    for name, (shape, stored) in sorted(shapes.items()):
        if name.endswith(SCALE_SUFFIX):
            continue
        fp8 = stored == "F8_E4M3"
        if fp8 and scale_name(name) not in shapes:
            raise ConfigError(f"{directory}: {name} is float8 without its {SCALE_SUFFIX}")
        out.append(TensorMeta(name, dtype, shape, "fp8" if fp8 else None))
    return out


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
