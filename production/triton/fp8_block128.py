"""quantize_fp8_block128 in Triton (cpu/fp8_block128.cpp), bit for bit the C++ kernel's scales
and elements.

DeepSeek-V3's activation format (docs/semantics.md, "fp8_block128 payload"): E4M3 elements,
one float32 scale per 128 along H. Per block: amax = max |v| over its non-NaN elements (the
C++ ``std::max`` skips a NaN); scale = max(amax, float32(1e-4)) / 448 and u = v / scale, each
one correctly rounded float32 division (``tl.div_rn``); q = e4m3(clamp(u, -448, 448)), except
that a NaN quotient (a NaN, or an infinity over an infinite scale) is the E4M3 NaN with v's
sign, as the C++ kernel decides it. amax and max(amax, 1e-4) are unsigned maxima of bits
(exact, order-free: non-negative floats order as their bits), E4M3 is ``bits.f32_to_e4m3``.

A program owns BR blocks (x is [T * H / 128, 128] as blocks are contiguous along H).
"""

from __future__ import annotations

import torch

from . import bits, quantized
from ._runtime import INTERPRETED, tl, triton

__all__ = ["quantize_fp8_block128", "quantize_rows", "dequantize_rows"]

BLOCK = 128
OP = "epkit.quantize_fp8_block128"
BR = 256 if INTERPRETED else 4
AMAX_MIN_BITS = tl.constexpr(0x38D1B717)  # float32(1e-4), DeepEP's clamp of the block maximum


@triton.jit
def _fp8_block128_kernel(x, q, scale, NBLOCKS, NB, QS, SS, X_BF16: tl.constexpr,
                         BR: tl.constexpr):
    """Blocks b of x [NBLOCKS, 128] (integer view; NB blocks a row) -> their E4M3 bits at
    q + t * QS + 128 j (uint8) and their scales at scale + t * SS + j (float32), block b being
    block j of row t: separate q [T, H] and scale [T, H / 128] (QS = H, SS = H / 128), or a
    wire row [T, P] (q the row, scale its float32 view from H on, QS = P, SS = P / 4)."""
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bm = b < NBLOCKS
    t = b // NB
    j = b - t * NB
    i = tl.arange(0, 128)
    offs = b[:, None] * 128 + i[None, :]
    v = bits.to_f32(tl.load(x + offs, mask=bm[:, None], other=0), X_BF16)
    vb = v.to(tl.uint32, bitcast=True)
    a = vb & 0x7FFFFFFF
    amax = tl.max(tl.where(a > 0x7F800000, 0, a), axis=1)  # NaN skipped
    m = tl.maximum(amax, AMAX_MIN_BITS).to(tl.float32, bitcast=True)
    s = tl.div_rn(m, 448.0)
    u = tl.div_rn(v, s[:, None])
    c = tl.where(u < -448.0, -448.0, tl.where(u > 448.0, 448.0, u))
    nan = ((vb >> 24) & 0x80 | 0x7F).to(tl.uint8)
    qb = tl.where(u != u, nan, bits.f32_to_e4m3(c))
    tl.store(q + t[:, None] * QS + j[:, None] * 128 + i[None, :], qb, mask=bm[:, None])
    tl.store(scale + t * SS + j, s, mask=bm)


@triton.jit
def _dequantize_kernel(rows, scales, q, scale, hp, NBLOCKS, NB, P, SS, BR: tl.constexpr):
    """Blocks b (block j of row t) of the wire rows [T, P] uint8 (``scales``: the rows' float32
    scales from byte H on, SS a row) -> q [NBLOCKS, 128] (the E4M3 bytes), scale [NBLOCKS]
    float32 and hp [NBLOCKS, 128] float32 = e4m3(q) * scale, one float32 multiply (as
    payloads.fp8_block128.dequantize_fp8_block128)."""
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bm = b < NBLOCKS
    t = b // NB
    j = b - t * NB
    i = tl.arange(0, 128)
    qb = tl.load(rows + t[:, None] * P + j[:, None] * 128 + i[None, :], mask=bm[:, None],
                 other=0)
    s = tl.load(scales + t * SS + j, mask=bm, other=0.0)
    offs = b[:, None] * 128 + i[None, :]
    tl.store(q + offs, qb, mask=bm[:, None])
    tl.store(scale + b, s, mask=bm)
    tl.store(hp + offs, bits.e4m3_to_f32(qb) * s[:, None], mask=bm[:, None])


def quantize_fp8_block128(x: torch.Tensor):
    """x [T, H] float32 or bfloat16, H % 128 == 0 -> (q [T, H] float8_e4m3fn, scale
    [T, H / 128] float32), cpu/fp8_block128.cpp quantize_fp8_block128_cpu."""
    return quantized.quantize(_fp8_block128_kernel, BR, BLOCK, torch.float32, OP, x)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> its wire rows uint8 [T, H + 4 H / 128] (E4M3 bytes, then the float32 scales'
    bytes), one launch."""
    return quantized.quantize_rows(_fp8_block128_kernel, BR, BLOCK, torch.float32, OP, x)


def dequantize_rows(rows: torch.Tensor, H: int):
    """wire rows uint8 [M, H + 4 H / 128] -> (q [M, H] float8_e4m3fn, scale [M, H / 128]
    float32, hp [M, H] float32), one launch."""
    return quantized.dequantize_rows(_dequantize_kernel, BR, BLOCK, torch.float32, rows, H)
