"""The dedup transport: a token travels once per destination rank, its slots as small rows.

Two sections per (source, destination), each its own exchange: token rows ``payload | int32 t
| int32 n`` (P + 8 bytes), one per token t with a *kept* slot on d (n >= 1 of them), t
ascending; slot rows ``int32 (k << 24 | j) | float32 w`` (8 bytes), one per kept slot, in token
order then k ascending. The return path returns per token row ``min(n, per)`` rows: the n expert
rows themselves when they are not wider than a float32 partial, else the partial. Encodable:
K <= 255, L < 2**24. The rules it shares with pairs (the plan, the exchanges, the accounting)
and the full statement are direct.py's.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Tuple

import numpy as np

from ..abi import DEDUP_MAX_LOCAL, DEDUP_MAX_TOPK, DEDUP_TOKEN_META_BYTES, SLOT_K_SHIFT
from ..abi import SLOT_ROW_BYTES
from ..arith import grouped_total_sum, partial_sum
from ..dtypes import FLOAT32
from ..errors import Reason, error
from ..exchange import VARIANTS, resolve
from ..expertmajor import assemble
from ..layout import token_rows
from ..records import Group
from .base import as_rows, chunk_bounds, payload, unpayload
from .direct import Direct, Plan


SLOT = struct.Struct("<If")     # a slot row: int32 (k << 24 | j), float32 w (abi.SLOT_ROW_BYTES)


def slot_row(k: int, j: int, w) -> bytes:
    """A slot row's bytes: slot k of its token, expert j on the receiver, weight w."""
    return SLOT.pack(k << SLOT_K_SHIFT | j, w)


def read_slot(row: np.ndarray) -> Tuple[int, int, np.float32]:
    """A slot row (uint8 [8]) -> ``(k, j, w)``."""
    code, w = SLOT.unpack(row.tobytes())
    return code >> SLOT_K_SHIFT, code & (DEDUP_MAX_LOCAL - 1), np.float32(w)


def slots_on(idx: np.ndarray, kept: np.ndarray, t: int, d: int, L: int) -> List[int]:
    """Token t's kept slots on rank d, k ascending (its token row's n is their number)."""
    return [k for k in range(idx.shape[1]) if kept[t, k] and int(idx[t, k]) // L == d]


def back_units(p: Plan, per: int) -> np.ndarray:
    """The return path: rows ``s <- d`` as [R, R] int64 ``[s, d]`` (``sum over token rows of
    min(n, per)``; exact with ``p.single``, else the bound ``min(slots, per * rows)``)."""
    if p.single is None:
        return np.minimum(p.slots, per * p.rows)
    return p.rows if per == 1 else per * p.rows - (per - 1) * p.single   # per in {1, 2}


def back_exchange(p: Plan, per: int) -> Tuple[str, Optional[int]]:
    """``(variant, cap)`` of the return path: ragged as it is; padded and equal (chunks of one
    length) as padded to ``min(max slots, per * max rows)``; static with
    ``min(slot_cap, per * cap)``."""
    variant = VARIANTS[p.variant]
    if not variant.fixed:
        return variant.name, None
    if variant.in_band:
        return variant.name, min(p.slot_cap, per * p.cap)
    return "padded", min(int(p.slots.max(initial=0)), per * int(p.rows.max(initial=0)))


def _partial(got: np.ndarray, ks: List[int], w, weighted: bool, per: int, H: int):
    """The source's P_d(t) of a token row from the ``min(n, per)`` rows it got back (y's
    dtype): the float32 partial's bits, or the n raw rows summed with its own weights of the
    kept slots ``ks`` (k ascending)."""
    if len(ks) > per:
        return np.ascontiguousarray(got).reshape(-1).view(FLOAT32).reshape(H)
    return partial_sum([(w[k] if weighted else 1, got[i]) for i, k in enumerate(ks)], H)


class Dedup(Direct):
    """dedup: token rows and slot rows (``Wire.send``: the tokens ``t`` of the token rows)."""

    name = "dedup"

    def plan_of(self, group: Group, counts, kept, tokens_per_rank, kept_to, dropped, cap,
                slot_cap, token_rows, single) -> Plan:
        """Two sections: the token rows (``tokens_per_rank`` when capacity dropped nothing,
        else the second all-gather's ``token_rows``, or without it the bound
        ``min(tokens_per_rank, slots)``) and the slot rows (the kept slots)."""
        exact = single is not None
        rows = tokens_per_rank
        if dropped:                                          # the second all-gather's words
            exact = exact and token_rows is not None
            rows = token_rows if token_rows is not None else np.minimum(tokens_per_rank, kept_to)
        rows = np.asarray(rows, np.int64)
        return Plan(counts, kept, tokens_per_rank, rows,
                    resolve(group.exchange, rows, kept_to), cap, kept_to, slot_cap, dropped,
                    None if single is None else np.asarray(single, np.int64), exact)

    def exact_counts(self, group: Group, idx, kept) -> tuple:
        """Every rank's token rows and single-slot token rows per destination (layout.token_rows):
        the second all-gather when capacity dropped something, and the accounting's."""
        rows, single = zip(*[token_rows(i, k, group.num_ranks, group.num_experts)
                             for i, k in zip(idx, kept)])
        return np.stack(rows), np.stack(single)

    def sections(self, group: Group, p: Plan):
        return [(p.rows, group.payload_bytes + DEDUP_TOKEN_META_BYTES, p.cap),
                (p.slots, SLOT_ROW_BYTES, p.slot_cap)]

    def slot_section(self, p: Plan):
        return p.slots, p.slot_cap

    def send(self, group: Group, s, rows, scales, idx, ws, kept):
        """Rank s's two sections: token rows ``payload | t | n`` and slot rows ``(k << 24 | j)
        | w``, peer d ascending; per peer, tokens ascending and each token's kept slots on d k
        ascending."""
        R, L, K = group.num_ranks, group.num_local_experts, group.topk
        if K > DEDUP_MAX_TOPK:
            raise error(s, Reason.TOPK_TOO_LARGE, K, DEDUP_MAX_TOPK)
        if L >= DEDUP_MAX_LOCAL:
            raise ValueError(f"epkit.reference: the dedup wire format needs K <= {DEDUP_MAX_TOPK} "
                             f"and L < 2**24, got K={K}, L={L}")
        send, tokens_out, slots_out = [], [], []
        for d in range(R):
            mine = [slots_on(idx, kept, t, d, L) for t in range(idx.shape[0])]
            tokens = [t for t in range(idx.shape[0]) if mine[t]]      # a kept slot on d: n >= 1
            send.append(tokens)
            for t in tokens:
                tokens_out.append(payload(group, rows, scales, t) + struct.pack("<ii", t, len(mine[t])))
                slots_out += [slot_row(k, int(idx[t, k]) - d * L, ws[t, k]) for k in mine[t]]
        return send, [as_rows(tokens_out, group.payload_bytes + DEDUP_TOKEN_META_BYTES),
                      as_rows(slots_out, SLOT_ROW_BYTES)]

    def receive(self, group: Group, d: int, got_sections, p: Plan):
        """Received token rows and slot rows (each s ascending, then t) -> expert-major fields,
        recv_map and the rank-major buffer. Everything but the source rank of a token row (the
        plan's counts, as for every exchange) comes from the rows: each token row's n claims
        the next n slot rows."""
        got, got_slots = got_sections
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
            recv_x[n], scale = unpayload(group, got[n])
            if recv_scale is not None:
                recv_scale[n] = scale
            t, count = struct.unpack("<ii", got[n, P:P + DEDUP_TOKEN_META_BYTES].tobytes())
            recv_src[n] = (source[n], t)
            assert count >= 1, "a token row travels only with a kept slot"
            for i in range(cursor, cursor + count):
                k, j, w = read_slot(got_slots[i])
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
        recv_map = np.full((N, K), -1, np.int64)
        for j in range(L):
            for (n, k), m in zip(which[j], positions[j]):
                recv_map[n, k] = m
        rank_major = dict(recv_x=recv_x, recv_scale=recv_scale, recv_topk_idx=recv_topk_idx,
                          recv_topk_weights=recv_topk_weights, recv_src=recv_src)
        return fields, recv_map, rank_major

    # --- the return path ----------------------------------------------------------------------

    def back_plan(self, p: Plan, per: int):
        """``min(n, per)`` rows per token row (back_units), with back_exchange's variant and
        cap."""
        return (back_units(p, per), *back_exchange(p, per))

    def back_send(self, res_d, y: np.ndarray, weighted: bool, per: int):
        """Rank d's return path, per received token row (recv order): its ``min(n, per)`` rows in
        y's dtype: the n rows themselves (k ascending) when ``n <= per``, else the float32
        partial P_d(t) (arith.partial_sum) as ``per`` rows of its bits. Returns (the rows,
        their count per source)."""
        H = y.shape[1]
        c = res_d.row_weight if weighted else np.ones_like(res_d.row_weight)
        out = []
        for slot_rows in res_d.wire.recv_map:
            ms = [m for m in slot_rows if m >= 0]           # k ascending
            if len(ms) <= per:
                out.append(y[ms].reshape(len(ms), H))
            else:
                part = partial_sum([(c[m], y[m]) for m in ms], H)
                out.append(part.view(y.dtype).reshape(per, H))
        units = [sum(len(b) for b in out[start:stop])
                 for start, stop in chunk_bounds(res_d.wire.plan.rows[:, res_d.rank])]
        return (np.concatenate(out).reshape(-1, H) if out else np.zeros((0, H), y.dtype)), units

    def back_counts(self, res_s, s: int, p: Plan, per: int):
        """Rows s gets back from each rank: ``min(n, per)`` per token row it sent there."""
        L, idx, kept = res_s.num_local_experts, res_s.source.topk_idx, res_s.source.kept
        return [sum(min(len(slots_on(idx, kept, t, d, L)), per) for t in res_s.wire.send[d])
                for d in range(len(res_s.wire.send))]

    def source_sums(self, res_s, got: List[np.ndarray], weighted: bool, per: int, G: int):
        """Per token row its P_d(t) (``_partial``), then per token the grouped total over the
        ranks it visits (arith.grouped_total_sum)."""
        send, T, H = res_s.wire.send, res_s.source.num_tokens, res_s.group.hidden
        w, idx, kept, L = (res_s.source.topk_weights, res_s.source.topk_idx, res_s.source.kept,
                           res_s.num_local_experts)
        where = {}
        for d in range(len(got)):
            at = 0
            for t in send[d]:
                ks = slots_on(idx, kept, t, d, L)
                n = min(len(ks), per)
                where[d, t] = _partial(got[d][at:at + n], ks, w[t], weighted, per, H)
                at += n
        out = np.zeros((T, H), FLOAT32)
        for t in range(T):
            out[t] = grouped_total_sum([(d, where[d, t]) for d in range(len(got)) if (d, t) in where],
                                       G, H)
        return out

    # --- combine backward ------------------------------------------------------------------

    def sent_tokens(self, send_d) -> List[int]:
        return list(send_d)

    def recv_slot_rows(self, wire, K: int) -> np.ndarray:
        """K slots a token row (-1: none), k ascending."""
        return wire.recv_map.reshape(len(wire.recv_map), K)

    def kept_slots(self, res_s, d: int) -> List[Tuple[int, int]]:
        """Its slot rows' order: its token rows' order, each token's kept slots on d k
        ascending."""
        L = res_s.num_local_experts
        return [(t, k) for t in res_s.wire.send[d]
                for k in slots_on(res_s.source.topk_idx, res_s.source.kept, t, d, L)]


class CountWordsDedup(Dedup):
    """dedup's plan from the count words alone (``exact=False`` where capacity dropped a slot:
    the token rows and the return path are then upper bounds; ``epkit simulate`` derives this
    one). The byte functions give it for the hier transport (accounting.py)."""

    def exact_counts(self, group: Group, idx, kept) -> tuple:
        return None, None


DEDUP = Dedup()
