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

from . import bits
from . import rowchecks as ck
from ._runtime import INTERPRETED, cdiv, launch, specialization, tl, triton

__all__ = ["quantize_mxfp8"]

BLOCK = 32
BR = 1024 if INTERPRETED else 16


@triton.jit
def _mxfp8_kernel(x, q, codes, NBLOCKS, X_BF16: tl.constexpr, BR: tl.constexpr):
    """Blocks b of x [NBLOCKS, 32] (integer view) -> q [NBLOCKS, 32] uint8 (E4M3 bits) and
    codes [NBLOCKS] uint8 (E8M0)."""
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bm = b < NBLOCKS
    offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = bits.to_f32(tl.load(x + offs, mask=bm[:, None], other=0), X_BF16)
    a = v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(tl.where(a > 0x7F800000, 0, a), axis=1)  # NaN skipped; bits order = order
    exp = (amax >> 23).to(tl.int32)
    e = tl.where(exp == 255, -9, tl.maximum(exp - 135, -127))
    zero = amax == 0
    code = tl.where(zero, 0, e + 127)
    u = tl.div_rn(v, bits.pow2(e)[:, None])
    u = tl.where(u < -448.0, -448.0, tl.where(u > 448.0, 448.0, u))  # a NaN passes, as in C++
    qb = tl.where(zero[:, None], 0, bits.f32_to_e4m3(u))
    tl.store(q + offs, qb.to(tl.uint8), mask=bm[:, None])
    tl.store(codes + b, code.to(tl.uint8), mask=bm)


def quantize_mxfp8(x: torch.Tensor):
    """x [T, H] float32 or bfloat16, H % 32 == 0 -> (q [T, H] float8_e4m3fn, codes [T, H / 32]
    uint8), cpu/mxfp8.cpp quantize_mxfp8_cpu."""
    ck.check_quantize_args("epkit.quantize_mxfp8", x, BLOCK)
    x = x.contiguous()
    T, H = x.shape
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    codes = torch.empty((T, H // BLOCK), dtype=torch.uint8, device=x.device)
    n = T * (H // BLOCK)
    xi = x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)
    launch(_mxfp8_kernel, (cdiv(n, BR),), xi, q.view(torch.uint8), codes, n,
           X_BF16=x.dtype == torch.bfloat16, BR=BR)
    return q, codes


for _bf16 in (True, False):
    specialization(f"mxfp8.quantize[{'bf16' if _bf16 else 'f32'}]", _mxfp8_kernel,
                   {"x": "*i16" if _bf16 else "*i32", "q": "*u8", "codes": "*u8",
                    "NBLOCKS": "i32", "X_BF16": "constexpr", "BR": "constexpr"},
                   {"X_BF16": _bf16, "BR": BR})
