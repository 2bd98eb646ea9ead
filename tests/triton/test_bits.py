"""epkit.triton.bits: the float-format conversions on the bits, against torch's own CPU
conversions (the functions the C++ kernels call: c10's bfloat16 and float8_e4m3fn rules), on
every bfloat16 pattern and on float32 samples that cover every exponent, every rounding tie
the target formats have, NaN payloads, infinities, subnormals and -0."""

import numpy as np
import pytest
import torch

from epkit.triton import bits
from epkit.triton._runtime import launch, tl, triton

BLOCK = 1 << 16


@triton.jit
def _apply(x_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if FN == 0:
        y = bits.bf16_to_f32(x).to(tl.int32, bitcast=True)
    elif FN == 1:
        y = bits.f32_to_bf16(x.to(tl.float32, bitcast=True))
    elif FN == 2:
        y = bits.f32_to_e4m3(x.to(tl.float32, bitcast=True))
    elif FN == 3:
        y = bits.pow2(x).to(tl.int32, bitcast=True)
    elif FN == 4:  # the round trip through a row's integer view, both dtypes
        y = bits.from_f32(bits.to_f32(x, True), True)
    else:
        y = bits.from_f32(bits.to_f32(x, False), False)
    tl.store(out_ptr + offs, y, mask=mask)


def apply(fn: int, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=out_dtype)
    launch(_apply, (triton.cdiv(x.numel(), BLOCK),), x, out, x.numel(), FN=fn, BLOCK=BLOCK)
    return out


def f32_samples() -> torch.Tensor:
    """int32 bits of float32 values: random patterns of every class; for the exponents where
    bfloat16 and E4M3 round (2**-27 .. 2**9), every mantissa's top 11 bits with the low 12 bits
    at 0, just below, at and above the half, and all ones (each tie of either format lies on
    such a pattern); the edge values; both signs."""
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    exp = np.arange(100, 137, dtype=np.uint32)[:, None, None]
    top = (np.arange(2048, dtype=np.uint32) << 12)[None, :, None]
    low = np.array([0, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)[None, None, :]
    grid = ((exp << 23) | top | low).reshape(-1)
    bf16_ties = ((np.arange(0, 256, dtype=np.uint32) << 23)[:, None]
                 | np.array([0x8000, 0x18000, 0x7FFF, 0x8001, 0x7F8000, 0x7FFFFF], np.uint32))
    edges = np.array([0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000,
                      0x7FBFFFFF, 0x7FFFFFFF, 0x43E00000, 0x43E7FFFF, 0x43E80000, 0x43EFFFFF,
                      0x43F00000, 0x3B000000, 0x3A800000, 0x3A800001, 0x3C800000], np.uint32)
    pos = np.concatenate([rand, grid, bf16_ties.reshape(-1), edges])
    both = np.concatenate([pos, pos | np.uint32(0x80000000)])
    return torch.from_numpy(both.view(np.int32))


def test_bf16_to_f32_every_pattern():
    b = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    got = apply(0, b, torch.int32)
    assert torch.equal(got, b.view(torch.bfloat16).float().view(torch.int32))


def test_f32_to_bf16_is_c10s_rounding():
    x = f32_samples()
    got = apply(1, x, torch.int16)
    want = x.view(torch.float32).to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(x.view(torch.float32))
    assert torch.equal(got[~nan], want[~nan])
    assert bool((got[nan] == 0x7FC0).all())  # c10: every NaN is 0x7FC0, sign and payload dropped
    u = x.numpy().view(np.uint32).astype(np.uint64)  # and a NumPy statement of the same rule
    rne = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16).view(np.int16)
    assert torch.equal(got[~nan], torch.from_numpy(rne)[~nan])


def test_row_views_round_trip():
    b = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    got = apply(4, b, torch.int16)
    nan = torch.isnan(b.view(torch.bfloat16))
    assert torch.equal(got[~nan], b[~nan]) and bool((got[nan] == 0x7FC0).all())
    x = f32_samples()
    assert torch.equal(apply(5, x, torch.int32), x)


def test_f32_to_e4m3_is_torchs_saturating_conversion():
    x = f32_samples()
    got = apply(2, x, torch.uint8)
    xf = x.view(torch.float32)
    # within E4M3's range (and NaN) every torch agrees; clamping keeps NaN
    want = xf.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, want)
    # beyond it: saturation to +-448 (0x7E), and (464, 480), which rounds to E4M3's NaN
    # pattern, saturates too; NaN keeps its sign
    big = torch.tensor([464.0, 470.0, 479.9, 480.0, 1e30, float("inf"), -470.0, -float("inf"),
                        float("nan"), -float("nan")])
    out = apply(2, big.view(torch.int32), torch.uint8).tolist()
    assert out == [0x7E] * 6 + [0xFE, 0xFE, 0x7F, 0xFF]


@pytest.mark.parametrize("lo,hi", [(-149, -126), (-126, 128)])
def test_pow2_exact(lo, hi):
    e = torch.arange(lo, hi, dtype=torch.int32)
    got = apply(3, e, torch.int32).view(torch.float32)
    want = torch.tensor([2.0 ** v for v in range(lo, hi)], dtype=torch.float64).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert bool((got > 0).all())
