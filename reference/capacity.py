"""Capacity: which slots are kept.

``capacity = C`` keeps, for every expert ``e``, the first ``C`` used slots in canonical order
(source rank ascending, then token ascending; a token names ``e`` at most once) and drops the
rest. The count exchange is an all-gather, so the source knows its kept mask before anything
moves: slot ``(s, t, k)`` to ``e`` is kept iff

    #(used slots to e on ranks < s) + #(used slots to e on rank s with token < t)  <  C

A dropped slot behaves like ``-1`` from then on: it is not dispatched, contributes nothing to
combine and gets zero gradient. ``capacity=None`` keeps every used slot.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np


def kept_mask(topk_idx: Sequence[np.ndarray], num_experts: int,
              capacity: Optional[int]) -> List[np.ndarray]:
    """Args: topk_idx R arrays [T_s, K] int64 (validated). Returns R arrays [T_s, K] bool."""
    seen = np.zeros(int(num_experts), np.int64)   # slots to each expert met so far, canonical order
    kept = []
    for idx in topk_idx:
        mask = np.zeros(idx.shape, bool)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                mask[t, k] = capacity is None or seen[e] < capacity
                seen[e] += 1
        kept.append(mask)
    return kept


def kept_counts(counts: np.ndarray, capacity: Optional[int]) -> np.ndarray:
    """Kept slots per (source rank, expert) from the gathered pre-capacity counts.

    Args: counts [R, E] int64 (row s = tokens_per_expert of rank s).
    Returns: [R, E] int64, ``clamp(C - prefix_s[e], 0, counts[s, e])`` with ``prefix_s[e]`` the
    slots to ``e`` on ranks below ``s`` (what every rank derives from the count exchange).
    """
    if capacity is None:
        return counts.copy()
    prefix = np.cumsum(counts, axis=0) - counts
    return np.clip(int(capacity) - prefix, 0, counts)
