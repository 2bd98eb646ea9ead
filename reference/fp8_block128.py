"""fp8_block128: E4M3 elements with one float32 scale per 128 along H (DeepSeek-V3's activation
format, the one DeepEP ships).

For each row and each block ``b`` of 128 consecutive elements ``v`` (widened to float32, exact
for bfloat16):

    amax  = max |v|                                          (float32)
    scale = max(amax, AMAX_MIN) / 448                        (one float32 division, RNE)
    q     = e4m3_rne(clamp(v / scale, -448, 448))            (one float32 division, RNE;
                                                              then E4M3 round to nearest even)
    dequantize: float32(q) * scale                           (one float32 multiply, RNE)

``AMAX_MIN = float32(1e-4)`` (bits 0x38D1B717), DeepEP's clamp: a block whose ``amax`` is
smaller (an all-zero block included) gets the scale ``float32(1e-4) / 448``, and its elements
keep their sign (``-0.0`` stays E4M3 ``-0``, byte 0x80). The clamp to +-448 saturates: the
block maximum lands within a float32 rounding of 448, so it only catches ``v / scale`` a hair
above 448 (ml_dtypes would turn values from 464 on into NaN, torch's conversion saturates
earlier: the clamp makes them agree). Finite ``x`` gives finite ``q`` and ``scale``.

Error bound, per element (``s = scale``): ``|dequantize - v| <= 2**-4 * |v| + 2**-10 * s``
up to float32 roundings (half an E4M3 ulp in the normal range, half the subnormal step
``2**-9 * s`` below it). Unlike MXFP8's power-of-two scale, ``s`` is not exact, so there is no
bitwise round trip.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from .abi import FP8_BLOCK128_BLOCK as BLOCK
from .common import E4M3, FLOAT32

E4M3_MAX = np.float32(448.0)
AMAX_MIN = np.float32(1e-4)   # DeepEP's clamp of the block maximum


def _blocks(x: np.ndarray) -> np.ndarray:
    """[T, H] -> [T, H/128, 128] float32."""
    T, H = x.shape
    if H % BLOCK != 0:
        raise ValueError(f"epkit.reference: fp8_block128 needs H % {BLOCK} == 0, got H = {H}")
    return x.astype(FLOAT32).reshape(T, H // BLOCK, BLOCK)


def quantize_fp8_block128(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize rows to E4M3 with a float32 scale per 128 elements.

    Args:
        x: [T, H] float32 or bfloat16, finite, ``H % 128 == 0``.
    Returns:
        q: [T, H] float8_e4m3fn; scale: [T, H // 128] float32.
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError("epkit.reference: quantize_fp8_block128 takes a 2-D [T, H] array")
    v = _blocks(x)
    if not np.isfinite(v).all():
        raise ValueError("epkit.reference: fp8_block128 input holds a non-finite value")
    amax = np.abs(v).max(axis=2, initial=np.float32(0))               # [T, H/128] float32
    scale = (np.maximum(amax, AMAX_MIN) / E4M3_MAX).astype(FLOAT32)   # float32 / float32
    u = np.clip(v / scale[:, :, None], -E4M3_MAX, E4M3_MAX)          # float32 / float32
    return u.astype(E4M3).reshape(x.shape), scale


def dequantize_fp8_block128(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``float32(q) * scale`` in float32.

    Args:
        q: [T, H] float8_e4m3fn; scale: [T, H // 128] float32.
    Returns:
        [T, H] float32.
    """
    q = np.asarray(q)
    scale = np.asarray(scale, FLOAT32)
    T, H = q.shape
    if scale.shape != (T, H // BLOCK) or H % BLOCK != 0:
        raise ValueError(f"epkit.reference: scale must have shape [T, H // {BLOCK}]")
    return (q.astype(FLOAT32).reshape(T, H // BLOCK, BLOCK) * scale[:, :, None]).reshape(T, H)
