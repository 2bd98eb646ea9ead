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
from .dtypes import E4M3, E4M3_MAX, FLOAT32, e4m3_blocks, e4m3_dequantized

AMAX_MIN = np.float32(1e-4)   # DeepEP's clamp of the block maximum


def quantize_fp8_block128(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize rows to E4M3 with a float32 scale per 128 elements.

    Args:
        x: [T, H] float32 or bfloat16, finite, ``H % 128 == 0``.
    Returns:
        q: [T, H] float8_e4m3fn; scale: [T, H // 128] float32.
    """
    v = e4m3_blocks(x, BLOCK, "fp8_block128")
    amax = np.abs(v).max(axis=2, initial=np.float32(0))               # [T, H/128] float32
    scale = (np.maximum(amax, AMAX_MIN) / E4M3_MAX).astype(FLOAT32)   # float32 / float32
    u = np.clip(v / scale[:, :, None], -E4M3_MAX, E4M3_MAX)          # float32 / float32
    return u.astype(E4M3).reshape(v.shape[0], v.shape[1] * v.shape[2]), scale


def dequantize_fp8_block128(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``float32(q) * scale`` in float32.

    Args:
        q: [T, H] float8_e4m3fn; scale: [T, H // 128] float32.
    Returns:
        [T, H] float32.
    """
    return e4m3_dequantized(q, scale, BLOCK, "fp8_block128")
