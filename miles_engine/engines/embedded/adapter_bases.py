"""Adapter-only pushes in the embedded engine (``weights.lora=adapters``): the engine keeps the base
it loaded for every adapted weight and serves ``base + scaling * B @ A`` merged by the same function
as the trainer's (:func:`miles_engine.models.adapters.merge`), so a push carries only A, B and the
scaling. The base is kept when the transport asks (before anything overwrites the weight) or, on an
engine that has not been written since it loaded (a restart), at the first adapter push."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from miles_engine.errors import WeightUpdateError, did_you_mean
from miles_engine.models import adapters


class Update(NamedTuple):
    tensors: dict[str, torch.Tensor]  # what is copied into the model
    plain: dict[str, Any]  # the update's tensors as sent, adapter parts merged
    parts: dict[str, torch.Tensor]  # the adapter parts merged


class AdapterBases:
    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}
        self.parts: dict[str, torch.Tensor] = {}  # the adapters last merged, under their part names (read back)
        self.replaced: set[str] = set()  # written whole since the engine loaded: their loaded base is gone

    def keep(self, names: Iterable[str], model: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """Keep the bases of ``names`` (no-op for those kept); their float32 digests."""
        out = {}
        for name in names:
            if name not in self.bases:
                self.bases[name] = self._loaded(name, model)
            out[name] = adapters.base_digest(self.bases[name])
        return out

    def _loaded(self, name: str, model: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ref = model.get(name)
        if ref is None:
            raise WeightUpdateError(f"adapter push refused, nothing was changed: the engine has no tensor "
                                    f"{name!r}{did_you_mean(name, model)}")
        if name in self.replaced:
            raise WeightUpdateError(f"adapter push refused, nothing was changed: {name!r} was overwritten by a whole "
                                    f"tensor before its base was kept, so there is no base to merge adapters into "
                                    f"(the weight transport keeps the bases before the first push)")
        return ref.detach().clone()

    def join(self, weights: Mapping[str, Any], model: Mapping[str, torch.Tensor],
             quantised: Collection[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``weights`` with every adapted weight's parts replaced by the merged weight (in the
        model's dtype), and the parts themselves. Everything is checked before anything merges."""
        plain, grouped = adapters.group(weights.items())
        if not grouped:
            return dict(weights), {}
        problems = []
        for weight, parts in grouped.items():
            ref = model.get(weight)
            if ref is None:
                problems.append(f"unknown tensor {weight!r}{did_you_mean(weight, model)}")
            elif weight in quantised:
                problems.append(f"{weight!r} is held quantised; adapters merge into full-precision weights only")
            elif weight in plain:
                problems.append(f"{weight!r} arrives both whole and as adapter parts")
            else:
                specs = {p: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for p, t in parts.items()
                         if isinstance(t, torch.Tensor)}
                problems += adapters.problems(weight, tuple(ref.shape), specs)
        if problems:
            raise WeightUpdateError("adapter push refused, nothing was changed: " + "; ".join(problems[:5]))
        bases = {w: self.bases.get(w) if w in self.bases else self._loaded(w, model) for w in grouped}
        self.bases.update(bases)
        for weight, parts in grouped.items():
            merged = adapters.merge(bases[weight], parts["A"], parts["B"], adapters.scaling_of(parts["scaling"]))
            plain[weight] = merged.to(model[weight].dtype)
        return plain, {adapters.part_name(w, p): t.detach().clone() for w, ps in grouped.items() for p, t in ps.items()}

    def applied(self, plain_names: Iterable[str], parts: Mapping[str, torch.Tensor]) -> None:
        """After an update: whole tensors replaced their loaded bases; the parts are what is served."""
        merged = {adapters.split_name(n)[0] for n in parts}  # type: ignore[index]
        self.replaced.update(n for n in plain_names if n not in merged)
        self.parts.update(parts)
