"""The fp8_block128 payload's kernels: E4M3 elements, one float32 scale per 128 along H
(DeepSeek-V3's activation format, DeepEP's).

The rule is ``epkit.reference.fp8_block128``'s (docs/semantics.md): per block of 128,
``scale = max(amax, float32(1e-4)) / 448`` and ``q = e4m3_rne(clamp(x / scale, -448, 448))``,
each a float32 division; the kernel (csrc/cpu/fp8_block128.cpp, epkit/triton/fp8_block128.py) is
bit for bit that. Each token row travels as ``H`` E4M3 bytes followed by ``H // 128`` float32
scales, little-endian (epkit.payloads).
"""

from __future__ import annotations

import torch

from .. import ops
from epkit.reference.abi import FP8_BLOCK128_BLOCK


def quantize_fp8_block128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` float32/bfloat16 (finite, ``H % 128 == 0``) -> ``(q [T, H] float8_e4m3fn,
    scale [T, H // 128] float32)``, bit for bit ``epkit.reference.quantize_fp8_block128``."""
    return ops.C.quantize_fp8_block128(x.contiguous())  # ops.C at call time (the kernel bench)


def dequantize_fp8_block128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [T, H]`` E4M3, ``scale [T, H // 128]`` float32 -> ``[T, H]`` float32,
    ``float32(q) * scale`` (one float32 multiply per element)."""
    B = FP8_BLOCK128_BLOCK
    return (q.float().view(q.shape[0], q.shape[1] // B, B) * scale.unsqueeze(-1)).view(q.shape)
