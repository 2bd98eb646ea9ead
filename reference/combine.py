"""Combine: every token's expert outputs summed back on its source rank, in a fixed order.

Input on rank ``d``: ``expert_y [M_d, H]`` (float32 or bfloat16, one dtype for the group) in
d's expert-major layout; padding rows are ignored whatever they hold, NaN included. Output on
rank ``r``, ``[T_r, H]`` in x's dtype:

    out_r[t] = sum over nodes n ascending of N_n(t)                  (ranks_per_node = G)
    N_n(t)   = sum over d = nG .. nG + G - 1 ascending of P_d(t)      (the node partial)
    P_d(t)   = sum over k = 0..K-1 ascending, slot (r, t, k) kept and living on d, of c_k * y(r, t, k)
    c_k      = row_weight of the slot's row (= topk_weights_r[t, k]) when weighted, else 1

with the arithmetic of arith.py (float32, one rounding per multiply and per add, sums from
+0.0, cast to x's dtype with round-to-nearest-even). A token with no kept slot gets +0.0. With
G = 1 (the default) N_d = +0.0 + P_d, and the order is bitwise the rank-by-rank sum
``sum over d ascending of P_d(t)`` (arith.grouped_total_sum says why).

Results of a transport run (``dispatch(..., transport=...)``) are combined through the same
transport and exchange (its reduce_back, transports/); the bytes are the same.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from . import transports
from .arith import grouped_total_sum, partial_sum
from .records import DispatchResult
from .validate import check_results, check_rows


def slot_rows(res: Sequence[DispatchResult]) -> dict:
    """``(s, t, k) -> (d, m)``: where each kept slot's row lives, read from every ``row_src``."""
    where = {}
    for d, r in enumerate(res):
        for m, (s, t, k) in enumerate(r.row_src.tolist()):
            if s >= 0:
                where[s, t, k] = (d, m)
    return where


def ordered_sums(ys: Sequence[np.ndarray], res: Sequence[DispatchResult], weighted: bool
                 ) -> List[np.ndarray]:
    """The two-level sums of the module docstring, before the cast: R arrays [T_r, H] float32."""
    where = slot_rows(res)
    H, K = res[0].group.hidden, res[0].group.topk
    outs = []
    for r in range(len(res)):
        out = np.zeros((res[r].source.num_tokens, H), np.float32)
        for t in range(res[r].source.num_tokens):
            partials = []                                   # (d, P_d(t)), d ascending
            for d in range(len(res)):
                terms = []
                for k in range(K):
                    if where.get((r, t, k), (None,))[0] == d:
                        m = where[r, t, k][1]
                        terms.append((res[d].row_weight[m] if weighted else 1, ys[d][m]))
                partials.append((d, partial_sum(terms, H)))
            out[t] = grouped_total_sum(partials, res[0].group.ranks_per_node, H)
        outs.append(out)
    return outs


def sums_back(rows, res, weighted: bool) -> List[np.ndarray]:
    """The return path of combine (and, unweighted, of the dispatch backward): R float32 [T_s, H]
    sums, through the transport the dispatch came by (its bytes), else the spec's order."""
    carried = transports.of_results(res)
    if carried is not None:
        return carried.reduce_back(res, rows, weighted)[0]
    return ordered_sums(rows, res, weighted)


def combine(expert_ys: Sequence[np.ndarray], res: Sequence[DispatchResult], weighted: bool = True
            ) -> List[np.ndarray]:
    """Combine expert outputs back to their tokens.

    Args:
        expert_ys: R arrays [M_d, H] float32 or bfloat16 (rank d's expert-major layout).
        res: the R results of the dispatch.
        weighted: multiply each row by its routing weight.
    Returns:
        R arrays [T_r, H] in x's dtype.
    """
    check_results(res)
    ys = check_rows(expert_ys, [(r.num_rows, r.group.hidden) for r in res], grad=False)
    sums = sums_back(ys, res, weighted)
    return [s.astype(r.group.x_dtype) for s, r in zip(sums, res)]
