"""Capacity: which slots are kept.

``capacity = C`` keeps, for every expert ``e``, the first ``C`` used slots in canonical order
(source rank ascending, then token ascending; a token names ``e`` at most once) and drops the
rest. The count exchange is an all-gather, so the source knows its kept mask before anything
moves: slot ``(s, t, k)`` to ``e`` is kept iff

    #(used slots to e on ranks < s) + #(used slots to e on rank s with token < t)  <  C

A dropped slot behaves like ``-1`` from then on: it is not dispatched, contributes nothing to
combine and gets zero gradient. ``capacity=None`` keeps every used slot. ``capacity_factor=f``
(production) means the capacity ``capacity_from_factor(S, E, f)``.

One body per rule, for both tiers: a slot's place among its expert's slots is ``slot_places``
(written over an array namespace: NumPy here, torch on the device in production/moves.py, the
same lines), which slots of a run are kept ``kept_slots``, the group's kept mask
``kept_mask``, the kept counts a rank derives from the count exchange ``kept_counts``.
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


def slot_places(xp, experts):
    """Each slot's place among its expert's slots, in the array namespace ``xp`` (``numpy`` or
    ``torch``: only names both spell the same way, so production runs these lines on its device
    tensors with no host read).

    Args: experts [S] int64, a run of slots in canonical order, each slot's expert.
    Returns: ``(order [S], e_sorted [S], place [S])``, all int64: the stable sort by expert, the
    experts in that order, and each sorted slot's place (its index in the sort minus the index
    where its expert's run starts: the slots before it naming the same expert).
    """
    order = xp.argsort(experts, stable=True)
    e_sorted = experts[order]
    place = xp.cumsum(xp.ones_like(experts), 0) - 1 - xp.searchsorted(e_sorted, e_sorted)
    return order, e_sorted, place


def kept_slots(xp, experts, limit):
    """The rule on one run of slots in canonical order (``slot_places``, the same namespaces).

    Args: experts [S] int64, each slot's expert in ``[0, E]`` (``E``: a slot of no expert, an
    unused one); limit [E + 1] int64, how many of each expert's slots are kept (``limit[E]`` 0).
    Returns: keep [S] bool: slot ``i`` is kept iff fewer than ``limit[experts[i]]`` slots before
    it name the same expert.
    """
    order, e_sorted, place = slot_places(xp, experts)
    keep = xp.zeros_like(experts, dtype=xp.bool)
    keep[order] = place < limit[e_sorted]
    return keep


def sorted_slots(idx_all: np.ndarray, num_experts: int, capacity: Optional[int]):
    """The rule above over the whole group at once. ``idx_all``: every rank's routing
    concatenated and flattened (slot ``f = g * K + k`` of global token ``g``, ranks ascending,
    so canonical order is ``f`` ascending). The used slots sorted by expert, stable (canonical
    order within an expert): ``(f_sorted, e_sorted, used [E], start [E + 1], rank_in_e, keep
    (sorted order), kept_all [G * K] bool)``; a slot is kept iff its rank within its expert
    (the used slots to that expert before it) is below ``capacity``."""
    f_used = np.flatnonzero(idx_all >= 0)
    order, e_sorted, rank_in_e = slot_places(np, idx_all[f_used])
    f_sorted = f_used[order]
    used = np.bincount(e_sorted, minlength=num_experts).astype(np.int64)
    start = np.concatenate([[0], np.cumsum(used)])
    keep = np.ones(len(f_sorted), bool) if capacity is None else rank_in_e < capacity
    kept_all = np.zeros(idx_all.shape, bool)
    kept_all[f_sorted[keep]] = True
    return f_sorted, e_sorted, used, start, rank_in_e, keep, kept_all


def kept_mask(topk_idx: Sequence[np.ndarray], num_experts: int,
              capacity: Optional[int]) -> List[np.ndarray]:
    """Args: topk_idx R arrays [T_s, K] int64 (validated, one K). Returns R arrays [T_s, K]
    bool (``sorted_slots``, both tiers)."""
    K = topk_idx[0].shape[1]
    base = np.concatenate([[0], np.cumsum([i.shape[0] for i in topk_idx])]).astype(np.int64)
    flat = np.concatenate([np.asarray(i, np.int64).reshape(len(i) * K) for i in topk_idx])
    kept_all = sorted_slots(flat, int(num_experts), capacity)[-1]
    return [kept_all[base[s] * K:base[s + 1] * K].reshape(topk_idx[s].shape)
            for s in range(len(topk_idx))]


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
