"""The MXFP8 payload's kernels: E4M3 elements, one E8M0 scale code per 32 along H.

The rule is ``epkit.reference.mxfp8``'s (docs/semantics.md); the kernel (csrc/cpu/mxfp8.cpp,
epkit/triton/mxfp8.py) is bit for bit that. Each token row travels as ``H`` E4M3 bytes followed by
``H // 32`` scale codes (epkit.payloads).
"""

from __future__ import annotations

import torch

from .. import ops
from epkit.reference.abi import MXFP8_BLOCK


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` float32/bfloat16 (finite, ``H % 32 == 0``) -> ``(q [T, H] float8_e4m3fn,
    codes [T, H // 32] uint8)``, bit for bit ``epkit.reference.quantize_mxfp8``."""
    return ops.C.quantize_mxfp8(x.contiguous())  # ops.C at call time: the kernel bench wraps it


def dequantize_mxfp8(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``q [T, H]`` E4M3, ``codes [T, H // 32]`` uint8 -> ``[T, H]`` float32, ``q * 2**(code - 127)``
    (exact: a 4-bit significand times a power of two fits float32)."""
    # 2**(code - 127) built from its bits: code << 23 is that float32 for code >= 1; code 0 is
    # the subnormal 2**-127 (0x00400000).
    c = codes.to(torch.int32)
    scale = torch.where(c == 0, torch.tensor(0x00400000, dtype=torch.int32), c << 23)
    scale = scale.view(torch.float32)
    B = MXFP8_BLOCK
    return (q.float().view(q.shape[0], q.shape[1] // B, B) * scale.unsqueeze(-1)).view(q.shape)
