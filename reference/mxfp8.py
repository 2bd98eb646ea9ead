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
from .common import E4M3, FLOAT32

E4M3_MAX = np.float32(448.0)
E4M3_EMAX = 8          # floor(log2(448))
SCALE_BIAS = 127       # E8M0 code = e + 127


def _blocks(x: np.ndarray) -> np.ndarray:
    """[T, H] -> [T, H/32, 32] float32."""
    T, H = x.shape
    if H % BLOCK != 0:
        raise ValueError(f"epkit.reference: MXFP8 needs H % 32 == 0, got H = {H}")
    return x.astype(FLOAT32).reshape(T, H // BLOCK, BLOCK)


def quantize_mxfp8(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize rows to MXFP8.

    Args:
        x: [T, H] float32 or bfloat16, finite, ``H % 32 == 0``.
    Returns:
        q: [T, H] float8_e4m3fn; codes: [T, H // 32] uint8 (E8M0 codes ``e + 127``).
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError("epkit.reference: quantize_mxfp8 takes a 2-D [T, H] array")
    v = _blocks(x)
    if not np.isfinite(v).all():
        raise ValueError("epkit.reference: MXFP8 input holds a non-finite value")
    amax = np.abs(v).max(axis=2, initial=np.float32(0))          # [T, H/32]
    _, ex = np.frexp(amax)                                        # amax = m * 2**ex, m in [0.5, 1)
    e = np.clip(ex.astype(np.int64) - 1 - E4M3_EMAX, -127, 127)
    zero = amax == 0
    e = np.where(zero, -127, e)
    scale = np.ldexp(np.ones_like(amax, dtype=FLOAT32), e.astype(np.int32))  # 2**e, exact in float32
    u = np.clip(v / scale[:, :, None], -E4M3_MAX, E4M3_MAX)
    u = np.where(zero[:, :, None], np.float32(0), u)             # amax == 0: elements +0
    q = u.astype(E4M3).reshape(x.shape)
    return q, (e + SCALE_BIAS).astype(np.uint8)


def dequantize_mxfp8(q: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``q * 2**(code - 127)`` in float32.

    Args:
        q: [T, H] float8_e4m3fn; codes: [T, H // 32] uint8.
    Returns:
        [T, H] float32.
    """
    q = np.asarray(q)
    codes = np.asarray(codes)
    T, H = q.shape
    if codes.shape != (T, H // BLOCK) or H % BLOCK != 0:
        raise ValueError("epkit.reference: codes must have shape [T, H // 32]")
    scale = np.ldexp(np.ones(codes.shape, FLOAT32), codes.astype(np.int32) - SCALE_BIAS)
    return (q.astype(FLOAT32).reshape(T, H // BLOCK, BLOCK) * scale[:, :, None]).reshape(T, H)

