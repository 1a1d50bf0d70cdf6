"""The quantised formats a precision contract can name, and how each lays out a tensor.

Every format splits a tensor (viewed as ``[rows, cols]``: all leading dimensions flattened,
``cols`` the last one, the contraction axis of a ``Linear`` weight) into blocks that share a
scale:

==========  ===========  ==================  =====================================================
format      element      block               scale
==========  ===========  ==================  =====================================================
fp8         E4M3         128 x 128 tiles     float32 per tile, ``amax / 448`` (DeepSeek-V3 style)
mxfp8       E4M3         1 x 32              UE8M0 per block (OCP MX v1.0)
nvfp4       E2M1         1 x 16              E4M3 per block, float32 per tensor (NVIDIA NVFP4)
int4        INT4         1 x 32              float32 per group, ``amax / 7`` (symmetric)
==========  ===========  ==================  =====================================================

``fp8`` accepts any shape (edge tiles are partial); the 1-D-block formats need ``cols`` to be a
multiple of the block (a tensor that is not goes on the contract's exception list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FormatName = Literal["fp8", "mxfp8", "nvfp4", "int4"]


@dataclass(frozen=True)
class QuantFormat:
    name: FormatName
    element: Literal["e4m3", "e2m1", "int4"]
    block_rows: int
    block_cols: int
    element_bits: int
    summary: str

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte."""
        return self.element_bits == 4


FORMATS: dict[str, QuantFormat] = {
    "fp8": QuantFormat("fp8", "e4m3", 128, 128, 8, "FP8 E4M3, a float32 scale per 128x128 tile"),
    "mxfp8": QuantFormat("mxfp8", "e4m3", 1, 32, 8, "MXFP8: 32 E4M3 values share a UE8M0 (power of two) scale"),
    "nvfp4": QuantFormat("nvfp4", "e2m1", 1, 16, 4,
                         "NVFP4: 16 E2M1 values share an E4M3 scale, a float32 scale per tensor on top"),
    "int4": QuantFormat("int4", "int4", 1, 32, 4, "INT4: 32 signed 4-bit integers share a float32 scale"),
}


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown quantised format {name!r}; formats: {', '.join(FORMATS)}") from None
