"""Typed options of check-weight-update-equal (no torch: the recipe config imports this model).

Semantics, stated once (the docs and errors refer here):

- **exact** (``check_tolerance`` unset, the default): after a push, every tensor the trainer
  exported must be bit for bit the trainer's tensor *cast to the engine's dtype* (the cast every
  transport applies: floating point to the engine's floating dtype, round to nearest even). So a
  bfloat16 engine fed by a float32 trainer passes exactly; any other difference fails.
- **tolerance** (``check_tolerance: {atol, rtol}``): for engines whose load path is lossy beyond
  a plain cast (quantised formats). A tensor whose bytes differ from the exact expectation still
  passes when every element satisfies ``|engine - trainer| <= atol + rtol * |trainer|``, computed
  in float64 against the trainer's own un-cast values; a NaN or inf must sit where the trainer
  has the same value.
"""

from __future__ import annotations

from pydantic import Field

from miles_engine.components import Section


class CheckTolerance(Section):
    atol: float = Field(0.0, ge=0, description="absolute tolerance per element")
    rtol: float = Field(0.0, ge=0, description="relative tolerance per element (of the trainer's value)")

    def describe(self) -> str:
        return f"|diff| <= {self.atol:g} + {self.rtol:g}*|trainer|"


class CheckOptions(Section):
    """What :class:`~miles_engine.weights.check.transport.CheckedTransport` enforces."""

    tolerance: CheckTolerance | None = Field(None, description="None: exact (see the module docstring)")
    fill_chunk_bytes: int = Field(256 << 20, ge=1, description="the pre-push random fill is sent to an engine in "
                                  "updates of at most this many bytes")
    show: int | None = Field(None, ge=1, description="name at most this many tensors per engine in the error "
                             "(the count is always given); None names every one")
