"""MXFP8 (OCP Microscaling v1.0, element E4M3, blocks of 32 along H, E8M0 scale codes).

For each row and each block ``b`` of 32 consecutive elements ``v`` (widened to float32):

    amax = max |v|                                    (float32)
    amax == 0:  code = 0, elements +0 (also for a block of -0.0)
    otherwise:  e    = floor(log2(amax)) - 8, clamped to [-127, 127]   (exact, from frexp)
                code = e + 127                                          (uint8, 0..254)
                q    = e4m3_rne(clamp(v / 2**e, -448, 448))             (float32 divide, exact
                                                                         unless it underflows)
    dequantize: q * 2**e in float32 (exact)

``8`` is the exponent of E4M3's largest power of two (448 = 1.75 * 2**8), so the block maximum
lands in [256, 512) before the clamp; values in (448, 512) saturate to 448. The explicit clamp
makes ml_dtypes (which would give NaN out of range) agree with torch (which saturates).

Error bound, per element with ``u = |v| / 2**e``: if ``u <= 448``,
``|dequantize - v| <= max(2**-4 * |v|, 2**(e - 10))`` (half an E4M3 ulp; ``2**(e-10)`` is half
the subnormal step); else the element saturates to ``sign(v) * 448 * 2**e`` (relative error
below 1/8).

Round trip: ``quantize(dequantize(q, c)) == (q, c)`` bit for bit for every ``(q, c)`` that
``quantize`` produces, except that a block whose elements all rounded to zero comes back as +0
(equal in value; a -0 element of such a block turns +0).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from .abi import MXFP8_BLOCK as BLOCK
from .dtypes import E4M3, E4M3_MAX, FLOAT32, e4m3_blocks, e4m3_dequantized

E4M3_EMAX = 8          # floor(log2(448))
SCALE_BIAS = 127       # E8M0 code = e + 127


def quantize_mxfp8(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize rows to MXFP8.

    Args:
        x: [T, H] float32 or bfloat16, finite, ``H % 32 == 0``.
    Returns:
        q: [T, H] float8_e4m3fn; codes: [T, H // 32] uint8 (E8M0 codes ``e + 127``).
    """
    v = e4m3_blocks(x, BLOCK, "MXFP8")
    amax = np.abs(v).max(axis=2, initial=np.float32(0))          # [T, H/32]
    _, ex = np.frexp(amax)                                        # amax = m * 2**ex, m in [0.5, 1)
    e = np.clip(ex.astype(np.int64) - 1 - E4M3_EMAX, -127, 127)
    zero = amax == 0
    e = np.where(zero, -127, e)
    scale = np.ldexp(np.ones_like(amax, dtype=FLOAT32), e.astype(np.int32))  # 2**e, exact in float32
    u = np.clip(v / scale[:, :, None], -E4M3_MAX, E4M3_MAX)
    u = np.where(zero[:, :, None], np.float32(0), u)             # amax == 0: elements +0
    q = u.astype(E4M3).reshape(v.shape[0], v.shape[1] * v.shape[2])
    return q, (e + SCALE_BIAS).astype(np.uint8)


def dequantize_mxfp8(q: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``q * 2**(code - 127)`` in float32.

    Args:
        q: [T, H] float8_e4m3fn; codes: [T, H // 32] uint8.
    Returns:
        [T, H] float32.
    """
    codes = np.asarray(codes)
    scale = np.ldexp(np.ones(codes.shape, FLOAT32), codes.astype(np.int32) - SCALE_BIAS)
    return e4m3_dequantized(q, scale, BLOCK, "MXFP8")
