"""Capacity: which slots are kept.

``capacity = C`` keeps, for every expert ``e``, the first ``C`` used slots in canonical order
(source rank ascending, then token ascending; a token names ``e`` at most once) and drops the
rest. The count exchange is an all-gather, so the source knows its kept mask before anything
moves: slot ``(s, t, k)`` to ``e`` is kept iff

    #(used slots to e on ranks < s) + #(used slots to e on rank s with token < t)  <  C

A dropped slot behaves like ``-1`` from then on: it is not dispatched, contributes nothing to
combine and gets zero gradient. ``capacity=None`` keeps every used slot. ``capacity_factor=f`` (production) means the capacity
``capacity_from_factor(S, E, f)``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Optional, Sequence

import numpy as np


def capacity_from_factor(used_slots: int, num_experts: int, capacity_factor: float) -> int:
    """The capacity a capacity factor stands for: ``ceil(capacity_factor * S / E)``.

    ``S`` is the group's used slots (every rank's ``tokens_per_expert`` summed, which the count
    exchange gives every rank, so a factor costs no collective), ``E`` the number of experts:
    GShard's / Switch's / Megatron's ``capacity_factor * tokens * top_k / num_experts``, counted
    in used slots. Exact: the factor's float64 value as a fraction, one ceiling, no rounding.
    """
    return math.ceil(Fraction(float(capacity_factor)) * int(used_slots) / int(num_experts))


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
