"""The one-stage transports, pairs (pairs.py) and dedup (dedup.py): what they share.

Every row goes straight from its source to its destination, one exchange per section; the
plan, the dispatch, the return path, the combine backward and the byte accounting are one body
here (``Direct``), and what differs is a method of each class (the rows' layout: a row per
kept slot, or a token row with its slot rows). Every row is raw bytes (little-endian), as
docs/design.md's wire format says. ``P`` is the payload,
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

The plan (``Direct.plan``) is what every rank derives from the count exchange, an all-gather of
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
runs one more all-gather: every rank contributes ``token_rows[s, :]`` (layout.token_rows; R
int64 words: its tokens with a kept slot on each rank), identical under every variant (the static one too).
Without drops there is no second collective (``Plan.dropped`` says which).

The return path (combine, dispatch backward) is the exchange with the counts transposed:

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

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..arith import scaled, weight_grad_dot
from ..capacity import kept_counts
from ..dtypes import FLOAT32
from ..exchange import exchange_bytes, exchange_rows, is_static
from ..layout import local_counts
from ..payloads import wire_rows
from ..rankmajor import rank_major_fields
from ..records import Group
from .base import Transport, rows_of


@dataclass(frozen=True)
class Plan:
    """The count exchange's result, identical on every rank.

    counts [R, E] int64 pre-capacity slots per (source, expert); kept [R, E] int64 kept ones;
    tokens_per_rank [R, R] int64 (row s: rank s's tokens_per_rank); rows [R, R] int64 the rows
    s -> d of the first section (pairs rows; dedup token rows), the one the return path (combine,
    backward) moves transposed; cap: its static chunk (rows); slots [R, R] int64 / slot_cap:
    dedup's slot-row section (kept slots s -> d) and its static chunk (None for pairs);
    variant: the exchange that runs, decided over all sections.
    dropped: capacity dropped a slot somewhere in the group (dedup: the count exchange ran its
    second all-gather, of the token rows). single [R, R] int64 or None: dedup token rows s -> d
    with exactly one kept slot; not exchanged (each side counts its own), only the byte
    accounting of the return path reads it. exact: False for a dedup plan made from the count
    words alone (``epkit simulate``) where they do not fix the token rows or ``single``: the
    accounting is then an upper bound (token rows ``min(tokens_per_rank, slots)``, return path
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


def back_per(itemsize: int) -> int:
    """Rows of the return path's dtype that one float32 partial occupies (``4 / itemsize``); a
    dedup token row with n kept slots returns ``min(n, per)`` rows."""
    return 4 // itemsize


@dataclass
class Wire:
    """What one rank keeps between a transport dispatch and the passes that follow.

    send: per peer d, what this rank sent in order: pairs ``(t, k)`` slots; dedup tokens ``t``
    (its token rows).
    recv_map: pairs [N] int64, the expert-major row each received row went to; dedup [N, K]
    int64, the expert-major row of each received token's slot k (-1: none).
    """

    plan: Plan
    send: List[list]
    recv_map: np.ndarray


class Direct(Transport):
    """A one-stage transport (module docstring). The shared bodies are here; a subclass says
    how its rows are laid out:

        plan_of(...)            its sections' counts, caps and variant in the plan
        exact_counts(...)       what its plan needs beyond the count words
        sections(group, p)      what the dispatch moves: (counts, row bytes, static cap) each
        send / receive          one rank's rows out; one rank's rows in -> its fields
        back_send(...)          one rank's rows of the return path, and their counts per source
        back_counts(p, s, ...)  rows source s gets back from each rank
        source_sums(...)        the source's sums from the rows it got back
        back_plan(p, per)       the return path's counts [s, d], variant and cap (accounting)
        slot_section(p)         the kept slots' section: the weight gradients come back on it
        sent_tokens(send)       the token of each row sent (the gradient rows follow them)
        recv_slot_rows(wire, K) the expert-major row of each received row's slots
        kept_slots(res_s, d)    rank s's kept slots on d in the order they were sent
    """

    # --- the plan --------------------------------------------------------------------------

    def plan(self, group: Group, words: np.ndarray, token_rows: Optional[np.ndarray] = None,
             single: Optional[np.ndarray] = None) -> Plan:
        """Derive the plan from the gathered count words int64 [R, E + R] (``count_words``).

        ``token_rows`` [R, R] int64: the second all-gather's result (layout.token_rows, row s
        from rank s), which a dedup run supplies when capacity dropped something; ``single``
        [R, R] int64: each rank's single-slot token rows (accounting only). Without them a
        dedup plan is ``exact=False`` where they matter (Plan's docstring)."""
        R, E, L = group.num_ranks, group.num_experts, group.num_local_experts
        counts, tokens_per_rank = words[:, :E], words[:, E:]
        kept = kept_counts(counts, group.capacity)
        dropped = bool((kept != counts).any())
        kept_to = kept.reshape(R, R, L).sum(axis=2)          # kept slots s -> d
        slot_cap = cap = None
        if is_static(group.exchange):
            slot_cap = group.max_tokens_per_rank * min(group.topk, L)
            cap = min(group.max_tokens_per_rank, slot_cap)   # a token row needs a kept slot
        return self.plan_of(group, counts, kept, tokens_per_rank, kept_to, dropped, cap, slot_cap,
                            token_rows, single)

    def wire_plan(self, group: Group, idx: Sequence[np.ndarray], kept: Sequence[np.ndarray],
                  words: Optional[np.ndarray] = None) -> Plan:
        """The plan a run derives from the whole group's routing and kept masks: the count
        words (``words`` when the caller counted them already), and what ``exact_counts``
        adds."""
        if words is None:
            words = count_words(idx, group.num_ranks, group.num_experts)
        return self.plan(group, words, *self.exact_counts(group, idx, kept))

    def exact_counts(self, group: Group, idx, kept) -> tuple:
        """``(token_rows, single)`` for ``plan`` (None, None: the count words suffice)."""
        return None, None

    # --- dispatch --------------------------------------------------------------------------

    def dispatch(self, group: Group, xs, idx, ws, kept, rank_major: bool):
        """Dispatch through this transport and ``group.exchange`` (inputs validated)."""
        R, L = group.num_ranks, group.num_local_experts
        p = self.wire_plan(group, idx, kept)
        rows, scales = wire_rows(xs, group.payload)
        sends, bufs = zip(*[self.send(group, s, rows[s], None if scales is None else scales[s],
                                      idx[s], ws[s], kept[s]) for s in range(R)])
        received, moved = [], np.zeros((R, R), np.int64)
        for i, (counts, _, cap) in enumerate(self.sections(group, p)):   # one exchange a section
            got, bytes_moved = exchange_rows([b[i] for b in bufs], counts, p.variant, cap)
            received.append(got)
            moved += bytes_moved
        results = []
        for d in range(R):
            fields, recv_map, rm = self.receive(group, d, [got[d] for got in received], p)
            if rank_major:      # the rows' own rank-major buffer, else computed (rankmajor.py)
                fields.update(rm if rm is not None else
                              rank_major_fields(group, d, rows, scales, idx, ws, kept))
            fields["dropped_per_expert"] = (p.counts[:, d * L:(d + 1) * L].sum(axis=0)
                                            - fields["tokens_per_expert"])
            results.append(group.result(d, topk_idx=idx[d], topk_weights=ws[d], kept=kept[d],
                                        bytes_sent=moved[d], wire=Wire(p, sends[d], recv_map),
                                        **fields))
        return results

    # --- the return path: combine and dispatch backward ---------------------------------------

    def reduce_back(self, res, ys: List[np.ndarray], weighted: bool):
        """Combine (``ys`` = expert_y) or dispatch backward (``ys`` = gradients, unweighted)
        through this transport.

        Returns (R float32 arrays [T_s, H] before the cast, moved [R, R] int64 bytes).
        """
        group = res[0].group
        R, H = group.num_ranks, group.hidden
        p = res[0].wire.plan
        dtype = ys[0].dtype
        per = back_per(dtype.itemsize)
        bufs, units = zip(*[self.back_send(res[d], ys[d], weighted, per) for d in range(R)])
        _, variant, cap = self.back_plan(p, per)
        received, moved = exchange_rows([rows_of(b) for b in bufs],
                                        np.array(units, np.int64).reshape(R, R), variant, cap)
        G = group.ranks_per_node        # the summation order's nodes (arith.grouped_total_sum)
        outs = []
        for s in range(R):
            start = np.concatenate([[0], np.cumsum(self.back_counts(res[s], s, p, per))])
            got = [received[s][start[d]:start[d + 1]].copy().view(dtype).reshape(-1, H)
                   for d in range(R)]
            outs.append(self.source_sums(res[s], got, weighted, per, G))
        return outs, moved

    # --- combine backward ------------------------------------------------------------------

    def combine_backward(self, res, grad_outs: List[np.ndarray], ys: List[np.ndarray],
                         weighted: bool):
        """Combine backward through this transport.

        Returns (gys: R arrays [M_d, H] in y's dtype, gws: R arrays [T_s, K] float32, moved:
        list of the [R, R] byte matrices of each exchange run: the gradient rows, then
        (weighted, K > 0) the weight gradients; ``combine_backward_bytes_of`` says the same
        without moving).
        """
        group = res[0].group
        R, K, H = group.num_ranks, group.topk, group.hidden
        p = res[0].wire.plan
        bufs = []
        for s in range(R):                              # gradient rows out, like a dispatch
            send, g = res[s].wire.send, grad_outs[s]
            rows = [g[t] for d in range(R) for t in self.sent_tokens(send[d])]
            bufs.append(rows_of(np.array(rows, g.dtype).reshape(len(rows), H)))
        received, moved = exchange_rows(bufs, p.rows, p.variant, p.cap)
        gys, back = [], []
        for d in range(R):
            wire, y, c = res[d].wire, ys[d], res[d].row_weight
            g = received[d].copy().view(grad_outs[0].dtype).reshape(len(received[d]), H)
            gy = np.zeros(y.shape, y.dtype)
            gw = []                                     # one float32 per kept slot, slot-row order
            for n, ms in enumerate(self.recv_slot_rows(wire, K)):
                for m in ms:                            # k ascending, as the slot rows came
                    if m >= 0:
                        gy[m] = scaled(c[m] if weighted else 1, g[n], y.dtype)
                        gw.append(weight_grad_dot(g[n], y[m]) if weighted else 0)
            gys.append(gy)
            back.append(rows_of(np.array(gw, FLOAT32).reshape(len(gw), 1)))
        gws = [np.zeros((r.source.num_tokens, K), FLOAT32) for r in res]
        if not weighted or K == 0:
            return gys, gws, [moved]
        counts, cap = self.slot_section(p)
        received, moved_back = exchange_rows(back, counts.T, p.variant, cap)
        for s in range(R):
            start = np.concatenate([[0], np.cumsum(counts.T[:, s])])
            for d in range(R):
                vals = received[s][start[d]:start[d + 1]].copy().view(FLOAT32).reshape(-1)
                for v, (t, k) in zip(vals, self.kept_slots(res[s], d), strict=True):
                    gws[s][t, k] = v
        return gys, gws, [moved, moved_back]

    # --- byte accounting -------------------------------------------------------------------

    def dispatch_bytes_of(self, group: Group, p: Plan) -> np.ndarray:
        """The dispatch's [R, R] byte matrix for a plan: every section's exchange, padding and
        in-band header rows included."""
        return sum(exchange_bytes(counts, row_bytes, p.variant, cap)
                   for counts, row_bytes, cap in self.sections(group, p))

    def combine_bytes_of(self, group: Group, p: Plan) -> np.ndarray:
        """The combine's [R, R] byte matrix for a plan (``group.x_dtype`` = expert_y's dtype):
        rows of ``H * itemsize(y)`` bytes, counts, variant and cap from ``back_plan`` (an upper
        bound for an ``exact=False`` plan)."""
        row_bytes = group.hidden * group.x_dtype.itemsize
        counts, variant, cap = self.back_plan(p, back_per(group.x_dtype.itemsize))
        return exchange_bytes(counts.T, row_bytes, variant, cap)

    def combine_backward_bytes_of(self, group: Group, p: Plan, weighted: bool) -> List[np.ndarray]:
        """The combine backward's [R, R] byte matrices for a plan, one per exchange, as
        ``combine_backward`` moves them (``group.x_dtype`` = the gradient's dtype): the
        gradient rows forward, ``H * itemsize`` bytes per row of the dispatch's first section
        (pairs' rows, dedup's token rows); then, when weighted and K > 0, the weight gradients
        back, 4 bytes per kept slot along the slot section (pairs' rows, dedup's slot rows)
        with its cap."""
        row_bytes = group.hidden * group.x_dtype.itemsize
        out = [exchange_bytes(p.rows, row_bytes, p.variant, p.cap)]
        if weighted and group.topk > 0:
            counts, cap = self.slot_section(p)
            out.append(exchange_bytes(counts.T, FLOAT32.itemsize, p.variant, cap))
        return out
