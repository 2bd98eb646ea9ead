"""quantize_mxfp8 in Triton (cpu/mxfp8.cpp), bit for bit the C++ kernel's codes and elements.

OCP Microscaling v1.0 (docs/semantics.md, "MXFP8 payload"): E4M3 elements, one E8M0 scale per
32 along H. Per block: amax = max |v| over its non-NaN elements (the C++ ``std::max`` skips a
NaN); amax == 0: code 0, elements +0; else e = floor(log2(amax)) - 8 clamped to [-127, 127],
code e + 127, q = e4m3(clamp(v / 2**e, -448, 448)), the division one correctly rounded float32
operation (``tl.div_rn``). Everything else is integers on the bits: amax is an unsigned max of
|v|'s bits (order-free, exact), floor(log2) the biased exponent (every float32 amax below 2**-118
clamps to -127, so subnormals need no special case), 2**e ``bits.pow2``, E4M3 ``bits.f32_to_e4m3``.
An infinite amax (non-finite x, which dispatch refuses; the raw op takes it) gives e = -9 as
the C++ kernel's ``frexp`` does (glibc leaves the exponent 0 for inf).

A program owns BR blocks (x is [T * H / 32, 32] as blocks are contiguous along H).
"""

from __future__ import annotations

import torch

from . import bits, quantized
from ._runtime import INTERPRETED, tl, triton

__all__ = ["quantize_mxfp8", "quantize_rows", "dequantize_rows"]

BLOCK = 32
OP = "epkit.quantize_mxfp8"
BR = 1024 if INTERPRETED else 16
EXP_INF_NAN = tl.constexpr(255)  # float32's biased exponent of an infinity or a NaN


@triton.jit
def _mxfp8_kernel(x, q, codes, NBLOCKS, NB, QS, CS, X_BF16: tl.constexpr, BR: tl.constexpr):
    """Blocks b of x [NBLOCKS, 32] (integer view; NB blocks a row) -> their E4M3 bits at
    q + t * QS + 32 j (uint8) and their E8M0 codes at codes + t * CS + j (uint8), block b being
    block j of row t: separate q [T, H] and codes [T, H / 32] (QS = H, CS = H / 32), or a wire
    row [T, P] (q the row, codes the row from H on, QS = CS = P)."""
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bm = b < NBLOCKS
    t = b // NB
    j = b - t * NB
    i = tl.arange(0, 32)
    offs = b[:, None] * 32 + i[None, :]
    v = bits.to_f32(tl.load(x + offs, mask=bm[:, None], other=0), X_BF16)
    a = v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(tl.where(a > 0x7F800000, 0, a), axis=1)  # NaN skipped; bits order = order
    exp = (amax >> 23).to(tl.int32)
    e = tl.where(exp == EXP_INF_NAN, -9, tl.maximum(exp - 135, -127))
    zero = amax == 0
    code = tl.where(zero, 0, e + 127)
    u = tl.div_rn(v, bits.pow2(e)[:, None])
    u = tl.where(u < -448.0, -448.0, tl.where(u > 448.0, 448.0, u))  # a NaN passes, as in C++
    qb = tl.where(zero[:, None], 0, bits.f32_to_e4m3(u))
    tl.store(q + t[:, None] * QS + j[:, None] * 32 + i[None, :], qb.to(tl.uint8),
             mask=bm[:, None])
    tl.store(codes + t * CS + j, code.to(tl.uint8), mask=bm)


@triton.jit
def _dequantize_kernel(rows, scales, q, codes, hp, NBLOCKS, NB, P, SS, BR: tl.constexpr):
    """Blocks b (block j of row t) of the wire rows [T, P] uint8 (``scales``: the rows from
    byte H on, SS a row) -> q [NBLOCKS, 32] (the E4M3 bytes), codes [NBLOCKS] (the E8M0 codes)
    and hp [NBLOCKS, 32] float32 = e4m3(q) * 2**(code - 127) (code 0: 2**-127), one float32
    multiply (as payloads.mxfp8.dequantize_mxfp8)."""
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bm = b < NBLOCKS
    t = b // NB
    j = b - t * NB
    i = tl.arange(0, 32)
    qb = tl.load(rows + t[:, None] * P + j[:, None] * 32 + i[None, :], mask=bm[:, None], other=0)
    code = tl.load(scales + t * SS + j, mask=bm, other=0)
    offs = b[:, None] * 32 + i[None, :]
    tl.store(q + offs, qb, mask=bm[:, None])
    tl.store(codes + b, code, mask=bm)
    v = bits.e4m3_to_f32(qb) * bits.pow2(code.to(tl.int32) - 127)[:, None]
    tl.store(hp + offs, v, mask=bm[:, None])


def quantize_mxfp8(x: torch.Tensor):
    """x [T, H] float32 or bfloat16, H % 32 == 0 -> (q [T, H] float8_e4m3fn, codes [T, H / 32]
    uint8), cpu/mxfp8.cpp quantize_mxfp8_cpu."""
    return quantized.quantize(_mxfp8_kernel, BR, BLOCK, torch.uint8, OP, x)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> its wire rows uint8 [T, H + H / 32] (E4M3 bytes, then the codes), one
    launch."""
    return quantized.quantize_rows(_mxfp8_kernel, BR, BLOCK, torch.uint8, OP, x)


def dequantize_rows(rows: torch.Tensor, H: int):
    """wire rows uint8 [M, H + H / 32] -> (q [M, H] float8_e4m3fn, codes [M, H / 32] uint8,
    hp [M, H] float32), one launch."""
    return quantized.dequantize_rows(_dequantize_kernel, BR, BLOCK, torch.uint8, rows, H)
