"""Dispatch: the expert-major output (canonical), optional rank-major output, capacity, payloads.

Rank ``d`` holds local experts ``j = 0..L-1`` (global ``e = d * L + j``). Its output:

    rows of expert j   the kept slots (s, t, k) with topk_idx_s[t, k] == e, ordered by s
                       ascending, then t ascending (a row of topk_idx names e at most once)
    row value          x_s[t], copied bit for bit in x's dtype; under a quantized payload
                       (payloads.py) the source's quantized row q_s[t] (E4M3) with its scales
                       in expert_scale
    padding            each expert's segment is followed by zero rows up to a multiple of
                       ``align`` (an expert with no rows gets none): expert_x 0 (all bits
                       zero), expert_scale 0, row_src (-1, -1, -1), row_weight 0.0

    tokens_per_expert [L] int64     kept rows per expert, before padding
    expert_offsets    [L+1] int64   padded segment starts; the last entry is M
    row_src           [M, 3] int64  (s, t, k)
    row_weight        [M] float32   topk_weights_s[t, k]
    dropped_per_expert [L] int64    used slots to the expert (group-wide) minus kept ones

Rank-major output (``rank_major=True``; each result's ``rank_major``, records.RankMajor):
rankmajor.py.

How the rows travel (``transport``, ``exchange``) is not part of the result: every combination
gives these arrays bit for bit (transports/ carries them out for real).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from . import transports
from .capacity import kept_mask
from .exchange import split_option
from .records import DispatchResult, Group, resolve_options
from .expertmajor import assemble
from .payloads import wire_rows
from .rankmajor import rank_major_fields
from .validate import check_dispatch


def prepare(xs, topk_idx, topk_weights, num_experts, align, capacity, transport, exchange,
            payload, max_tokens_per_rank, ranks_per_node=1):
    """Validate, and fix the group's facts and the kept mask (shared by both tiers)."""
    transport, exchange = resolve_options(transport, exchange)
    exchange = split_option(exchange)[0]  # lazy runs its variant, auto
    xs, idx, ws = check_dispatch(xs, topk_idx, topk_weights, num_experts=num_experts, align=align,
                                 capacity=capacity, transport=transport, exchange=exchange,
                                 payload=payload, max_tokens_per_rank=max_tokens_per_rank,
                                 ranks_per_node=ranks_per_node)
    group = Group(num_ranks=len(xs), num_experts=int(num_experts), hidden=xs[0].shape[1],
                  topk=idx[0].shape[1], x_dtype=xs[0].dtype, align=int(align),
                  capacity=None if capacity is None else int(capacity), payload=payload,
                  transport=transport, exchange=exchange,
                  max_tokens_per_rank=None if max_tokens_per_rank is None else int(max_tokens_per_rank),
                  ranks_per_node=int(ranks_per_node))
    return group, xs, idx, ws


def dispatch(xs: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray],
             topk_weights: Sequence[np.ndarray], num_experts: int, align: int = 1,
             capacity: Optional[int] = None, transport: Optional[str] = None,
             exchange: Optional[str] = None, payload: Optional[str] = None,
             rank_major: bool = False, max_tokens_per_rank: Optional[int] = None,
             ranks_per_node: int = 1) -> List[DispatchResult]:
    """Dispatch a whole group's tokens to their experts.

    Args:
        xs: R arrays [T_r, H] float32 or bfloat16.
        topk_idx: R arrays [T_r, K] integer, -1 = unused slot.
        topk_weights: R arrays [T_r, K] float32.
        num_experts: E, a multiple of R.
        align: pad each expert's segment to a multiple of this (>= 1).
        capacity: keep at most this many slots per expert (capacity.py), None = all.
        transport: None (with exchange None) = the canonical computation; "pairs" or "dedup" =
            carried out through the simulated transport (transports/pairs.py, dedup.py;
            transports/__init__.py is the table); "hier" through the node-aware one
            (transports/hier.py).
        exchange: "ragged", "padded", "equal", "static" or "auto" (equal when the plan is
            uniform, else ragged); "lazy" runs as "auto" (exchange.split_option: the schedule
            changes when the rows move, not what moves).
        payload: None, "mxfp8" or "fp8_block128" (payloads.py).
        rank_major: also return the rank-major output (each result's ``rank_major``).
        max_tokens_per_rank: the static exchange's bound on T_r.
        ranks_per_node: G, a divisor of R: ranks ``nG .. nG + G - 1`` are node n. It fixes the
            combine's summation order (combine.py; 1, the default: rank by rank) and the hier
            transport's nodes; the dispatch's arrays do not depend on it.
    Returns:
        R ``DispatchResult`` (records.py), one per destination rank.
    """
    group, xs, idx, ws = prepare(xs, topk_idx, topk_weights, num_experts, align, capacity,
                                 transport, exchange, payload, max_tokens_per_rank, ranks_per_node)
    kept = kept_mask(idx, group.num_experts, group.capacity)
    if group.transport is not None:
        return transports.of(group.transport).dispatch(group, xs, idx, ws, kept, rank_major)
    return canonical(group, xs, idx, ws, kept, rank_major)


def canonical(group: Group, xs, idx, ws, kept, rank_major: bool) -> List[DispatchResult]:
    """The spec, computed directly (no transport). Inputs validated; idx int64; kept from
    capacity.kept_mask."""
    R, E, L = group.num_ranks, group.num_experts, group.num_local_experts
    rows, scales = wire_rows(xs, group.payload)

    # Every expert's kept slots in canonical order, and its used-slot count.
    segments_of = [[] for _ in range(E)]
    used = np.zeros(E, np.int64)
    for s in range(R):
        T, K = idx[s].shape
        for t in range(T):
            for k in range(K):
                e = int(idx[s][t, k])
                if e >= 0:
                    used[e] += 1
                    if kept[s][t, k]:
                        segments_of[e].append((s, t, k))

    results = []
    for d in range(R):
        segments = [[(rows[s][t], None if scales is None else scales[s][t], s, t, k, ws[s][t, k])
                     for s, t, k in segments_of[d * L + j]] for j in range(L)]
        fields, _ = assemble(group, segments)
        fields["dropped_per_expert"] = used[d * L:(d + 1) * L] - fields["tokens_per_expert"]
        if rank_major:
            fields.update(rank_major_fields(group, d, rows, scales, idx, ws, kept))
        results.append(group.result(d, topk_idx=idx[d], topk_weights=ws[d], kept=kept[d], **fields))
    return results
