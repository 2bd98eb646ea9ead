"""``empty_large`` on a GPU (cpu/alloc.cpp's huge-page blocks are a CPU matter): a plain
uninitialised buffer from torch's caching allocator on ``like``'s device."""

from __future__ import annotations

import torch


def empty_large(like: torch.Tensor, size: list, dtype: torch.dtype) -> torch.Tensor:
    """[*size] dtype, uninitialised, on ``like``'s device; a negative size is an error."""
    if any(int(s) < 0 for s in size):
        raise RuntimeError(f"epkit.empty_large: size {list(size)} has a negative dimension")
    return torch.empty(size, dtype=dtype, device=like.device)
