"""The pairs transport: one row per kept slot, the simplest wire format.

One section: a row per kept slot (t, k) of source s on rank d, ordered by local expert j, then
t: ``payload | int32 t | int32 k | int32 j | float32 w`` (P + 16 bytes). The return path returns
every kept slot's row in the order it came; the combine backward sends a gradient row per kept
slot and takes a weight gradient back per row. The plan, the exchanges and the byte
accounting are direct.py's (the rules pairs shares with dedup).
"""

from __future__ import annotations

import struct
from typing import List, Tuple

import numpy as np

from ..abi import PAIRS_META_BYTES
from ..arith import grouped_total_sum, partial_sum
from ..dtypes import FLOAT32
from ..exchange import resolve
from ..expertmajor import assemble
from ..records import Group
from .base import as_rows, payload, unpayload
from .direct import Direct, Plan


class Pairs(Direct):
    """pairs: a row per kept slot; the rows are the kept slots (``Wire.send``: ``(t, k)``)."""

    name = "pairs"

    def plan_of(self, group: Group, counts, kept, tokens_per_rank, kept_to, dropped, cap,
                slot_cap, token_rows, single) -> Plan:
        """One section: the kept slots s -> d, with the slot rows' static chunk."""
        return Plan(counts, kept, tokens_per_rank, kept_to, resolve(group.exchange, kept_to),
                    slot_cap, dropped=dropped)

    def sections(self, group: Group, p: Plan):
        return [(p.rows, group.payload_bytes + PAIRS_META_BYTES, p.cap)]

    def slot_section(self, p: Plan):
        return p.rows, p.cap

    def send(self, group: Group, s, rows, scales, idx, ws, kept):
        """Rank s's rows, peer d ascending; per peer by local expert j, then t."""
        L = group.num_local_experts
        send, out = [], []
        for d in range(group.num_ranks):
            slots = sorted((int(idx[t, k]) - d * L, t, k) for t in range(idx.shape[0])
                           for k in range(idx.shape[1]) if kept[t, k] and int(idx[t, k]) // L == d)
            send.append([(t, k) for _, t, k in slots])
            out += [payload(group, rows, scales, t) + struct.pack("<iiif", t, k, j, ws[t, k])
                    for j, t, k in slots]
        return send, [as_rows(out, group.payload_bytes + PAIRS_META_BYTES)]

    def receive(self, group: Group, d: int, got_sections, p: Plan):
        """Received rows (s ascending; within s by j, then t) -> expert-major fields. No
        rank-major buffer travels (None: rankmajor.py computes it)."""
        got = got_sections[0]
        R, L = group.num_ranks, group.num_local_experts
        start = np.concatenate([[0], np.cumsum(p.rows[:, d])])
        segments, which = [[] for _ in range(L)], [[] for _ in range(L)]
        for j in range(L):
            for s in range(R):
                first = start[s] + p.kept[s, d * L:d * L + j].sum()
                for i in range(first, first + p.kept[s, d * L + j]):
                    x, scale = unpayload(group, got[i])
                    t, k, jj, w = struct.unpack("<iiif", got[i, group.payload_bytes:].tobytes())
                    assert jj == j, "pairs rows arrive grouped by local expert"
                    segments[j].append((x, scale, s, t, k, np.float32(w)))
                    which[j].append(i)
        fields, positions = assemble(group, segments)
        recv_map = np.full(got.shape[0], -1, np.int64)
        for j in range(L):
            recv_map[which[j]] = positions[j]
        return fields, recv_map, None

    # --- the return path ----------------------------------------------------------------------

    def back_plan(self, p: Plan, per: int):
        """Every kept slot's row comes back: the dispatch's counts, variant and cap."""
        return p.rows, p.variant, p.cap

    def back_send(self, res_d, y: np.ndarray, weighted: bool, per: int):
        """Rank d returns each kept slot's row in the order it came."""
        return y[res_d.wire.recv_map], res_d.wire.plan.rows[:, res_d.rank]

    def back_counts(self, res_s, s: int, p: Plan, per: int):
        return p.rows.T[:, s]

    def source_sums(self, res_s, got: List[np.ndarray], weighted: bool, per: int, G: int):
        """Per token, the two-level sum (arith.py) of its rows from every rank."""
        send, T = res_s.wire.send, res_s.source.num_tokens
        K, H = res_s.group.topk, res_s.group.hidden
        w, R = res_s.source.topk_weights, len(got)
        where = {(d, t, k): got[d][i] for d in range(R) for i, (t, k) in enumerate(send[d])}
        out = np.zeros((T, H), FLOAT32)
        for t in range(T):
            out[t] = grouped_total_sum(
                [(d, partial_sum([(w[t, k] if weighted else 1, where[d, t, k])
                                  for k in range(K) if (d, t, k) in where], H))
                 for d in range(R)], G, H)
        return out

    # --- combine backward ------------------------------------------------------------------

    def sent_tokens(self, send_d) -> List[int]:
        return [t for t, _ in send_d]

    def recv_slot_rows(self, wire, K: int) -> np.ndarray:
        """One slot a row."""
        return wire.recv_map.reshape(len(wire.recv_map), 1)

    def kept_slots(self, res_s, d: int) -> List[Tuple[int, int]]:
        """The rows themselves, in the order sent."""
        return list(res_s.wire.send[d])


PAIRS = Pairs()
