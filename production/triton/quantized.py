"""The host side shared by the quantized payloads' kernels (mxfp8.py, fp8_block128.py): each
payload module brings its two kernels, this module allocates and launches them alike.

- the quantize kernel ``(x, q, scale, NBLOCKS, NB, QS, SS, X_BF16, BR)``: blocks of ``x``
  [T, H] (an integer view: int16 bfloat16, int32 float32), ``NB`` = H / block a row, to their
  E4M3 bytes at ``q + t * QS + block * j`` (uint8) and their scales at ``scale + t * SS + j``,
  block j of row t. Separate outputs (``quantize_<payload>``: QS = H, SS = H / block) or the
  wire row (``quantize_rows``: the row, then its scales from byte H on);
- the dequantize kernel ``(rows, scales, q, scale, hp, NBLOCKS, NB, P, SS, BR)``: the wire rows
  [M, P] uint8 (``scales`` the rows from byte H on, in the scale dtype, SS a row) to the E4M3
  bytes ``q``, the scales and the dequantized float32 rows ``hp``.
"""

from __future__ import annotations

import torch

from . import rowchecks as ck
from ._runtime import cdiv, launch

__all__ = ["quantize", "quantize_rows", "dequantize_rows"]


def _quantize_into(kernel, BR: int, block: int, x: torch.Tensor, q: torch.Tensor,
                   scale: torch.Tensor, QS: int, SS: int) -> None:
    T, H = x.shape
    n = T * (H // block)
    xi = x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)
    launch(kernel, (cdiv(n, BR),), xi, q, scale, n, H // block, QS, SS,
           X_BF16=x.dtype == torch.bfloat16, BR=BR)


def quantize(kernel, BR: int, block: int, scale_dtype: torch.dtype, op: str, x: torch.Tensor):
    """x [T, H] float32 or bfloat16, H % block == 0 -> (q [T, H] float8_e4m3fn, scale
    [T, H / block] scale_dtype); the C++ kernel's checks and messages (``op``)."""
    ck.check_quantize_args(op, x, block)
    x = x.contiguous()
    T, H = x.shape
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((T, H // block), dtype=scale_dtype, device=x.device)
    _quantize_into(kernel, BR, block, x, q.view(torch.uint8), scale, H, H // block)
    return q, scale


def quantize_rows(kernel, BR: int, block: int, scale_dtype: torch.dtype, op: str,
                  x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> its wire rows uint8 [T, P] (P = H + H / block scales' bytes) in one launch:
    :func:`quantize`'s bits laid out as epkit.payloads' ``to_rows`` (E4M3 bytes, then the
    scales, little-endian)."""
    ck.check_quantize_args(op, x, block)
    x = x.contiguous()
    T, H = x.shape
    size = scale_dtype.itemsize
    P = H + (H // block) * size
    rows = torch.empty((T, P), dtype=torch.uint8, device=x.device)
    _quantize_into(kernel, BR, block, x, rows, rows[:, H:].view(scale_dtype), P, P // size)
    return rows


def dequantize_rows(kernel, BR: int, block: int, scale_dtype: torch.dtype, rows: torch.Tensor,
                    H: int):
    """wire rows uint8 [M, P] -> (q [M, H] float8_e4m3fn, scale [M, H / block] scale_dtype,
    hp [M, H] float32 dequantized) in one launch (epkit.payloads' ``from_rows``)."""
    rows = rows.contiguous()
    M, P = rows.shape
    size = scale_dtype.itemsize
    dev = rows.device
    q = torch.empty((M, H), dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty((M, H // block), dtype=scale_dtype, device=dev)
    hp = torch.empty((M, H), dtype=torch.float32, device=dev)
    n = M * (H // block)
    launch(kernel, (cdiv(n, BR),), rows, rows[:, H:].view(scale_dtype), q.view(torch.uint8),
           scale, hp, n, H // block, P, P // size, BR=BR)
    return q, scale, hp
