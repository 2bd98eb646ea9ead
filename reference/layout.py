"""Layout (the prepare step): what each rank counts locally, and what the count exchange tells it.

On rank ``s`` with routing ``topk_idx_s [T, K]`` (``-1`` = unused slot), ``L = E // R`` and
expert ``e`` living on rank ``e // L``:

    tokens_per_expert[e]   = #{(t, k): topk_idx_s[t, k] == e}                         [E] int64
    is_token_in_rank[t, d] = any over k of (topk_idx_s[t, k] >= 0 and its rank == d) [T, R] bool
    tokens_per_rank[d]     = #{t: is_token_in_rank[t, d]}                             [R] int64
    slots_per_rank[d]      = #{(t, k): used and on rank d}                            [R] int64

The count exchange then gives rank ``d``
``recv_tokens_per_expert[s, j] = tokens_per_expert_s[d * L + j]``  ([R, L] int64).

All counts are *pre-capacity* (capacity needs the whole group's counts; layout is local).
Checks: options (num_experts >= 1, E % R == 0), then per rank: integer dtype, 2-D, range, duplicates.

After capacity (``kept``: capacity.kept_mask), the token rows a rank sends (the dedup and hier
transports', the rank-major rows): token t is sent to rank d once iff d holds at least one of
its *kept* slots (``token_rows``, from ``kept_per_rank``). Both tiers count them here.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .records import Layout
from .validate import check_layout


def local_counts(idx: np.ndarray, num_ranks: int, num_experts: int):
    """One rank's counts from its routing ``idx`` [T, K] int64 (validated).

    Returns ``(tokens_per_expert [E], tokens_per_rank [R], slots_per_rank [R],
    is_token_in_rank [T, R])`` as in the module docstring.
    """
    R, E = num_ranks, num_experts
    L = E // R
    T, K = idx.shape
    tokens_per_expert = np.zeros(E, np.int64)
    slots_per_rank = np.zeros(R, np.int64)
    is_token_in_rank = np.zeros((T, R), bool)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            if e < 0:
                continue
            tokens_per_expert[e] += 1
            slots_per_rank[e // L] += 1
            is_token_in_rank[t, e // L] = True
    tokens_per_rank = is_token_in_rank.sum(axis=0, dtype=np.int64)
    return tokens_per_expert, tokens_per_rank, slots_per_rank, is_token_in_rank


def kept_per_rank(idx: np.ndarray, kept: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    """One rank's kept slots per token and destination rank: int64 [T, R], entry [t, d] the
    kept slots of token t on rank d (``idx`` [T, K] int64 validated, ``kept`` [T, K] bool)."""
    T, L = idx.shape[0], num_experts // num_ranks
    t, k = np.nonzero(kept)
    dest = np.bincount(t * num_ranks + idx[t, k] // L, minlength=T * num_ranks)
    return dest.astype(np.int64).reshape(T, num_ranks)


def token_rows(idx: np.ndarray, kept: np.ndarray, num_ranks: int, num_experts: int):
    """One rank's token rows per destination: ``(rows [R] int64: its tokens with a kept slot
    on d, single [R] int64: those with exactly one)``. ``rows`` is what the rank contributes
    to the dedup count exchange's second all-gather when capacity dropped something."""
    n = kept_per_rank(idx, kept, num_ranks, num_experts)
    return (n >= 1).sum(axis=0, dtype=np.int64), (n == 1).sum(axis=0, dtype=np.int64)


def layout(topk_idx: Sequence[np.ndarray], num_experts: int) -> List[Layout]:
    """Per-rank layout of a group.

    Args:
        topk_idx: R arrays, each [T_r, K] integer.
        num_experts: E, a multiple of R.
    Returns:
        R ``Layout`` records (records.Layout).
    """
    idx = check_layout(topk_idx, num_experts)
    R, E = len(idx), int(num_experts)
    L = E // R
    local = [local_counts(i, R, E) for i in idx]
    out = []
    for d in range(R):
        recv = np.zeros((R, L), np.int64)
        for s in range(R):
            recv[s] = local[s][0][d * L:(d + 1) * L]
        out.append(Layout(d, *local[d], recv))
    return out
