"""The vectorized tier: the same operations, the same signatures, the same bits, for scale.

``epkit.reference.fast.dispatch`` etc. compute exactly what the clear tier computes (tests hold
them equal bit for bit on hypothesis cases; ``grad_topk_weights`` too, since both use
arith.weight_grad_dot). The whole group is handled as one concatenation of all ranks' tokens:
global token ``g = base[s] + t`` and slot ``f = g * K + k``.

dispatch
    A stable sort of the used slots by expert puts every expert's slots in canonical order
    (s, then t) - a slot's rank within its expert decides capacity; its padded position is
    ``expert_offsets[j] + rank``. With ``transport`` set, the result is the canonical one (the
    clear tier proves every transport gives it bit for bit) plus ``bytes_sent`` from the plan
    (the clear tier's own accounting, accounting.py and transports/: every section of the wire
    format, dedup's token rows and slot rows, as its exchange variant moves it); the same
    InputErrors are raised (EQUAL_NONUNIFORM over both dedup sections, STATIC_OVERFLOW, ...).

combine / dispatch_backward
    Destination ranks in ascending order; on each, the partial sums of all its tokens at once,
    slot by slot (k ascending), then added into the tokens' totals. That is arith.py's order
    exactly: ranks a token does not visit would only add +0.0, which changes no bit.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .accounting import bytes_group, combine_bytes_of, dispatch_bytes_of, wire_plan
from .arith import weight_grad_dot
from .capacity import kept_mask, sorted_slots
from .dispatch import prepare
from .exchange import exchange
from .expertmajor import padded
from .fp8_block128 import dequantize_fp8_block128, quantize_fp8_block128
from .mxfp8 import dequantize_mxfp8, quantize_mxfp8
from .payloads import wire_rows
from .records import DispatchResult, Group, Layout
from .validate import check_layout, check_results, check_rows

# exchange and the payloads' quantize / dequantize are vectorized already: the same functions.
__all__ = ["layout", "dispatch", "combine", "dispatch_backward", "combine_backward",
           "dispatch_bytes", "combine_bytes", "exchange", "quantize_mxfp8", "dequantize_mxfp8",
           "quantize_fp8_block128", "dequantize_fp8_block128"]

F32 = np.float32


def _cat(arrays: Sequence[np.ndarray], tail) -> np.ndarray:
    """Concatenate per-rank arrays along rows (an empty group part keeps its trailing shape)."""
    return np.concatenate([np.asarray(a).reshape((len(a),) + tuple(tail)) for a in arrays])


def _counts(idx: List[np.ndarray], R: int, E: int):
    """Vectorized count words: ``(tokens_per_expert [R, E], tokens_per_rank [R, R],
    slots_per_rank [R, R], is_token_in_rank: R arrays [T, R])``."""
    L = E // R
    tpe, tpr, spr, itr = [], [], [], []
    for i in idx:
        used = i >= 0
        dest = np.where(used, i // L, 0)
        in_rank = np.zeros((i.shape[0], R), bool)
        rows, cols = np.nonzero(used)
        in_rank[rows, dest[rows, cols]] = True
        tpe.append(np.bincount(i[used], minlength=E).astype(np.int64))
        spr.append(np.bincount(dest[used], minlength=R).astype(np.int64))
        tpr.append(in_rank.sum(axis=0, dtype=np.int64))
        itr.append(in_rank)
    return np.array(tpe).reshape(R, E), np.array(tpr).reshape(R, R), np.array(spr).reshape(R, R), itr


def count_words_block(idx: np.ndarray, tokens: Sequence[int], R: int, E: int) -> np.ndarray:
    """Count words of consecutive ranks from their concatenated routing (the form a simulator
    of a large group draws: a block of ranks at a time, never the whole group's routing).

    Args: idx [sum(tokens), K] integer (``-1`` = unused slot); tokens: tokens of each rank.
    Returns: int64 [len(tokens), E + R], row ``s`` = ``[tokens_per_expert | tokens_per_rank]``
    of that rank, what ``transports.count_words`` gives."""
    n_ranks, L = len(tokens), E // R
    idx = np.asarray(idx, np.int64)
    K = idx.shape[1] if idx.ndim == 2 else 0
    owner = np.repeat(np.arange(n_ranks, dtype=np.int64), np.asarray(tokens, np.int64))
    used = idx >= 0
    tpe = np.bincount((owner[:, None] * E + idx)[used], minlength=n_ranks * E)
    dest = np.where(used, idx // L, -1)
    first = used.copy()               # slot k is the first of its token on its rank
    for k in range(1, K):
        for j in range(k):
            first[:, k] &= dest[:, k] != dest[:, j]
    tpr = np.bincount((owner[:, None] * R + dest)[first], minlength=n_ranks * R)
    return np.concatenate([tpe.reshape(n_ranks, E), tpr.reshape(n_ranks, R)], axis=1)


def count_words(idx: Sequence[np.ndarray], num_ranks: int, num_experts: int) -> np.ndarray:
    """transports.count_words, vectorized: int64 [R, E + R]."""
    K = max((np.shape(i)[1] for i in idx if np.ndim(i) == 2), default=0)
    cat = np.concatenate([np.asarray(i, np.int64).reshape(len(i), K) for i in idx])
    return count_words_block(cat, [len(i) for i in idx], num_ranks, num_experts)


def layout(topk_idx: Sequence[np.ndarray], num_experts: int) -> List[Layout]:
    """layout.layout, vectorized."""
    idx = check_layout(topk_idx, num_experts)
    R, E = len(idx), int(num_experts)
    L = E // R
    tpe, tpr, spr, itr = _counts(idx, R, E)
    recv = tpe.reshape(R, R, L)             # [s, d, j]
    return [Layout(d, tpe[d], tpr[d], spr[d], itr[d], recv[:, d, :].copy()) for d in range(R)]


def dispatch(xs: Sequence[np.ndarray], topk_idx: Sequence[np.ndarray],
             topk_weights: Sequence[np.ndarray], num_experts: int, align: int = 1,
             capacity: Optional[int] = None, transport: Optional[str] = None,
             exchange: Optional[str] = None, payload: Optional[str] = None,
             rank_major: bool = False, max_tokens_per_rank: Optional[int] = None
             ) -> List[DispatchResult]:
    """dispatch.dispatch, vectorized (module docstring)."""
    group, xs, idx, ws = prepare(xs, topk_idx, topk_weights, num_experts, align, capacity,
                                 transport, exchange, payload, max_tokens_per_rank)
    R, E, L, K, H = (group.num_ranks, group.num_experts, group.num_local_experts, group.topk,
                     group.hidden)
    T = np.array([i.shape[0] for i in idx], np.int64)
    base = np.concatenate([[0], np.cumsum(T)])
    src = np.repeat(np.arange(R), T)                      # source rank of each global token
    rows, scales = wire_rows(xs, group.payload)
    G = int(base[-1])
    rows_all = _cat(rows + [np.zeros((1, H), group.row_dtype)], (H,))      # row G: zeros
    zero_scale = group.payload_of.zero_scales(1, H)                          # row G's scales
    scales_all = None if scales is None else _cat(scales + [zero_scale], zero_scale.shape[1:])
    idx_all = _cat(idx, (K,)).ravel()
    w_all = _cat(ws, (K,)).ravel()

    f_sorted, e_sorted, used, start, rank_in_e, keep, kept_all = sorted_slots(idx_all, E,
                                                                              group.capacity)
    kept_cnt = used if group.capacity is None else np.minimum(used, group.capacity)
    kept = [kept_all[base[s] * K:base[s + 1] * K].reshape(int(T[s]), K) for s in range(R)]
    bytes_sent = None
    if group.transport is not None:
        bytes_sent = dispatch_bytes_of(group, _wire_plan(group, idx, kept))

    results = []
    for d in range(R):
        lo, hi = start[d * L], start[(d + 1) * L]
        sel = keep[lo:hi]
        f, e, r_in = f_sorted[lo:hi][sel], e_sorted[lo:hi][sel], rank_in_e[lo:hi][sel]
        tokens_per_expert = kept_cnt[d * L:(d + 1) * L].copy()
        expert_offsets = np.concatenate([[0], np.cumsum(padded(tokens_per_expert, group.align))]
                                        ).astype(np.int64)
        M = int(expert_offsets[-1])
        m = expert_offsets[e - d * L] + r_in
        g = f // K
        from_row = np.full(M, G, np.int64)             # source row of each output row (G: zero)
        from_row[m] = g
        expert_x = np.take(rows_all, from_row, axis=0)
        expert_scale = None if scales_all is None else np.take(scales_all, from_row, axis=0)
        row_src = np.full((M, 3), -1, np.int64)
        row_src[m] = np.stack([src[g], g - base[src[g]], f % K], axis=1)
        row_weight = np.zeros(M, F32)
        row_weight[m] = w_all[f]
        fields = dict(expert_x=expert_x, expert_scale=expert_scale,
                      tokens_per_expert=tokens_per_expert, expert_offsets=expert_offsets,
                      row_src=row_src, row_weight=row_weight,
                      dropped_per_expert=used[d * L:(d + 1) * L] - tokens_per_expert,
                      bytes_sent=None if bytes_sent is None else bytes_sent[d])
        if rank_major:
            fields.update(_rank_major(group, d, idx_all.reshape(G, K), kept_all.reshape(G, K),
                                      w_all.reshape(G, K), rows_all, scales_all, src, base))
        results.append(group.result(d, topk_idx=idx[d], topk_weights=ws[d], kept=kept[d], **fields))
    return results


def _wire_plan(group: Group, idx: List[np.ndarray], kept: List[np.ndarray]):
    """The transport's plan (accounting.wire_plan: for dedup the token rows of
    layout.token_rows) on the count words counted here."""
    return wire_plan(group, idx, kept, count_words(idx, group.num_ranks, group.num_experts))


def _rank_major(group: Group, d, idx_all, kept_all, w_all, rows_all, scales_all, src, base) -> dict:
    L = group.num_local_experts
    on_d = (idx_all >= 0) & (idx_all // L == d)              # [G, K] (floor division of -1 is -1)
    g = np.flatnonzero((on_d & kept_all).any(axis=1))      # tokens with a kept slot on d
    ids = np.where(on_d[g] & kept_all[g], idx_all[g] - d * L, -1)
    return dict(recv_x=rows_all[g], recv_scale=None if scales_all is None else scales_all[g],
                recv_topk_idx=ids.astype(np.int64),
                recv_topk_weights=np.where(ids >= 0, w_all[g], F32(0)).astype(F32),
                recv_src=np.stack([src[g], g - base[src[g]]], axis=1).astype(np.int64))


def _ordered_sums(ys: Sequence[np.ndarray], res: Sequence[DispatchResult], weighted: bool
                  ) -> List[np.ndarray]:
    """combine.ordered_sums, vectorized: R arrays [T_r, H] float32.

    Destination ranks in ascending order: rank d's kept rows sorted by (token, k); the partial
    sums ``P_d`` of all tokens on d built in passes over the p-th slot of each token (p = 0
    starts from +0.0); then ``total[tokens] += P_d``. The order of every add is arith.py's.
    """
    R, H = len(res), res[0].group.hidden
    base = np.concatenate([[0], np.cumsum([r.source.num_tokens for r in res])]).astype(np.int64)
    total = np.zeros((int(base[-1]), H), F32)
    for d, r in enumerate(res):
        rows = np.flatnonzero(r.row_src[:, 0] >= 0)
        g = base[r.row_src[rows, 0]] + r.row_src[rows, 1]          # global token of each row
        order = np.lexsort((r.row_src[rows, 2], g))                  # by token, then k
        rows, g = rows[order], g[order]
        first = np.ones(len(g), bool)
        first[1:] = g[1:] != g[:-1]
        group = np.cumsum(first) - 1                                 # which token of d's
        pos = np.arange(len(g)) - np.flatnonzero(first)[group]       # p-th slot of its token
        c = r.row_weight[rows] if weighted else np.ones(len(rows), F32)
        partial = np.zeros((int(first.sum()), H), F32)
        for p in range(int(pos.max(initial=-1)) + 1):
            sel = np.flatnonzero(pos == p)
            partial[group[sel]] += c[sel, None] * ys[d][rows[sel]].astype(F32)
        total[g[first]] += partial
    return [total[base[r]:base[r + 1]] for r in range(R)]


def combine(expert_ys: Sequence[np.ndarray], res: Sequence[DispatchResult], weighted: bool = True
            ) -> List[np.ndarray]:
    """combine.combine, vectorized."""
    check_results(res)
    ys = check_rows(expert_ys, [(r.num_rows, r.group.hidden) for r in res], grad=False)
    return [s.astype(r.group.x_dtype) for s, r in zip(_ordered_sums(ys, res, weighted), res)]


def dispatch_backward(grad_expert_xs: Sequence[np.ndarray], res: Sequence[DispatchResult]
                      ) -> List[np.ndarray]:
    """backward.dispatch_backward, vectorized."""
    check_results(res)
    gs = check_rows(grad_expert_xs, [(r.num_rows, r.group.hidden) for r in res], grad=True)
    return [s.astype(r.group.x_dtype) for s, r in zip(_ordered_sums(gs, res, False), res)]


def combine_backward(grad_outs: Sequence[np.ndarray], expert_ys: Sequence[np.ndarray],
                     res: Sequence[DispatchResult], weighted: bool = True):
    """backward.combine_backward, vectorized."""
    check_results(res)
    gs = check_rows(grad_outs, [(r.source.num_tokens, r.group.hidden) for r in res], grad=True)
    ys = check_rows(expert_ys, [(r.num_rows, r.group.hidden) for r in res], grad=False)
    K, H = res[0].group.topk, res[0].group.hidden
    base = np.concatenate([[0], np.cumsum([r.source.num_tokens for r in res])])
    g_all = _cat(gs, (H,))
    gw_all = np.zeros(int(base[-1]) * K, F32)
    gys = []
    for d, r in enumerate(res):
        valid = np.flatnonzero(r.row_src[:, 0] >= 0)
        s, t, k = r.row_src[valid].T
        g = g_all[base[s] + t]
        c = r.row_weight[valid] if weighted else np.ones(len(valid), F32)
        gy = np.zeros(ys[d].shape, ys[d].dtype)
        gy[valid] = (c[:, None] * g.astype(F32)).astype(ys[d].dtype)
        gys.append(gy)
        if weighted:
            gw_all[(base[s] + t) * K + k] = weight_grad_dot(g, ys[d][valid])
    gws = [gw_all[base[r] * K:base[r + 1] * K].reshape(res[r].source.num_tokens, K)
           for r in range(len(res))]
    return gys, gws


def dispatch_bytes(topk_idx, num_experts, hidden, dtype="bfloat16", transport="dedup",
                   exchange="ragged", capacity=None, payload=None, max_tokens_per_rank=None):
    """accounting.dispatch_bytes, vectorized."""
    group, idx = bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity,
                             payload, max_tokens_per_rank)
    return dispatch_bytes_of(group, _wire_plan(group, idx, kept_mask(idx, group.num_experts, group.capacity)))


def combine_bytes(topk_idx, num_experts, hidden, dtype="bfloat16", transport="dedup",
                  exchange="ragged", capacity=None, payload=None, max_tokens_per_rank=None):
    """accounting.combine_bytes, vectorized."""
    group, idx = bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity,
                             payload, max_tokens_per_rank)
    return combine_bytes_of(group, _wire_plan(group, idx, kept_mask(idx, group.num_experts, group.capacity)))
