"""LoRA adapters on the wire: an engine that keeps its base weights receives ``A``, ``B`` and the
scaling of each adapted module instead of the merged ``W + scaling * B @ A``.

A weight ``W`` travels as ``W:lora.A`` (r x in), ``W:lora.B`` (out x r) and ``W:lora.scaling``
(one float64). Both sides merge with :func:`merge` - the trainer to check, the engine to serve - so
an engine whose base equals the trainer's (in float32) holds bit for bit the weights a merged push
would have given it. Shapes follow from ``W``'s and the rank the parts carry (:func:`problems`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

SEPARATOR = ":lora."
PARTS = ("A", "B", "scaling")


def part_name(weight: str, part: str) -> str:
    return f"{weight}{SEPARATOR}{part}"


def split_name(name: str) -> tuple[str, str] | None:
    """``(weight name, part)`` of an adapter part's name; None for any other tensor's."""
    base, sep, part = name.rpartition(SEPARATOR)
    return (base, part) if sep and part in PARTS else None


def merge(base: Any, a: Any, b: Any, scaling: float) -> Any:
    """``base + scaling * B @ A`` computed in float32 (the one merge both sides run)."""
    import torch

    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scaling
    return base.to(torch.float32) + delta


def scaling_of(t: Any) -> float:
    return float(t.reshape(-1)[0].item())


def to_parts(weight: str, a: Any, b: Any, scaling: float) -> list[tuple[str, Any]]:
    import torch

    return [(part_name(weight, "A"), a), (part_name(weight, "B"), b),
            (part_name(weight, "scaling"), torch.tensor([scaling], dtype=torch.float64))]


def group(named: Iterable[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Split ``(name, tensor)`` pairs into plain tensors and ``{weight: {part: tensor}}``."""
    plain: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, value in named:
        split = split_name(name) if isinstance(name, str) else None
        if split is None:
            plain[name] = value
        else:
            parts.setdefault(split[0], {})[split[1]] = value
    return plain, parts


def part_problem(weight: str, shape: tuple[int, ...], part: str, dtype: str, part_shape: tuple[int, ...]) -> str | None:
    """What is wrong with one part (``dtype`` name, ``part_shape``) of weight ``weight`` of ``shape``."""
    name = part_name(weight, part)
    if len(shape) != 2:
        return f"{name!r}: {weight!r} has shape {tuple(shape)}; only a 2-D weight takes an adapter"
    if part == "scaling":
        ok = (dtype, tuple(part_shape)) == ("float64", (1,))
        return None if ok else f"{name!r} is {dtype} {tuple(part_shape)}, not float64 (1,)"
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        return f"{name!r} is {dtype}: adapters are floating point"
    axis, want = (1, shape[1]) if part == "A" else (0, shape[0])
    if len(part_shape) != 2 or part_shape[axis] != want:
        layout = f"r x {shape[1]}" if part == "A" else f"{shape[0]} x r"
        return f"{name!r} has shape {tuple(part_shape)}; {weight!r} {tuple(shape)} takes {part} of {layout}"
    return None


def problems(weight: str, shape: tuple[int, ...], specs: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """What is wrong with the parts ``{part: (dtype name, shape)}`` of weight ``weight`` of ``shape``
    (empty: they merge into it). All three parts must be there, A and B of one rank."""
    missing = [p for p in PARTS if p not in specs]
    if missing:
        return [f"{weight!r}: adapter part(s) {', '.join(missing)} missing (an adapter push carries A, B and scaling)"]
    found = [bad for p in PARTS if (bad := part_problem(weight, shape, p, *specs[p])) is not None]
    if not found and specs["A"][1][0] != specs["B"][1][1]:
        found.append(f"{weight!r}: A {tuple(specs['A'][1])} and B {tuple(specs['B'][1])} differ in rank")
    return found


class AdapterExport(list):  # type: ignore[type-arg]
    """A push's ``(name, tensor)`` pairs in adapter form, with the trainer's base weights
    (``{W: tensor}``, references to its frozen ones) so a check can merge what the engines must hold."""

    def __init__(self, pairs: Iterable[tuple[str, Any]], bases: Mapping[str, Any]) -> None:
        super().__init__(pairs)
        self.bases = dict(bases)

    def effective(self) -> dict[str, Any]:
        """``{W: the merged float32 weight}`` of every adapted module."""
        _, parts = group(self)
        return {w: merge(self.bases[w], p["A"], p["B"], scaling_of(p["scaling"])) for w, p in parts.items()
                if w in self.bases}

    def with_pairs(self, pairs: Iterable[tuple[str, Any]]) -> AdapterExport:
        return AdapterExport(pairs, self.bases)


def base_digest(t: Any) -> str:
    """sha256 of a base weight as float32 (what :func:`merge` starts from), to compare bases across processes."""
    import hashlib

    import torch

    data = t.detach().to("cpu", torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{tuple(t.shape)}".encode() + data).hexdigest()
