"""dtypes of the reference, and the E4M3 helpers the quantized payloads share.

``x`` is float32 or bfloat16 (``ml_dtypes.bfloat16``); the element of a quantized payload
(payloads.py) is ``ml_dtypes.float8_e4m3fn``. Casting float32 to bfloat16 or E4M3 with
``ndarray.astype`` rounds to nearest, ties to even (ml_dtypes). The dtype codes are abi.py's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .abi import DTYPE_CODES

FLOAT32 = np.dtype(np.float32)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT_DTYPES = (FLOAT32, BFLOAT16)  # what x, expert_y and gradients may be


def dtype_code(dt) -> int:
    """The header code of a dtype (``abi.DTYPE_CODES``); 0 for a dtype outside the table."""
    try:
        return DTYPE_CODES.get(np.dtype(dt).name, 0)
    except TypeError:
        return 0


E4M3_MAX = np.float32(448.0)  # the largest finite E4M3: quantized payloads saturate to it


def e4m3_blocks(x: np.ndarray, block: int, payload: str) -> np.ndarray:
    """A quantized payload's input ``x [T, H]`` float32 / bfloat16 as float32 blocks
    ``[T, H / block, block]`` (bfloat16 widened exactly); ValueError unless 2-D, ``H % block
    == 0`` and finite."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"epkit.reference: {payload} quantizes a 2-D [T, H] array")
    T, H = x.shape
    if H % block != 0:
        raise ValueError(f"epkit.reference: {payload} needs H % {block} == 0, got H = {H}")
    v = x.astype(FLOAT32).reshape(T, H // block, block)
    if not np.isfinite(v).all():
        raise ValueError(f"epkit.reference: {payload} input holds a non-finite value")
    return v


def e4m3_dequantized(q: np.ndarray, scale: np.ndarray, block: int, payload: str) -> np.ndarray:
    """``float32(q) * scale`` per block, one float32 multiply: ``q [T, H]`` E4M3, ``scale
    [T, H / block]`` float32 -> ``[T, H]`` float32 (exact for MXFP8's powers of two)."""
    q = np.asarray(q)
    scale = np.asarray(scale, FLOAT32)
    T, H = q.shape
    if scale.shape != (T, H // block) or H % block != 0:
        raise ValueError(f"epkit.reference: {payload}'s scales must have shape "
                         f"[T, H // {block}]")
    return (q.astype(FLOAT32).reshape(T, H // block, block) * scale[:, :, None]).reshape(T, H)
