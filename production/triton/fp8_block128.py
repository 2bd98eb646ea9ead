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

from . import bits
from . import rowchecks as ck
from ._runtime import INTERPRETED, cdiv, launch, specialization, tl, triton

__all__ = ["quantize_fp8_block128"]

BLOCK = 128
BR = 256 if INTERPRETED else 4
AMAX_MIN_BITS = tl.constexpr(0x38D1B717)  # float32(1e-4), DeepEP's clamp of the block maximum


@triton.jit
def _fp8_block128_kernel(x, q, scale, NBLOCKS, X_BF16: tl.constexpr, BR: tl.constexpr):
    """Blocks b of x [NBLOCKS, 128] (integer view) -> q [NBLOCKS, 128] uint8 (E4M3 bits) and
    scale [NBLOCKS] float32."""
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bm = b < NBLOCKS
    offs = b[:, None] * 128 + tl.arange(0, 128)[None, :]
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
    tl.store(q + offs, qb, mask=bm[:, None])
    tl.store(scale + b, s, mask=bm)


def quantize_fp8_block128(x: torch.Tensor):
    """x [T, H] float32 or bfloat16, H % 128 == 0 -> (q [T, H] float8_e4m3fn, scale
    [T, H / 128] float32), cpu/fp8_block128.cpp quantize_fp8_block128_cpu."""
    ck.check_quantize_args("epkit.quantize_fp8_block128", x, BLOCK)
    x = x.contiguous()
    T, H = x.shape
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((T, H // BLOCK), dtype=torch.float32, device=x.device)
    n = T * (H // BLOCK)
    xi = x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)
    launch(_fp8_block128_kernel, (cdiv(n, BR),), xi, q.view(torch.uint8), scale, n,
           X_BF16=x.dtype == torch.bfloat16, BR=BR)
    return q, scale


for _bf16 in (True, False):
    specialization(f"fp8_block128.quantize[{'bf16' if _bf16 else 'f32'}]", _fp8_block128_kernel,
                   {"x": "*i16" if _bf16 else "*i32", "q": "*u8", "scale": "*fp32",
                    "NBLOCKS": "i32", "X_BF16": "constexpr", "BR": "constexpr"},
                   {"X_BF16": _bf16, "BR": BR})
