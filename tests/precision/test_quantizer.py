"""The quantizer is bit-exact against the slow reference written from the specifications, on random
tensors of many scales and on every special case: ties, saturation, subnormals, zero, NaN and
infinite blocks, a block scale that underflows."""

from __future__ import annotations

import math

import pytest
import torch

from miles_engine.precision import elements as el
from miles_engine.precision.quantizer import QuantizeError, dequantize, fake_quantize, quantize
from tests.precision import reference as ref

FORMATS = ("fp8", "mxfp8", "nvfp4", "int4")


def reference(x: torch.Tensor, fmt: str) -> tuple[list[int], list[float]]:
    """(element codes row-major, block scales row-major) from the reference; a stack of matrices
    (``[experts, out, in]``) quantised matrix by matrix, in order."""
    if x.dim() > 2:
        each = [reference(m, fmt) for m in x.reshape(-1, *x.shape[-2:])]
        return [c for codes, _ in each for c in codes], [s for _, scales in each for s in scales]
    m = x.float().reshape(-1, x.shape[-1])
    rows, cols = m.shape
    values = [[float(v) for v in row] for row in m.tolist()]
    codes = [[0] * cols for _ in range(rows)]
    scales: list[float] = []
    if fmt == "fp8":
        for tr in range(0, rows, 128):
            for tc in range(0, cols, 128):
                tile = [values[r][c] for r in range(tr, min(tr + 128, rows)) for c in range(tc, min(tc + 128, cols))]
                got, scale = ref.fp8_tile(tile)
                scales.append(scale)
                it = iter(got)
                for r in range(tr, min(tr + 128, rows)):
                    for c in range(tc, min(tc + 128, cols)):
                        codes[r][c] = next(it)
        return [c for row in codes for c in row], scales
    size = {"mxfp8": 32, "nvfp4": 16, "int4": 32}[fmt]
    g = ref.nvfp4_tensor_scale([v for row in values for v in row])
    for r in range(rows):
        for b in range(0, cols, size):
            block = values[r][b:b + size]
            if fmt == "mxfp8":
                got, scale = ref.mxfp8_block(block)
            elif fmt == "nvfp4":
                got, scale = ref.nvfp4_block(block, g)
            else:
                got, scale = ref.int4_group(block)
            codes[r][b:b + size] = got
            scales.append(scale)
    return [c for row in codes for c in row], scales


def ours(x: torch.Tensor, fmt: str) -> tuple[list[int], list[float]]:
    q = quantize(x, fmt)
    codes = el.unpack_nibbles(q.codes) if fmt in ("nvfp4", "int4") else q.codes
    scales = q.scales.reshape(-1)
    return codes.reshape(-1).tolist(), (scales.tolist() if scales.dtype == torch.float32 else scales.tolist())


def assert_same(x: torch.Tensor, fmt: str) -> None:
    got_codes, got_scales = ours(x, fmt)
    want_codes, want_scales = reference(x, fmt)
    assert len(got_scales) == len(want_scales)
    for i, (a, b) in enumerate(zip(got_scales, want_scales)):
        assert (math.isnan(a) and math.isnan(b)) or a == b, f"{fmt} scale {i}: ours {a!r}, reference {b!r}"
    bad = [i for i, (a, b) in enumerate(zip(got_codes, want_codes)) if a != b]
    assert not bad, (f"{fmt}: {len(bad)} codes differ, first at {bad[0]}: x={x.reshape(-1)[bad[0]].item()!r} "
                     f"ours {got_codes[bad[0]]:#x}, reference {want_codes[bad[0]]:#x}")


def random_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for scale in (1e-6, 1e-2, 1.0, 37.0, 1e4):
        out.append(torch.randn(4, 64, generator=g) * scale)
    # heavy tails and mixed magnitudes inside one block
    out.append(torch.randn(4, 64, generator=g) * torch.exp(torch.randn(4, 64, generator=g) * 4))
    out.append((torch.randn(3, 2, 32, generator=g)).to(torch.bfloat16))
    # MoE experts ([experts, out, in]) of other magnitudes: each its own tiles and NVFP4 tensor scale
    out.append(torch.randn(3, 130, 64, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None, None])
    out.append((torch.rand(2, 64, generator=g) * 100).to(torch.float16))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_tensors_match_the_reference_bit_for_bit(fmt):
    for x in random_tensors():
        assert_same(x, fmt)


def test_fp8_partial_edge_tiles_match_the_reference():
    g = torch.Generator().manual_seed(1)
    assert_same(torch.randn(130, 133, generator=g) * torch.linspace(0.01, 50, 133), "fp8")


def midpoint_block(codes: dict, scale: float, width: int) -> list[float]:
    """Values halfway between neighbouring representable values (ties), times ``scale``."""
    values = sorted(codes)
    mids = [float((a + b) / 2) * scale for a, b in zip(values, values[1:])]
    mids = (mids * (width // len(mids) + 1))[:width - 1]
    return mids + [float(values[-1]) * scale]  # the block's amax: makes the scale exact


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_ties_round_to_even(fmt):
    if fmt == "mxfp8":
        # amax = 448 * 2**-8 * 2**k gives X = 2**k... choose amax 2**8 * 1.75 -> X = 1, ties of E4M3 itself
        rows = [midpoint_block(ref.E4M3_CODES, 1.0, 32)[:31] + [448.0] for _ in range(2)]
    else:
        rows = [midpoint_block(ref.E2M1_CODES, 1.0, 16)]
        rows += [[-v for v in rows[0]]]
    assert_same(torch.tensor(rows), fmt)


def test_mxfp8_saturates_values_the_power_of_two_scale_pushes_past_448():
    # amax = 500: floor(log2(500)) - 8 = 0, so X = 1 and 449..500 must clamp to 448, not become NaN
    x = torch.tensor([[500.0, 449.0, 480.0, -470.0] + [1.0] * 28])
    assert_same(x, "mxfp8")
    assert el.e4m3_decode(quantize(x, "mxfp8").codes)[0, :4].tolist() == [448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_special_blocks(fmt):
    n = 16 if fmt == "nvfp4" else 32
    zero = [0.0] * n
    negzero = [-0.0] * n
    nan = [1.0] * (n - 1) + [math.nan]
    inf = [2.0] * (n - 1) + [-math.inf]
    tiny = [1e-40 * (i + 1) for i in range(n)]  # float32 subnormals
    huge = [3e38 * (1 if i % 2 else -1) for i in range(n)]
    x = torch.tensor([zero, negzero, nan, inf, tiny, huge], dtype=torch.float32)
    assert_same(x, fmt)
    back = [dequantize(quantize(row.unsqueeze(0), fmt))[0] for row in x]  # one block each (fp8 tiles span rows)
    assert torch.isnan(back[2]).all() and torch.isnan(back[3]).all(), "a block with NaN / Inf decodes to NaN"
    assert (back[0] == 0).all() and (back[1] == 0).all()
    assert all(torch.isfinite(back[i]).all() for i in (4, 5))
    beside = dequantize(quantize(torch.tensor([[1.0] * n + nan]), fmt))[0]
    if fmt != "fp8":
        assert torch.equal(beside[:n], torch.ones(n)), "the block beside a NaN block keeps its values"


def test_nvfp4_block_scale_that_underflows_gives_zero_elements():
    # one huge block sets the tensor scale; the tiny block's E4M3 scale rounds to 0
    x = torch.tensor([[1e6] * 16, [1e-6] * 16])
    assert_same(x, "nvfp4")
    assert (dequantize(quantize(x, "nvfp4"))[1] == 0).all()


def test_error_bounds_follow_the_formats():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g)
    amax = x.abs().reshape(64, -1, 16).amax(-1, keepdim=True)
    err = (dequantize(quantize(x, "nvfp4")) - x).abs().reshape(64, -1, 16)
    assert (err <= amax * 0.25 + 1e-6).all()  # half of E2M1's widest gap (2 between 4 and 6) over 6, plus scale rounding
    rel = ((dequantize(quantize(x, "mxfp8")) - x).abs() / x.abs().clamp(min=1e-3))
    assert rel.median() < 2 ** -4  # 3 mantissa bits


def test_four_bit_codes_pack_first_element_in_the_low_nibble():
    x = torch.tensor([[0.5, 6.0] + [0.0] * 14])  # codes 1 and 7
    q = quantize(x, "nvfp4")
    assert q.codes.shape == (1, 8) and q.codes[0, 0].item() == 0x71
    assert torch.equal(el.unpack_nibbles(el.pack_nibbles(torch.arange(16, dtype=torch.uint8).reshape(2, 8))),
                       torch.arange(16, dtype=torch.uint8).reshape(2, 8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_and_layout_of_the_input_do_not_change_the_bytes(fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    a, b = quantize(x, fmt), quantize(x.float().t().contiguous().t(), fmt)
    assert all(torch.equal(a.parts()[k], b.parts()[k]) for k in a.parts())


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "int4"])
def test_a_last_dimension_off_the_block_is_one_clear_error(fmt):
    with pytest.raises(QuantizeError, match=r"model\.layers\.0\.w .*last dimension.*precision\.exceptions"):
        quantize(torch.ones(4, 33), fmt, name="model.layers.0.w")


@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_quantize_forward_is_the_quantizer_and_the_gradient_passes_straight_through(fmt):
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(32, 64, generator=g)).requires_grad_()
    y = fake_quantize(w, fmt)
    assert torch.equal(y.detach(), dequantize(quantize(w, fmt)))
    upstream = torch.randn(32, 64, generator=g)
    (y * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fewer_bytes_than_bf16(fmt):
    x = torch.randn(256, 256)
    assert quantize(x, fmt).nbytes < x.numel() * 2 * (0.6 if fmt in ("fp8", "mxfp8") else 0.32)


def test_the_reference_rounds_float32_like_ieee():
    import random
    import struct
    from fractions import Fraction

    rng = random.Random(5)
    for _ in range(2000):
        v = rng.uniform(-1, 1) * 2.0 ** rng.randint(-140, 120)
        assert ref.f32(Fraction(v)) == Fraction(struct.unpack("f", struct.pack("f", v))[0]), v


def test_the_decoding_tables_give_the_definitions_values_for_every_byte():
    byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    bits = lambda t: t.view(torch.int32)  # noqa: E731 - NaN compared by its bits
    assert torch.equal(bits(el.e4m3_decode(byte)), bits(byte.view(torch.float8_e4m3fn).float()))
    for kind, decode in (("e2m1", el.e2m1_decode), ("int4", el.int4_decode)):
        assert torch.equal(bits(el.unpack_decode(byte, kind)), bits(decode(el.unpack_nibbles(byte)))), kind
    assert el.e4m3_decode(torch.tensor(0x38, dtype=torch.uint8)).item() == 1.0  # a 0-d code
