"""Transports: dispatch, combine and the backward passes carried out for real, byte for byte.

A transport decides what rows travel; an exchange variant (exchange.py) moves them. Every row
is raw bytes (little-endian), as docs/design.md's wire format says. ``P`` is the payload,
``H * itemsize(x)``, or under a quantized payload ``H`` E4M3 bytes followed by the row's
``H / block`` scales (quantized at the source; payloads.py).

    pairs   one section: a row per kept slot (t, k) to rank d, ordered by local expert j, then t:
            payload | int32 t | int32 k | int32 j | float32 w                     (P + 16 bytes)
    dedup   two sections per (source, destination), each its own exchange:
            token rows: one per token t with a *kept* slot on d, ordered by t:
            payload | int32 t | int32 n                                           (P + 8 bytes)
            n >= 1 = the number of t's kept slots on d (a token whose slots on d were all
            dropped by capacity does not travel there);
            slot rows: one per kept slot on d, in token order then k ascending:
            int32 (k << 24 | j) | float32 w                                      (8 bytes)
            The n of each token row says how many slot rows are its own, so the receiver
            rebuilds the rank-major rows (local id or -1, weight 0 where -1) and the
            expert-major result from the rows alone. Encodable: K <= 255, L < 2**24.

Per (s, d), dedup's dispatch bytes (ragged) are ``rows * (P + 8) + slots * 8 <= slots * (P +
16)`` = pairs', since every token row has ``n >= 1`` kept slots (``rows <= slots``), with
equality only when no two of a token's kept slots share d; capacity included.

The plan (``plan``) is what every rank derives from the count exchange, an all-gather of
``[tokens_per_expert (E) | tokens_per_rank (R)]`` per rank (after the validation header,
validate.py): kept counts ``kept[s, e]`` (capacity.kept_counts), the rows ``s -> d`` of every
section (pairs: ``sum over e on d of kept[s, e]``; dedup token rows: ``token_rows[s, d]``, the
tokens of s with a kept slot on d; dedup slot rows: ``sum over e on d of kept[s, e]``), the
variant that runs (decided over all sections: equal only when every section is uniform) and
the static chunks ``cap`` (pairs and dedup slot rows: ``max_tokens_per_rank * min(K, L)``;
dedup token rows: ``min(max_tokens_per_rank, that)``, so 0 when K = 0: a token row needs a
kept slot). Every section is moved by that variant on its own
counts (padded: to the section's own group-wide max; static: one in-band header row plus the
section's ``cap`` rows per chunk).

Dedup's token rows ``s -> d`` are ``tokens_per_rank_s[d]`` when capacity dropped nothing
anywhere in the group. When it dropped something (every rank sees it in the gathered counts:
``kept != counts``), they are not derivable from the count words, so the dedup count exchange
runs one more all-gather: every rank contributes ``token_rows[s, :]`` (R int64 words: its
tokens with a kept slot on each rank), identical under every variant (the static one too).
Without drops there is no second collective (``Plan.dropped`` says which).

The way back (combine, dispatch backward) is the exchange with the counts transposed:

    pairs  every kept slot's row in the order it came, in expert_y's dtype (combine) or the
           gradient's dtype (dispatch backward); the source sums two-level (arith.py)
    dedup  per token row (t, d) with n kept slots, in token-row order, rows of ``H`` values in
           the rows' dtype (``iy`` bytes each, ``per = 4 / iy`` rows to a float32 row):
           if ``n * iy <= 4``: the n expert rows themselves, k ascending (the source applies
           the weights and forms P_d(t) with arith.partial_sum); else the float32 partial sum
           P_d(t) (arith.partial_sum), its bits in ``per`` rows. Both sides know n, so nothing
           says which. A token row is ``min(n, per)`` rows: ``min(n * iy, 4) * H <= n * iy * H``
           bytes, never more than pairs'. The source adds the P_d(t) over d ascending
           (arith.grouped_total_sum): bitwise equal to pairs.
           Counts ``units[s, d]`` (rows d sends back to s) are known to both sides, not
           exchanged. Variants: ragged moves them as they are; padded and equal pad every chunk
           to ``min(max slots, per * max token rows)`` (group-wide maxima of the plan's two
           sections), static to ``min(slot cap, per * token cap)`` plus the header row: caps
           from the plan alone, never above pairs' chunk.

Combine backward sends the gradient rows forward like a dispatch (pairs: one per kept slot;
dedup: one per token row, no meta: the destination knows the layout), and when weighted (K > 0)
the weight gradients back, one float32 per kept slot in the order of the dispatch's slot rows:
pairs one per row; dedup, per token row (t, d) with n kept slots, its n values k ascending
(4n bytes: pairs' 4 bytes per kept slot). The gradient rows move along the first section (pairs'
rows, dedup's token rows), the weight gradients along the slot section transposed (pairs' rows,
dedup's slot rows), each with the dispatch's variant and its section's ``cap``; both sides know
the counts (the expert side from its received rows, the source from its kept routing), so none
is exchanged. Per (s, d) and variant, dedup's gradient rows are never more than pairs' (fewer
exactly where pairs' count is larger: ragged / equal where a token row has n >= 2), its weight
gradients exactly pairs' bytes (``combine_backward_bytes_of``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from .arith import grouped_total_sum, partial_sum, scaled, weight_grad_dot
from .capacity import kept_counts, kept_mask
from .abi import DEDUP_MAX_LOCAL, DEDUP_MAX_TOPK, DEDUP_TOKEN_META_BYTES
from .abi import SLOT_ROW_BYTES as DEDUP_SLOT_ROW_BYTES
from .abi import PAIRS_META_BYTES
from .dtypes import FLOAT32, FLOAT_DTYPES, dtype_code
from .records import Group, resolve_options
from .errors import Reason, error
from .exchange import exchange_bytes, exchange_rows, resolve
from .expertmajor import assemble
from .layout import local_counts
from .payloads import get as get_payload, wire_rows
from .rankmajor import rank_major_fields
from .validate import check_layout, check_options


@dataclass(frozen=True)
class Plan:
    """The count exchange's result, identical on every rank.

    counts [R, E] int64 pre-capacity slots per (source, expert); kept [R, E] int64 kept ones;
    tokens_per_rank [R, R] int64 (row s: rank s's tokens_per_rank); rows [R, R] int64 the rows
    s -> d of the first section (pairs rows; dedup token rows), the one the way back (combine,
    backward) moves transposed; cap: its static chunk (rows); slots [R, R] int64 / slot_cap:
    dedup's slot-row section (kept slots s -> d) and its static chunk (None for pairs);
    variant: the exchange that runs, decided over all sections.
    dropped: capacity dropped a slot somewhere in the group (dedup: the count exchange ran its
    second all-gather, of the token rows). single [R, R] int64 or None: dedup token rows s -> d
    with exactly one kept slot; not exchanged (each side counts its own), only the byte
    accounting of the way back reads it. exact: False for a dedup plan made from the count
    words alone (``epkit simulate``) where they do not fix the token rows or ``single``: the
    accounting is then an upper bound (token rows ``min(tokens_per_rank, slots)``, way back
    ``min(slots, per * rows)``), still never above pairs'.
    """

    counts: np.ndarray
    kept: np.ndarray
    tokens_per_rank: np.ndarray
    rows: np.ndarray
    variant: str
    cap: Optional[int]
    slots: Optional[np.ndarray] = None
    slot_cap: Optional[int] = None
    dropped: bool = False
    single: Optional[np.ndarray] = None
    exact: bool = True


def count_words(idx: List[np.ndarray], num_ranks: int, num_experts: int) -> np.ndarray:
    """The count exchange: every rank's ``[tokens_per_expert (E) | tokens_per_rank (R)]``,
    all-gathered into int64 [R, E + R] (``idx``: validated, int64)."""
    return np.stack([np.concatenate(local_counts(i, num_ranks, num_experts)[:2]) for i in idx])


def token_rows_of(group: Group, idx: np.ndarray, kept: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """One rank's dedup token rows per destination, from its routing ``idx`` [T, K] int64 and
    kept mask [T, K] bool: ``(rows [R] int64: tokens with a kept slot on d, single [R] int64:
    those with exactly one)``. ``rows`` is what the rank contributes to the count exchange's
    second all-gather when capacity dropped something."""
    R, L = group.num_ranks, group.num_local_experts
    n = np.zeros((idx.shape[0], R), np.int64)          # kept slots of t on d
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            if kept[t, k]:
                n[t, int(idx[t, k]) // L] += 1
    return (n >= 1).sum(axis=0, dtype=np.int64), (n == 1).sum(axis=0, dtype=np.int64)


def plan(group: Group, words: np.ndarray, token_rows: Optional[np.ndarray] = None,
         single: Optional[np.ndarray] = None) -> Plan:
    """Derive the plan from the gathered count words int64 [R, E + R] (``count_words``).

    ``token_rows`` [R, R] int64: the second all-gather's result (``token_rows_of``, row s from
    rank s), which a dedup transport run supplies when capacity dropped something; ``single``
    [R, R] int64: each rank's single-slot token rows (accounting only). Without them a dedup
    plan is ``exact=False`` where they matter (class docstring)."""
    R, E, L = group.num_ranks, group.num_experts, group.num_local_experts
    counts, tokens_per_rank = words[:, :E], words[:, E:]
    kept = kept_counts(counts, group.capacity)
    dropped = bool((kept != counts).any())
    kept_to = kept.reshape(R, R, L).sum(axis=2)          # kept slots s -> d
    slot_cap = cap = None
    if group.exchange == "static":
        slot_cap = group.max_tokens_per_rank * min(group.topk, L)
        cap = min(group.max_tokens_per_rank, slot_cap)   # a token row needs a kept slot
    if group.transport == "pairs":
        return Plan(counts, kept, tokens_per_rank, kept_to, resolve(group.exchange, kept_to),
                    slot_cap, dropped=dropped)
    exact = single is not None
    rows = tokens_per_rank
    if dropped:                                          # the second all-gather's words
        exact = exact and token_rows is not None
        rows = token_rows if token_rows is not None else np.minimum(tokens_per_rank, kept_to)
    rows = np.asarray(rows, np.int64)
    return Plan(counts, kept, tokens_per_rank, rows,
                resolve(group.exchange, rows, kept_to), cap, kept_to, slot_cap, dropped,
                None if single is None else np.asarray(single, np.int64), exact)


def wire_plan(group: Group, idx: List[np.ndarray], kept: List[np.ndarray]) -> Plan:
    """The plan a transport run derives, from the whole group's routing and kept masks: the
    count words, and for dedup the second all-gather when capacity dropped something (and the
    single-slot counts for the accounting)."""
    words = count_words(idx, group.num_ranks, group.num_experts)
    if group.transport != "dedup":
        return plan(group, words)
    rows, single = zip(*[token_rows_of(group, i, k) for i, k in zip(idx, kept)])
    return plan(group, words, np.stack(rows), np.stack(single))


def sections(group: Group, p: Plan) -> List[Tuple[np.ndarray, int, Optional[int]]]:
    """What the dispatch moves, one exchange per section: ``(counts [R, R], row bytes, static
    cap)``; pairs: its rows; dedup: token rows, then slot rows."""
    P = group.payload_bytes
    if group.transport == "pairs":
        return [(p.rows, P + PAIRS_META_BYTES, p.cap)]
    return [(p.rows, P + DEDUP_TOKEN_META_BYTES, p.cap), (p.slots, DEDUP_SLOT_ROW_BYTES, p.slot_cap)]


def back_per(itemsize: int) -> int:
    """Rows of the way back's dtype that one float32 partial occupies (``4 / itemsize``); a
    dedup token row with n kept slots returns ``min(n, per)`` rows."""
    return 4 // itemsize


def back_units(p: Plan, per: int) -> np.ndarray:
    """Dedup's way back: rows ``s <- d`` as [R, R] int64 ``[s, d]`` (``sum over token rows of
    min(n, per)``; exact with ``p.single``, else the bound ``min(slots, per * rows)``)."""
    if p.single is None:
        return np.minimum(p.slots, per * p.rows)
    return p.rows if per == 1 else per * p.rows - (per - 1) * p.single   # per in {1, 2}


def back_exchange(p: Plan, per: int) -> Tuple[str, Optional[int]]:
    """``(variant, cap)`` of dedup's way back: ragged as it is; padded and equal as padded to
    ``min(max slots, per * max rows)``; static with ``min(slot_cap, per * cap)``."""
    if p.variant == "ragged":
        return "ragged", None
    if p.variant == "static":
        return "static", min(p.slot_cap, per * p.cap)
    return "padded", min(int(p.slots.max(initial=0)), per * int(p.rows.max(initial=0)))


@dataclass
class Wire:
    """What one rank keeps between a transport dispatch and the passes that follow.

    send: per peer d, what this rank sent in order: pairs ``(t, k)`` slots; dedup tokens ``t``
    (its token rows).
    recv_rows: pairs [N] int64, the expert-major row each received row went to; dedup [N, K]
    int64, the expert-major row of each received token's slot k (-1: none).
    """

    plan: Plan
    send: List[list]
    recv_rows: np.ndarray


def _as_rows(rows: List[bytes], row_bytes: int) -> np.ndarray:
    """A list of equal-length byte strings -> uint8 [n, row_bytes]."""
    return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), row_bytes).copy()


def _payload(group: Group, rows, scales, t: int) -> bytes:
    return group.payload_of.to_bytes(rows[t], None if scales is None else scales[t])


def _unpayload(group: Group, row: np.ndarray):
    """payload bytes -> (x row [H], its scales [H/block] or None)."""
    return group.payload_of.from_bytes(row[:group.payload_bytes], group.hidden, group.x_dtype)


# --- dispatch ------------------------------------------------------------------------------

def _pairs_send(group: Group, s, rows, scales, idx, ws, kept):
    L = group.num_local_experts
    send, out = [], []
    for d in range(group.num_ranks):
        slots = sorted((int(idx[t, k]) - d * L, t, k) for t in range(idx.shape[0])
                       for k in range(idx.shape[1]) if kept[t, k] and int(idx[t, k]) // L == d)
        send.append([(t, k) for _, t, k in slots])
        out += [_payload(group, rows, scales, t) + struct.pack("<iiif", t, k, j, ws[t, k])
                for j, t, k in slots]
    return send, [_as_rows(out, group.payload_bytes + PAIRS_META_BYTES)]


def _dedup_send(group: Group, s, rows, scales, idx, ws, kept):
    """Rank s's two sections: token rows ``payload | t | n`` and slot rows ``(k << 24 | j) | w``,
    peer d ascending; per peer, tokens ascending and each token's kept slots on d k ascending."""
    R, L, K = group.num_ranks, group.num_local_experts, group.topk
    if K > DEDUP_MAX_TOPK:
        raise error(s, Reason.TOPK_TOO_LARGE, K, DEDUP_MAX_TOPK)
    if L >= DEDUP_MAX_LOCAL:
        raise ValueError(f"epkit.reference: the dedup wire format needs K <= {DEDUP_MAX_TOPK} and "
                         f"L < 2**24, got K={K}, L={L}")
    send, token_rows, slot_rows = [], [], []
    for d in range(R):
        mine = [[k for k in range(K) if kept[t, k] and int(idx[t, k]) // L == d]
                for t in range(idx.shape[0])]
        tokens = [t for t in range(idx.shape[0]) if mine[t]]      # a kept slot on d: n >= 1
        send.append(tokens)
        for t in tokens:
            token_rows.append(_payload(group, rows, scales, t) + struct.pack("<ii", t, len(mine[t])))
            slot_rows += [struct.pack("<If", k << 24 | (int(idx[t, k]) - d * L), ws[t, k])
                          for k in mine[t]]
    return send, [_as_rows(token_rows, group.payload_bytes + DEDUP_TOKEN_META_BYTES),
                  _as_rows(slot_rows, DEDUP_SLOT_ROW_BYTES)]


def _pairs_receive(group: Group, d: int, got: np.ndarray, p: Plan):
    """Received rows (s ascending; within s by j, then t) -> expert-major fields."""
    R, L = group.num_ranks, group.num_local_experts
    start = np.concatenate([[0], np.cumsum(p.rows[:, d])])
    segments, which = [[] for _ in range(L)], [[] for _ in range(L)]
    for j in range(L):
        for s in range(R):
            first = start[s] + p.kept[s, d * L:d * L + j].sum()
            for i in range(first, first + p.kept[s, d * L + j]):
                x, scale = _unpayload(group, got[i])
                t, k, jj, w = struct.unpack("<iiif", got[i, group.payload_bytes:].tobytes())
                assert jj == j, "pairs rows arrive grouped by local expert"
                segments[j].append((x, scale, s, t, k, np.float32(w)))
                which[j].append(i)
    fields, positions = assemble(group, segments)
    recv_rows = np.full(got.shape[0], -1, np.int64)
    for j in range(L):
        recv_rows[which[j]] = positions[j]
    return fields, recv_rows


def _dedup_receive(group: Group, d: int, got: np.ndarray, got_slots: np.ndarray, p: Plan):
    """Received token rows and slot rows (each s ascending, then t) -> rank-major and
    expert-major fields. Everything but the source rank of a token row (the plan's counts, as
    for every exchange) comes from the rows: each token row's n claims the next n slot rows."""
    R, L, K, H = group.num_ranks, group.num_local_experts, group.topk, group.hidden
    N, P = got.shape[0], group.payload_bytes
    source = np.repeat(np.arange(R), p.rows[:, d])
    recv_x = np.zeros((N, H), group.row_dtype)
    recv_scale = group.payload_of.zero_scales(N, H)
    recv_src = np.zeros((N, 2), np.int64)
    recv_topk_idx = np.full((N, K), -1, np.int64)
    recv_topk_weights = np.zeros((N, K), np.float32)
    claimed = np.zeros(R, np.int64)                  # slot rows claimed per source
    cursor = 0
    for n in range(N):
        recv_x[n], scale = _unpayload(group, got[n])
        if recv_scale is not None:
            recv_scale[n] = scale
        t, count = struct.unpack("<ii", got[n, P:P + DEDUP_TOKEN_META_BYTES].tobytes())
        recv_src[n] = (source[n], t)
        assert count >= 1, "a token row travels only with a kept slot"
        for i in range(cursor, cursor + count):
            code, w = struct.unpack("<If", got_slots[i].tobytes())
            k, j = code >> 24, code & (DEDUP_MAX_LOCAL - 1)
            assert k < K and j < L and recv_topk_idx[n, k] == -1, "a well-formed slot row"
            recv_topk_idx[n, k] = j
            recv_topk_weights[n, k] = w
        cursor += count
        claimed[source[n]] += count
    assert cursor == got_slots.shape[0] and np.array_equal(claimed, p.slots[:, d]), \
        "the token rows' n claim every slot row, source by source"
    segments, which = [[] for _ in range(L)], [[] for _ in range(L)]
    for j in range(L):
        for n in range(N):
            for k in range(K):
                if recv_topk_idx[n, k] == j:
                    s, t = recv_src[n]
                    segments[j].append((recv_x[n], None if recv_scale is None else recv_scale[n],
                                        int(s), int(t), k, recv_topk_weights[n, k]))
                    which[j].append((n, k))
    fields, positions = assemble(group, segments)
    recv_rows = np.full((N, K), -1, np.int64)
    for j in range(L):
        for (n, k), m in zip(which[j], positions[j]):
            recv_rows[n, k] = m
    rank_major = dict(recv_x=recv_x, recv_scale=recv_scale, recv_topk_idx=recv_topk_idx,
                      recv_topk_weights=recv_topk_weights, recv_src=recv_src)
    return fields, recv_rows, rank_major


def dispatch(group: Group, xs, idx, ws, kept, rank_major: bool):
    """Dispatch through ``group.transport`` and ``group.exchange`` (inputs validated)."""
    R, L = group.num_ranks, group.num_local_experts
    p = wire_plan(group, idx, kept)
    rows, scales = wire_rows(xs, group.payload)
    send_fn = _pairs_send if group.transport == "pairs" else _dedup_send
    sends, bufs = zip(*[send_fn(group, s, rows[s], None if scales is None else scales[s],
                                idx[s], ws[s], kept[s]) for s in range(R)])
    received, moved = [], np.zeros((R, R), np.int64)
    for i, (counts, _, cap) in enumerate(sections(group, p)):     # one exchange per section
        got, bytes_moved = exchange_rows([b[i] for b in bufs], counts, p.variant, cap)
        received.append(got)
        moved += bytes_moved
    results = []
    for d in range(R):
        if group.transport == "pairs":
            fields, recv_rows = _pairs_receive(group, d, received[0][d], p)
            if rank_major:
                fields.update(rank_major_fields(group, d, rows, scales, idx, ws, kept))
        else:
            fields, recv_rows, rm = _dedup_receive(group, d, received[0][d], received[1][d], p)
            if rank_major:
                fields.update(rm)
        fields["dropped_per_expert"] = (p.counts[:, d * L:(d + 1) * L].sum(axis=0)
                                        - fields["tokens_per_expert"])
        results.append(group.result(d, topk_idx=idx[d], topk_weights=ws[d], kept=kept[d],
                                    bytes_sent=moved[d], wire=Wire(p, sends[d], recv_rows), **fields))
    return results


# --- the way back: combine and dispatch backward -------------------------------------------

def _rows_of(arr: np.ndarray) -> np.ndarray:
    """[n, ...] -> uint8 [n, bytes per row]."""
    arr = np.ascontiguousarray(arr)
    width = int(np.prod(arr.shape[1:], dtype=np.int64))
    return arr.reshape(arr.shape[0], width).view(np.uint8).reshape(arr.shape[0], width * arr.itemsize)


def _group_of(res) -> Group:
    r = res[0]
    return Group(r.num_ranks, r.num_experts, r.hidden, r.topk, r.x_dtype, r.align, r.capacity,
                 r.payload, r.transport, r.exchange, r.max_tokens_per_rank)


def _dedup_back_rows(res_d, y: np.ndarray, weighted: bool, per: int) -> List[np.ndarray]:
    """Rank d's way back, per received token row (recv order): its ``min(n, per)`` rows in
    y's dtype: the n rows themselves (k ascending) when ``n <= per``, else the float32 partial
    P_d(t) (arith.partial_sum) as ``per`` rows of its bits."""
    H = y.shape[1]
    c = res_d.row_weight if weighted else np.ones_like(res_d.row_weight)
    out = []
    for slot_rows in res_d.wire.recv_rows:
        ms = [m for m in slot_rows if m >= 0]           # k ascending
        if len(ms) <= per:
            out.append(y[ms].reshape(len(ms), H))
        else:
            part = partial_sum([(c[m], y[m]) for m in ms], H)
            out.append(part.view(y.dtype).reshape(per, H))
    return out


def _dedup_partial(got: np.ndarray, ms_k: List[int], w, weighted: bool, per: int, H: int):
    """The source's P_d(t) of a token row from the ``min(n, per)`` rows it got back (y's
    dtype): the float32 partial's bits, or the n raw rows summed with its own weights of the
    kept slots ``ms_k`` (k ascending)."""
    if len(ms_k) > per:
        return np.ascontiguousarray(got).reshape(-1).view(FLOAT32).reshape(H)
    return partial_sum([(w[k] if weighted else 1, got[i]) for i, k in enumerate(ms_k)], H)


def reduce_back(res, ys: List[np.ndarray], weighted: bool):
    """Combine (``ys`` = expert_y) or dispatch backward (``ys`` = gradients, unweighted)
    through the transport of ``res``.

    Returns (R float32 arrays [T_s, H] before the cast, moved [R, R] int64 bytes).
    """
    group = _group_of(res)
    R, L, K, H = group.num_ranks, group.num_local_experts, group.topk, group.hidden
    p = res[0].wire.plan
    dtype = ys[0].dtype
    if group.transport == "pairs":                      # each kept slot's row, as it came
        bufs = [_rows_of(ys[d][res[d].wire.recv_rows]) for d in range(R)]
        received, moved = exchange_rows(bufs, p.rows.T, p.variant, p.cap)
    else:                                               # min(n, per) rows per token row
        per = back_per(dtype.itemsize)
        back = [_dedup_back_rows(res[d], ys[d], weighted, per) for d in range(R)]
        units = np.array([[sum(len(b) for b in back[d][start:stop]) for start, stop in
                           _chunk_bounds(p.rows[:, d])] for d in range(R)], np.int64)  # [d, s]
        bufs = [_rows_of(np.concatenate(b).reshape(-1, H) if b else np.zeros((0, H), dtype))
                for b in back]
        variant, cap = back_exchange(p, per)
        received, moved = exchange_rows(bufs, units, variant, cap)
    G = res[0].ranks_per_node           # the summation order's nodes (arith.grouped_total_sum)
    outs = []
    for s in range(R):
        send, T = res[s].wire.send, res[s].num_tokens
        w, idx, kept = res[s].topk_weights, res[s].topk_idx, res[s].kept
        counts = (p.rows.T[:, s] if group.transport == "pairs" else
                  [sum(min(sum(1 for k in range(K) if kept[t, k] and idx[t, k] // L == d), per)
                       for t in send[d]) for d in range(R)])
        start = np.concatenate([[0], np.cumsum(counts)])
        got = [received[s][start[d]:start[d + 1]].copy().view(dtype).reshape(-1, H)
               for d in range(R)]
        out = np.zeros((T, H), FLOAT32)
        if group.transport == "pairs":
            where = {(d, t, k): got[d][i] for d in range(R) for i, (t, k) in enumerate(send[d])}
            for t in range(T):
                out[t] = grouped_total_sum(
                    [(d, partial_sum([(w[t, k] if weighted else 1, where[d, t, k])
                                      for k in range(K) if (d, t, k) in where], H))
                     for d in range(R)], G, H)
        else:
            where = {}
            for d in range(R):
                at = 0
                for t in send[d]:
                    ks = [k for k in range(K) if kept[t, k] and idx[t, k] // L == d]
                    n = min(len(ks), per)
                    where[d, t] = _dedup_partial(got[d][at:at + n], ks, w[t], weighted, per, H)
                    at += n
            for t in range(T):
                out[t] = grouped_total_sum([(d, where[d, t]) for d in range(R) if (d, t) in where],
                                           G, H)
        outs.append(out)
    return outs, moved


def _chunk_bounds(counts) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each source's rows in a concatenation with these counts."""
    start = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(int(start[i]), int(start[i + 1])) for i in range(len(counts))]


def combine_backward(res, grad_outs: List[np.ndarray], ys: List[np.ndarray], weighted: bool):
    """Combine backward through the transport of ``res``.

    Returns (gys: R arrays [M_d, H] in y's dtype, gws: R arrays [T_s, K] float32, moved: list of
    the [R, R] byte matrices of each exchange run: the gradient rows, then (weighted, K > 0)
    the weight gradients; ``combine_backward_bytes_of`` says the same without moving).
    """
    group = _group_of(res)
    R, K, H = group.num_ranks, group.topk, group.hidden
    p = res[0].wire.plan
    pairs = group.transport == "pairs"
    bufs = []
    for s in range(R):                                  # gradient rows out, like a dispatch
        send, g = res[s].wire.send, grad_outs[s]
        rows = [g[t] for d in range(R) for t, _ in send[d]] if pairs else \
               [g[t] for d in range(R) for t in send[d]]
        bufs.append(_rows_of(np.array(rows, g.dtype).reshape(len(rows), H)))
    received, moved = exchange_rows(bufs, p.rows, p.variant, p.cap)
    gys, back = [], []
    for d in range(R):
        wire, y, c = res[d].wire, ys[d], res[d].row_weight
        g = received[d].copy().view(grad_outs[0].dtype).reshape(len(received[d]), H)
        gy = np.zeros(y.shape, y.dtype)
        slot_rows = wire.recv_rows.reshape(len(wire.recv_rows), 1 if pairs else K)   # pairs: one slot a row
        gw = []                                         # one float32 per kept slot, slot-row order
        for n, ms in enumerate(slot_rows):
            for m in ms:                                # dedup: k ascending, as the slot rows came
                if m >= 0:
                    gy[m] = scaled(c[m] if weighted else 1, g[n], y.dtype)
                    gw.append(weight_grad_dot(g[n], y[m]) if weighted else 0)
        gys.append(gy)
        back.append(_rows_of(np.array(gw, FLOAT32).reshape(len(gw), 1)))
    gws = [np.zeros((r.num_tokens, K), FLOAT32) for r in res]
    if not weighted or K == 0:
        return gys, gws, [moved]
    counts, cap = _slot_section(p)
    received, moved_back = exchange_rows(back, counts.T, p.variant, cap)
    for s in range(R):
        start = np.concatenate([[0], np.cumsum(counts.T[:, s])])
        for d in range(R):
            vals = received[s][start[d]:start[d + 1]].copy().view(FLOAT32).reshape(-1)
            for v, (t, k) in zip(vals, _kept_slots(res[s], d, pairs), strict=True):
                gws[s][t, k] = v
    return gys, gws, [moved, moved_back]


def _slot_section(p: Plan) -> Tuple[np.ndarray, Optional[int]]:
    """``(counts [R, R] s -> d, static cap)`` of the kept slots: pairs' rows, dedup's slot
    rows; the weight gradients come back along it (transposed), one float32 per slot."""
    return (p.slots, p.slot_cap) if p.slots is not None else (p.rows, p.cap)


def _kept_slots(res_s, d: int, pairs: bool) -> List[Tuple[int, int]]:
    """Rank s's kept slots ``(t, k)`` on d in the order they were sent: pairs' rows; dedup's
    slot rows (its token rows' order, each token's kept slots on d k ascending)."""
    send = res_s.wire.send[d]
    if pairs:
        return list(send)
    K, L = res_s.topk, res_s.num_local_experts
    return [(t, k) for t in send for k in range(K)
            if res_s.kept[t, k] and res_s.topk_idx[t, k] // L == d]


# --- byte accounting -----------------------------------------------------------------------

def bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity, payload,
                 max_tokens_per_rank):
    """Validate the byte-accounting arguments; return ``(Group, idx int64 list)``."""
    transport, exchange = resolve_options(transport or "dedup", exchange)
    R = len(topk_idx)
    check_options(R, align=1, capacity=capacity, num_experts=num_experts, transport=transport,
                  exchange=exchange, payload=payload, max_tokens_per_rank=max_tokens_per_rank)
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise error(0, Reason.X_DTYPE, dtype_code(dtype))
    idx = check_layout(topk_idx, num_experts)
    for r in range(1, R):
        if idx[r].shape[1] != idx[0].shape[1]:
            raise error(r, Reason.TOPK_MISMATCH, idx[r].shape[1], idx[0].shape[1])
    code, a, b = get_payload(payload).hidden_triple(int(hidden))
    if code != Reason.OK:
        raise error(0, code, a, b)
    if exchange == "static":
        for r in range(R):
            if idx[r].shape[0] > max_tokens_per_rank:
                raise error(r, Reason.STATIC_OVERFLOW, idx[r].shape[0], max_tokens_per_rank)
    group = Group(R, int(num_experts), int(hidden), idx[0].shape[1], dtype, 1,
                  None if capacity is None else int(capacity), payload, transport, exchange,
                  None if max_tokens_per_rank is None else int(max_tokens_per_rank))
    return group, idx


def dispatch_bytes_of(group: Group, p: Plan) -> np.ndarray:
    """The dispatch's [R, R] byte matrix for a plan: every section's exchange, padding and
    in-band header rows included."""
    return sum(exchange_bytes(counts, row_bytes, p.variant, cap)
               for counts, row_bytes, cap in sections(group, p))


def combine_bytes_of(group: Group, p: Plan) -> np.ndarray:
    """The combine's [R, R] byte matrix for a plan (``group.x_dtype`` = expert_y's dtype):
    rows of ``H * itemsize(y)`` bytes; pairs one per kept slot, dedup ``back_units`` with
    ``back_exchange``'s variant and cap (an upper bound for an ``exact=False`` plan)."""
    row_bytes = group.hidden * group.x_dtype.itemsize
    if group.transport == "pairs":
        return exchange_bytes(p.rows.T, row_bytes, p.variant, p.cap)
    per = back_per(group.x_dtype.itemsize)
    variant, cap = back_exchange(p, per)
    return exchange_bytes(back_units(p, per).T, row_bytes, variant, cap)


def combine_backward_bytes_of(group: Group, p: Plan, weighted: bool) -> List[np.ndarray]:
    """The combine backward's [R, R] byte matrices for a plan, one per exchange, as
    ``combine_backward`` moves them (``group.x_dtype`` = the gradient's dtype): the gradient
    rows forward, ``H * itemsize`` bytes per row of the dispatch's first section (pairs' rows,
    dedup's token rows); then, when weighted and K > 0, the weight gradients back, 4 bytes per
    kept slot along the slot section (pairs' rows, dedup's slot rows) with its cap."""
    row_bytes = group.hidden * group.x_dtype.itemsize
    out = [exchange_bytes(p.rows, row_bytes, p.variant, p.cap)]
    if weighted and group.topk > 0:
        counts, cap = _slot_section(p)
        out.append(exchange_bytes(counts.T, FLOAT32.itemsize, p.variant, cap))
    return out


def dispatch_bytes(topk_idx, num_experts, hidden, dtype="bfloat16", transport="dedup",
                   exchange="ragged", capacity=None, payload=None, max_tokens_per_rank=None):
    """Bytes rank s sends to rank d in a dispatch ([R, R] int64; diagonal = the local copy).

    pairs: ``P + 16`` per kept slot; dedup: ``P + 8`` per token row (a token with a kept slot on
    d) plus 8 per slot row (a kept slot on d); each section as its exchange variant moves it
    (padding and in-band header rows included).

    Args: topk_idx: R arrays [T_r, K] integer; hidden: H; dtype: x's dtype; the rest as
    ``dispatch``. Checks (raising ``InputError``): options, dtype, routing per rank, K agreement,
    ``H % block`` under a quantized payload, ``T_r <= max_tokens_per_rank`` under the static exchange, and a
    uniform plan for ``exchange="equal"``.
    """
    group, idx = bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity,
                             payload, max_tokens_per_rank)
    return dispatch_bytes_of(group, wire_plan(group, idx, kept_mask(idx, group.num_experts,
                                                                    group.capacity)))


def combine_bytes(topk_idx, num_experts, hidden, dtype="bfloat16", transport="dedup",
                  exchange="ragged", capacity=None, payload=None, max_tokens_per_rank=None):
    """Bytes rank a sends to rank b in the combine ([R, R] int64), ``dtype`` = expert_y's dtype.

    pairs: ``H * itemsize(dtype)`` per kept slot; dedup: ``min(n * itemsize(dtype), 4) * H``
    per token row with n kept slots (its raw rows, or a float32 partial sum), padded / equal /
    static to the caps of ``back_exchange``. The counts are the dispatch's, transposed. ``payload`` does not change the
    combine (it travels unquantized); it is checked like in ``dispatch_bytes``.
    """
    group, idx = bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity,
                             payload, max_tokens_per_rank)
    return combine_bytes_of(group, wire_plan(group, idx, kept_mask(idx, group.num_experts,
                                                                   group.capacity)))
