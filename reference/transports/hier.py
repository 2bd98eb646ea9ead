"""The hier transport: node-aware dispatch and combine, carried out for real, byte for byte.

Nodes: ``G = ranks_per_node`` (a divisor of R) consecutive ranks make a node; rank r is on node
``r // G`` with local index ``r % G``; ``N = R / G`` nodes, ``G * L`` experts each. A token row
crosses the node boundary at most once per destination node, to the *forwarder*: the rank of
that node with the source's local index, ``f(s, n) = n * G + s % G`` (on the source's own node
that is the source itself, a local copy). So stage 1 is an exchange inside each *inter-node
subgroup* ``{i, G + i, 2G + i, ...}`` (the ranks of one local index), stage 2 one inside each
node. Each stage moves two sections, each an exchange of its own rows (exchange.py), rows raw
little-endian bytes (``P``: the payload, as for pairs and dedup):

    stage 1, s -> f(s, n), inter-node:
        token rows: one per token t of s with at least one *kept* slot on node n, t ascending:
            payload | int32 t | int32 n                           (P + 8: dedup's token row)
            n = t's kept slots on node n
        slot rows: one per kept slot on node n, token order then k ascending:
            int32 (k << 24 | j) | float32 w                       (8: dedup's slot row)
            j = the expert's id on the node, e - n * G * L (so G * L < 2**24)
    stage 2, f -> d on f's node, intra-node: for every stage-1 token (s, t) that f received, in
    the order received (s ascending, then t), and every rank d of the node holding at least one
    of its kept slots:
        token rows: payload | int32 s | int32 t | int32 n         (P + 12)
            n = t's kept slots on d
        slot rows: int32 (k << 24 | j) | float32 w, k ascending   (8), j the local expert on d

The destination rebuilds its expert-major rows from the stage-2 rows alone (each token row's
n claims the next n slot rows; the rows name (s, t), so the order of arrival does not matter).

The return path (combine, dispatch backward) runs the two stages backwards. Rows of the return path
are ``H * itemsize(y)`` bytes (y: expert_y, or the gradient rows); ``per = 4 / itemsize(y)`` of
them (1 for float32, 2 for bfloat16) hold one float32 [H] partial sum. For every stage-2 token
row with ``n`` kept slots, d returns the n expert rows themselves, k ascending, when ``n <= per``
(not wider than a float32 partial), else the float32 partial ``P_d(t)`` (``per`` rows); likewise f
returns per stage-1 token row with ``n`` kept slots on its node the n rows, k ascending, when
``n <= per``, else the float32 *node partial* ``N_n(t)``, which f forms from the returns of its
node's ranks. Every partial is the spec's (arith.py): ``P_d(t)`` over the slots on d, k
ascending; ``N_n(t) = +0.0 + P_d + ...`` over the node's ranks ascending; the source adds
``out(t) = +0.0 + N_0 + N_1 + ...`` over the nodes ascending (``arith.grouped_total_sum``), so
hier gives the same bits as pairs and dedup with the same ``ranks_per_node``. Rows per token
row on the return path: ``min(n, per)``, never more than pairs' n rows.

Combine backward sends the gradient row of each token forward like a dispatch (stage 1: one
per stage-1 token row, stage 2: one per stage-2 token row; no meta: the layout is the
dispatch's) and, when weighted, the weight gradients back over both stages as one float32 (a
4-byte row) per kept slot, in slot-row order.

The plan (``plan``): the count exchange does not hold hier's counts (tokens with a kept slot
per node need each source's kept mask, known after capacity). Each rank contributes its own
row of ``NodeCounts`` (tokens with at least one / two kept slots per rank and per node, kept
slots per rank); with every rank's rows (in production: a second all-gather of ``2 (R + N)``
words a rank) every rank derives every stage's counts and the exchange variant, decided once
over every section of both stages and of the return path (equal only when all are uniform).
Static chunks (rows): stage 1 token rows ``max_tokens_per_rank``, slot rows
``max_tokens_per_rank * min(K, G L)``; stage 2 token rows ``N * max_tokens_per_rank``, slot
rows ``N * max_tokens_per_rank * min(K, L)``; the return path ``min(K, G L, per)`` resp.
``N * min(K, L, per)`` times ``max_tokens_per_rank``; the weight gradients the slot rows' chunks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ..abi import DEDUP_MAX_LOCAL, DEDUP_MAX_TOPK, DEDUP_TOKEN_META_BYTES, HIER_TOKEN_META_BYTES
from ..abi import SLOT_ROW_BYTES as DEDUP_SLOT_ROW_BYTES
from ..arith import partial_sum, scaled, total_sum, weight_grad_dot
from ..dtypes import FLOAT32
from ..errors import Reason, error
from ..exchange import exchange_bytes, exchange_rows, is_static, resolve
from ..expertmajor import assemble
from ..layout import kept_per_rank
from ..payloads import wire_rows
from ..rankmajor import rank_major_fields
from ..records import Group
from .base import Transport, as_rows, payload, rows_of, unpayload
from .dedup import CountWordsDedup, read_slot, slot_row
from .direct import count_words


# --- nodes and counts ------------------------------------------------------------------------

def forwarder(s: int, n: int, G: int) -> int:
    """The rank of node n that receives s's stage-1 rows: the one with s's local index."""
    return n * G + s % G


def inter_subgroups(R: int, G: int) -> List[List[int]]:
    """Stage 1's exchanges: the ranks of one local index, ascending."""
    return [list(range(i, R, G)) for i in range(G)]


def intra_subgroups(R: int, G: int) -> List[List[int]]:
    """Stage 2's exchanges: the ranks of one node, ascending."""
    return [list(range(n * G, (n + 1) * G)) for n in range(R // G)]


@dataclass(frozen=True)
class NodeCounts:
    """What each source knows from its own kept mask, one row per source rank s.

    tokens [R, R] int64: tokens of s with >= 1 kept slot on rank d; multi [R, R] int64: with
    >= 2; slots [R, R] int64: kept slots of s on d; node_tokens, node_multi [R, N] int64: the
    same per node.
    """

    tokens: np.ndarray
    multi: np.ndarray
    slots: np.ndarray
    node_tokens: np.ndarray
    node_multi: np.ndarray


def node_counts(idx: Sequence[np.ndarray], kept: Sequence[np.ndarray], R: int, E: int,
                G: int) -> NodeCounts:
    """NodeCounts from every rank's routing ``[T, K] int64`` and kept mask ``[T, K] bool``."""
    rows = []
    for s in range(R):
        n = kept_per_rank(idx[s], kept[s], R, E)             # [T, R]: t's kept slots on rank d
        node = n.reshape(n.shape[0], R // G, G).sum(axis=2)  # [T, N]: ... on node n
        rows.append(((n >= 1).sum(0), (n >= 2).sum(0), n.sum(0), (node >= 1).sum(0),
                     (node >= 2).sum(0)))
    return NodeCounts(*[np.array(col, np.int64).reshape(R, -1) for col in zip(*rows)])


def _stage1(node_matrix: np.ndarray, G: int) -> np.ndarray:
    """[R, N] per (source, node) -> [R, R] per (source, forwarder)."""
    R, N = node_matrix.shape
    out = np.zeros((R, R), np.int64)
    for s in range(R):
        for n in range(N):
            out[s, forwarder(s, n, G)] = node_matrix[s, n]
    return out


def _stage2(rank_matrix: np.ndarray, G: int) -> np.ndarray:
    """[R, R] per (source, destination) -> [R, R] per (forwarder, destination on its node):
    the forwarder f carries the rows of every source with f's local index."""
    R = rank_matrix.shape[0]
    out = np.zeros((R, R), np.int64)
    for f in range(R):
        node = range(f // G * G, f // G * G + G)
        out[f, node] = rank_matrix[f % G::G][:, node].sum(axis=0)
    return out


@dataclass(frozen=True)
class HierPlan:
    """Every rank's counts of every stage, identical on every rank ([R, R] int64, entry [a, b]:
    rows a sends b; zero outside a's subgroup of that stage).

    s1_tok, s1_slot, s1_multi: stage 1 token rows, slot rows, token rows with n >= 2;
    s2_tok, s2_slot, s2_multi: the same for stage 2; variant: the exchange that runs.
    """

    counts: NodeCounts
    s1_tok: np.ndarray
    s1_slot: np.ndarray
    s1_multi: np.ndarray
    s2_tok: np.ndarray
    s2_slot: np.ndarray
    s2_multi: np.ndarray
    variant: str

    def back_rows(self, stage: int, per: int) -> np.ndarray:
        """The return path's rows of a stage, transposed (entry [b, a]: rows b returns to a):
        ``min(n, per)`` per token row."""
        tok, multi = (self.s1_tok, self.s1_multi) if stage == 1 else (self.s2_tok, self.s2_multi)
        return (tok + (multi if per >= 2 else 0)).T


def _sections(p: HierPlan, G: int):
    """Every count matrix the plan moves with its subgroups (both stages, both ways)."""
    R = p.s1_tok.shape[0]
    inter, intra = inter_subgroups(R, G), intra_subgroups(R, G)
    return ([(m, inter) for m in (p.s1_tok, p.s1_slot, p.back_rows(1, 2))]
            + [(m, intra) for m in (p.s2_tok, p.s2_slot, p.back_rows(2, 2))])


def _resolve(variant: str, sections) -> str:
    """exchange.resolve over subgroups: every section inside every subgroup is one count
    matrix (equal needs each uniform; a refusal names the lowest global rank whose row differs
    from its subgroup section's first count)."""
    subs = [(m[np.ix_(g, g)], g) for m, groups in sections for g in groups]
    return resolve(variant, *[c for c, _ in subs], ranks=[g for _, g in subs])


def plan(group: Group, c: NodeCounts) -> HierPlan:
    """Every stage's counts from the gathered NodeCounts."""
    G = group.ranks_per_node
    parts = dict(s1_tok=_stage1(c.node_tokens, G), s1_slot=_stage1(_node_sum(c.slots, G), G),
                 s1_multi=_stage1(c.node_multi, G), s2_tok=_stage2(c.tokens, G),
                 s2_slot=_stage2(c.slots, G), s2_multi=_stage2(c.multi, G))
    p = HierPlan(c, variant="ragged", **parts)
    return HierPlan(c, variant=_resolve(group.exchange, _sections(p, G)), **parts)


def _node_sum(rank_matrix: np.ndarray, G: int) -> np.ndarray:
    """[R, R] -> [R, N]: the columns of each node summed."""
    R = rank_matrix.shape[0]
    return rank_matrix.reshape(R, R // G, G).sum(axis=2)


def caps(group: Group, per: int = 2) -> Optional[dict]:
    """The static chunks (rows) of every section (module docstring); None unless static."""
    if not is_static(group.exchange):
        return None
    T, K, L, G = group.max_tokens_per_rank, group.topk, group.num_local_experts, group.ranks_per_node
    N = group.num_ranks // G
    return {"s1_tok": T, "s1_slot": T * min(K, G * L), "s2_tok": N * T,
            "s2_slot": N * T * min(K, L), "s1_back": T * min(K, G * L, per),
            "s2_back": N * T * min(K, L, per)}


def _cap(group: Group, name: str, per: int = 2) -> Optional[int]:
    c = caps(group, per)
    return None if c is None else c[name]


# --- moving a stage ---------------------------------------------------------------------------

def stage_exchange(bufs: Sequence[np.ndarray], counts: np.ndarray, subgroups, variant: str,
                   cap: Optional[int]):
    """One stage's exchange of byte rows, run inside each subgroup (exchange.exchange_rows).

    Args: bufs: R arrays [S_r, B] uint8, rank r's rows in the order of its subgroup's ranks;
    counts [R, R]: rows a sends b (zero outside a's subgroup). Returns (received: R arrays, rows
    from the subgroup's ranks ascending; moved [R, R] int64 bytes).
    """
    R = len(bufs)
    received: List[Optional[np.ndarray]] = [None] * R
    moved = np.zeros((R, R), np.int64)
    for ranks in subgroups:
        sub = np.ix_(ranks, ranks)
        assert counts[ranks].sum() == counts[sub].sum(), "rows only inside the subgroup"
        got, m = exchange_rows([bufs[r] for r in ranks], counts[sub], variant, cap)
        for i, r in enumerate(ranks):
            received[r] = got[i]
        moved[sub] = m
    return received, moved


def stage_bytes(counts: np.ndarray, row_bytes: int, subgroups, variant: str,
                cap: Optional[int]) -> np.ndarray:
    """What ``stage_exchange`` moves ([R, R] int64 bytes), without moving anything."""
    R = counts.shape[0]
    out = np.zeros((R, R), np.int64)
    for ranks in subgroups:
        sub = np.ix_(ranks, ranks)
        out[sub] = exchange_bytes(counts[sub], row_bytes, variant, cap)
    return out


def dispatch_bytes_of(group: Group, p: HierPlan) -> List[np.ndarray]:
    """The dispatch's byte matrices, stage 1 then stage 2 ([R, R] int64 each, both sections)."""
    R, G, P = group.num_ranks, group.ranks_per_node, group.payload_bytes
    inter, intra = inter_subgroups(R, G), intra_subgroups(R, G)
    v = p.variant
    return [stage_bytes(p.s1_tok, P + DEDUP_TOKEN_META_BYTES, inter, v, _cap(group, "s1_tok"))
            + stage_bytes(p.s1_slot, DEDUP_SLOT_ROW_BYTES, inter, v, _cap(group, "s1_slot")),
            stage_bytes(p.s2_tok, P + HIER_TOKEN_META_BYTES, intra, v, _cap(group, "s2_tok"))
            + stage_bytes(p.s2_slot, DEDUP_SLOT_ROW_BYTES, intra, v, _cap(group, "s2_slot"))]


def combine_bytes_of(group: Group, p: HierPlan, y_dtype=None) -> List[np.ndarray]:
    """The combine's byte matrices, stage 2 back (intra) then stage 1 back (inter); ``y_dtype``:
    expert_y's (default x's)."""
    R, G, H = group.num_ranks, group.ranks_per_node, group.hidden
    isz = np.dtype(y_dtype or group.x_dtype).itemsize
    per = 4 // isz
    return [stage_bytes(p.back_rows(2, per), H * isz, intra_subgroups(R, G), p.variant,
                        _cap(group, "s2_back", per)),
            stage_bytes(p.back_rows(1, per), H * isz, inter_subgroups(R, G), p.variant,
                        _cap(group, "s1_back", per))]


# --- dispatch ----------------------------------------------------------------------------------

@dataclass
class HierWire:
    """What one rank keeps between the dispatch and the passes that follow.

    sent: as source, per node n, the tokens t it sent there (stage 1 order); arrivals: as
    forwarder, every stage-1 token row received, in order: ``(s, t, slots)`` with slots
    ``[(k, d, j, w)]`` k ascending; fan: per rank d of its node (d - nG), the arrivals it
    forwarded to d, in order; recv_map [N2, K] int64: as destination, the expert-major row of
    each received stage-2 token row's slot k (-1: none); moved: the dispatch's byte matrices.
    """

    plan: HierPlan
    sent: List[List[int]]
    arrivals: list
    fan: List[List[int]]
    recv_map: np.ndarray
    moved: list


def _check_encodable(group: Group, rank: int = 0) -> None:
    G, L, K = group.ranks_per_node, group.num_local_experts, group.topk
    if K > DEDUP_MAX_TOPK:
        raise error(rank, Reason.TOPK_TOO_LARGE, K, DEDUP_MAX_TOPK)
    if G * L >= DEDUP_MAX_LOCAL:
        raise ValueError(f"epkit.reference: the hier wire format needs G * L < 2**24 experts a "
                         f"node, got {G * L}")


def _stage1_send(group: Group, rows, scales, idx, ws, kept):
    """One source's stage 1: (sent [N] token lists, token rows, slot rows), node ascending."""
    G, L = group.ranks_per_node, group.num_local_experts
    sent, tok, slot = [], [], []
    for n in range(group.num_ranks // G):
        sent.append([])
        for t in range(idx.shape[0]):
            mine = [k for k in range(idx.shape[1]) if kept[t, k] and int(idx[t, k]) // (G * L) == n]
            if mine:
                sent[n].append(t)
                tok.append(payload(group, rows, scales, t) + struct.pack("<ii", t, len(mine)))
                slot += [slot_row(k, int(idx[t, k]) - n * G * L, ws[t, k]) for k in mine]
    return sent, as_rows(tok, group.payload_bytes + DEDUP_TOKEN_META_BYTES), \
        as_rows(slot, DEDUP_SLOT_ROW_BYTES)


def _forward(group: Group, f: int, got_tok, got_slot, p: HierPlan):
    """Forwarder f: decode its stage-1 rows, build its stage-2 sections (rank of its node
    ascending). Returns (arrivals, fan, payloads, token rows, slot rows)."""
    G, L, P = group.ranks_per_node, group.num_local_experts, group.payload_bytes
    base = f // G * G
    sources = np.repeat(inter_subgroups(group.num_ranks, G)[f % G], p.s1_tok[f % G::G, f])
    arrivals, payloads, cursor = [], [], 0
    for i, s in enumerate(sources):
        t, n = struct.unpack("<ii", got_tok[i, P:].tobytes())
        slots = []
        for k, jn, w in map(read_slot, got_slot[cursor:cursor + n]):
            slots.append((k, base + jn // L, jn % L, w))
        cursor += n
        arrivals.append((int(s), t, slots))
        payloads.append(got_tok[i, :P].tobytes())
    assert cursor == got_slot.shape[0], "the token rows' n claim every slot row"
    fan, tok, slot = [], [], []
    for d in range(base, base + G):
        fan.append([])
        for a, (s, t, slots) in enumerate(arrivals):
            mine = [(k, j, w) for k, dd, j, w in slots if dd == d]
            if mine:
                fan[-1].append(a)
                tok.append(payloads[a] + struct.pack("<iii", s, t, len(mine)))
                slot += [slot_row(k, j, w) for k, j, w in mine]
    return arrivals, fan, as_rows(tok, P + HIER_TOKEN_META_BYTES), \
        as_rows(slot, DEDUP_SLOT_ROW_BYTES)


def _receive(group: Group, got_tok, got_slot):
    """Destination: its stage-2 rows -> (expert-major fields, recv_map [N2, K])."""
    L, K, P = group.num_local_experts, group.topk, group.payload_bytes
    entries, cursor = [], 0
    for i in range(got_tok.shape[0]):
        s, t, n = struct.unpack("<iii", got_tok[i, P:].tobytes())
        x, scale = unpayload(group, got_tok[i])
        entries.append((s, t, x, scale, [read_slot(r) for r in got_slot[cursor:cursor + n]], i))
        cursor += n
    assert cursor == got_slot.shape[0], "the token rows' n claim every slot row"
    segments, which = [[] for _ in range(L)], [[] for _ in range(L)]
    for s, t, x, scale, slots, i in sorted(entries, key=lambda e: (e[0], e[1])):
        for k, j, w in slots:
            assert j < L and k < K, "a well-formed slot row"
            segments[j].append((x, scale, s, t, k, w))
            which[j].append((i, k))
    fields, positions = assemble(group, segments)
    recv_map = np.full((len(entries), K), -1, np.int64)
    for j in range(L):
        for (i, k), m in zip(which[j], positions[j]):
            recv_map[i, k] = m
    return fields, recv_map


def dispatch(group: Group, xs, idx, ws, kept, rank_major: bool):
    """Dispatch through the hier transport and ``group.exchange`` (inputs validated)."""
    R, E, L, G = group.num_ranks, group.num_experts, group.num_local_experts, group.ranks_per_node
    _check_encodable(group)
    p = plan(group, node_counts(idx, kept, R, E, G))
    rows, scales = wire_rows(xs, group.payload)
    inter, intra = inter_subgroups(R, G), intra_subgroups(R, G)
    out1 = [_stage1_send(group, rows[s], None if scales is None else scales[s], idx[s], ws[s],
                         kept[s]) for s in range(R)]
    tok1, m_tok1 = stage_exchange([o[1] for o in out1], p.s1_tok, inter, p.variant,
                                  _cap(group, "s1_tok"))
    slot1, m_slot1 = stage_exchange([o[2] for o in out1], p.s1_slot, inter, p.variant,
                                    _cap(group, "s1_slot"))
    out2 = [_forward(group, f, tok1[f], slot1[f], p) for f in range(R)]
    tok2, m_tok2 = stage_exchange([o[2] for o in out2], p.s2_tok, intra, p.variant,
                                  _cap(group, "s2_tok"))
    slot2, m_slot2 = stage_exchange([o[3] for o in out2], p.s2_slot, intra, p.variant,
                                    _cap(group, "s2_slot"))
    moved = [m_tok1 + m_slot1, m_tok2 + m_slot2]
    used = count_words(idx, R, E)[:, :E]
    results = []
    for d in range(R):
        fields, recv_map = _receive(group, tok2[d], slot2[d])
        if rank_major:
            fields.update(rank_major_fields(group, d, rows, scales, idx, ws, kept))
        fields["dropped_per_expert"] = used[:, d * L:(d + 1) * L].sum(axis=0) - fields["tokens_per_expert"]
        wire = HierWire(p, out1[d][0], out2[d][0], out2[d][1], recv_map, moved)
        results.append(group.result(d, topk_idx=idx[d], topk_weights=ws[d], kept=kept[d],
                                    bytes_sent=sum(moved)[d], wire=wire, **fields))
    return results


# --- the return path: combine and dispatch backward -----------------------------------------------

def _units(rows: List[np.ndarray], partial, per: int, row_dtype) -> List[np.ndarray]:
    """A token row's return: its n rows when ``n <= per``, else the float32 partial (``partial()``,
    [H] float32) as ``per`` rows of ``row_dtype``."""
    if len(rows) <= per:
        return [np.asarray(r, row_dtype) for r in rows]
    return list(np.asarray(partial(), FLOAT32).view(row_dtype).reshape(per, -1))


def _as_partial(units: List[np.ndarray]) -> np.ndarray:
    """The ``per`` received rows that hold a float32 partial -> [H] float32."""
    return np.concatenate([np.asarray(r) for r in units]).copy().view(FLOAT32)


def _split(got: np.ndarray, counts: Sequence[int], row_dtype):
    """Received rows -> one list of rows per peer of the subgroup (counts in its order)."""
    rows = got.copy().view(row_dtype)
    start = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [list(rows[start[i]:start[i + 1]]) for i in range(len(counts))]


def _back_at_rank(group, res_d, y, weighted, per):
    """Rank d's stage-2 returns: per received token row, min(n, per) rows (forwarder order)."""
    c = res_d.row_weight
    out = []
    for slot_rows in res_d.wire.recv_map:
        ms = [m for m in slot_rows if m >= 0]
        out += _units([y[m] for m in ms],
                      lambda: partial_sum([(c[m] if weighted else 1, y[m]) for m in ms], group.hidden),
                      per, y.dtype)
    return out


def _back_at_forwarder(group, wire: HierWire, f, got_rows, weighted, per, row_dtype):
    """Forwarder f: its node's returns (``got_rows``: per rank of the node, ascending) -> the
    stage-1 returns, arrival by arrival: the node's rows k ascending, or N_n(t)."""
    G, H = group.ranks_per_node, group.hidden
    per_d = [iter(rows) for rows in got_rows]
    returns: dict = {}                      # (arrival, d) -> d's rows, or its float32 partial
    for i, arrivals in enumerate(wire.fan):
        d = f // G * G + i
        for a in arrivals:
            n = sum(1 for sl in wire.arrivals[a][2] if sl[1] == d)
            got = [next(per_d[i]) for _ in range(min(n, per))]
            returns[a, d] = got if n <= per else _as_partial(got)
    out = []
    for a, (s, t, slots) in enumerate(wire.arrivals):
        ranks = sorted({sl[1] for sl in slots})
        mine = {d: [sl for sl in slots if sl[1] == d] for d in ranks}   # k ascending

        def p_d(d):                         # P_d(t): as d sent it, or from d's own rows
            got = returns[a, d]
            if not isinstance(got, list):
                return got
            return partial_sum([(sl[3] if weighted else 1, r) for sl, r in zip(mine[d], got)], H)

        raw = {sl[0]: r for d in ranks if isinstance(returns[a, d], list)
               for sl, r in zip(mine[d], returns[a, d])}
        out += _units([raw.get(sl[0]) for sl in slots],
                      lambda: total_sum([p_d(d) for d in ranks], H), per, row_dtype)
    return out


def _total_at_source(group, res_s, got_rows, weighted, per, row_dtype) -> np.ndarray:
    """Source s: the stage-1 returns per node -> out [T, H] float32 (grouped order)."""
    G, L, H = group.ranks_per_node, group.num_local_experts, group.hidden
    idx, kept, w = res_s.source.topk_idx, res_s.source.kept, res_s.source.topk_weights
    nodes: dict = {}                                        # t -> [N_n], node ascending
    for n, tokens in enumerate(res_s.wire.sent):
        rows = iter(got_rows[n])
        for t in tokens:
            mine = [k for k in range(idx.shape[1]) if kept[t, k] and idx[t, k] // (G * L) == n]
            got = [next(rows) for _ in range(min(len(mine), per))]
            if len(mine) > per:
                nodes.setdefault(t, []).append(_as_partial(got))
                continue
            by_rank: dict = {}
            for k, r in zip(mine, got):
                by_rank.setdefault(int(idx[t, k]) // L, []).append((w[t, k] if weighted else 1, r))
            nodes.setdefault(t, []).append(
                total_sum([partial_sum(terms, H) for _, terms in sorted(by_rank.items())], H))
    out = np.zeros((res_s.source.num_tokens, H), FLOAT32)
    for t, parts in nodes.items():
        out[t] = total_sum(parts, H)
    return out


def reduce_back(res, ys: List[np.ndarray], weighted: bool):
    """Combine (``ys`` = expert_y) or dispatch backward (``ys`` = gradients, unweighted) back
    over both stages. Returns (R float32 arrays [T_s, H] before the cast, [stage 2 back,
    stage 1 back] [R, R] int64 bytes)."""
    group = res[0].group
    R, G = group.num_ranks, group.ranks_per_node
    p, row_dtype = res[0].wire.plan, ys[0].dtype
    per = 4 // row_dtype.itemsize
    inter, intra = inter_subgroups(R, G), intra_subgroups(R, G)
    back2 = p.back_rows(2, per)
    bufs = [rows_of(np.array(_back_at_rank(group, res[d], ys[d], weighted, per), row_dtype)
                     .reshape(-1, group.hidden)) for d in range(R)]
    got2, moved2 = stage_exchange(bufs, back2, intra, p.variant, _cap(group, "s2_back", per))
    bufs = []
    for f in range(R):
        node = intra[f // G]
        rows = _split(got2[f], back2[node, f], row_dtype)
        out = _back_at_forwarder(group, res[f].wire, f, rows, weighted, per, row_dtype)
        bufs.append(rows_of(np.array(out, row_dtype).reshape(-1, group.hidden)))
    back1 = p.back_rows(1, per)
    got1, moved1 = stage_exchange(bufs, back1, inter, p.variant, _cap(group, "s1_back", per))
    outs = []
    for s in range(R):
        peers = inter[s % G]
        rows = _split(got1[s], back1[peers, s], row_dtype)
        outs.append(_total_at_source(group, res[s], rows, weighted, per, row_dtype))
    return outs, [moved2, moved1]


# --- combine backward ---------------------------------------------------------------------------

def _grads_forward(group, res, grad_outs):
    """The gradient rows out over both stages, like the dispatch's token rows (no meta).
    Returns (per rank d, the gradient row of each received stage-2 token row; moved)."""
    R, G, H = group.num_ranks, group.ranks_per_node, group.hidden
    p, dt = res[0].wire.plan, grad_outs[0].dtype
    inter, intra = inter_subgroups(R, G), intra_subgroups(R, G)
    bufs = [rows_of(np.array([grad_outs[s][t] for tokens in res[s].wire.sent for t in tokens],
                              dt).reshape(-1, H)) for s in range(R)]
    got1, moved1 = stage_exchange(bufs, p.s1_tok, inter, p.variant, _cap(group, "s1_tok"))
    bufs = []
    for f in range(R):
        g = got1[f].copy().view(dt)                     # one row per arrival, in order
        bufs.append(rows_of(np.array([g[a] for fan in res[f].wire.fan for a in fan], dt)
                             .reshape(-1, H)))
    got2, moved2 = stage_exchange(bufs, p.s2_tok, intra, p.variant, _cap(group, "s2_tok"))
    return [g.copy().view(dt) for g in got2], [moved1, moved2]


def _wgrads_back(group, res, gw_rows):
    """Weight gradients back over both stages, one float32 per kept slot in slot-row order.
    ``gw_rows``: per rank d, per received stage-2 token row, its slots' values k ascending.
    Returns (gws: R arrays [T_s, K] float32, moved)."""
    R, G, K, L = group.num_ranks, group.ranks_per_node, group.topk, group.num_local_experts
    p = res[0].wire.plan
    inter, intra = inter_subgroups(R, G), intra_subgroups(R, G)
    bufs = [rows_of(np.array([v for row in gw_rows[d] for v in row], FLOAT32).reshape(-1, 1))
            for d in range(R)]
    got2, moved2 = stage_exchange(bufs, p.s2_slot.T, intra, p.variant, _cap(group, "s2_slot"))
    bufs = []
    for f in range(R):
        wire = res[f].wire
        per_d = [iter(v) for v in _split(got2[f], p.s2_slot[f, intra[f // G]], FLOAT32)]
        got = {}
        for i, fan in enumerate(wire.fan):
            d = f // G * G + i
            for a in fan:
                for sl in wire.arrivals[a][2]:
                    if sl[1] == d:
                        got[a, sl[0]] = next(per_d[i])
        bufs.append(rows_of(np.array([got[a, sl[0]] for a, (_, _, slots) in enumerate(wire.arrivals)
                                       for sl in slots], FLOAT32).reshape(-1, 1)))
    got1, moved1 = stage_exchange(bufs, p.s1_slot.T, inter, p.variant, _cap(group, "s1_slot"))
    gws = []
    for s in range(R):
        r = res[s]
        gw = np.zeros((r.source.num_tokens, K), FLOAT32)
        vals = iter(got1[s].copy().view(FLOAT32).reshape(-1))
        for n, tokens in enumerate(r.wire.sent):        # forwarders in node order, as sent
            for t in tokens:
                for k in range(K):
                    if r.source.kept[t, k] and r.source.topk_idx[t, k] // (G * L) == n:
                        gw[t, k] = next(vals)
        gws.append(gw)
    return gws, [moved2, moved1]


def combine_backward(res, grad_outs: List[np.ndarray], ys: List[np.ndarray], weighted: bool):
    """Combine backward through hier. Returns (gys: R arrays [M_d, H] in y's dtype, gws: R
    arrays [T_s, K] float32, moved: the [R, R] byte matrices of each exchange run)."""
    group = res[0].group
    K = group.topk
    grads, moved = _grads_forward(group, res, grad_outs)
    gys, gw_rows = [], []
    for d in range(group.num_ranks):
        y, c = ys[d], res[d].row_weight
        gy = np.zeros(y.shape, y.dtype)
        rows = []
        for g, slot_rows in zip(grads[d], res[d].wire.recv_map):
            ms = [m for m in slot_rows if m >= 0]       # k ascending: slot-row order
            for m in ms:
                gy[m] = scaled(c[m] if weighted else 1, g, y.dtype)
            rows.append([weight_grad_dot(g, y[m]) for m in ms])
        gys.append(gy)
        gw_rows.append(rows)
    if not weighted or K == 0:
        return gys, [np.zeros((r.source.num_tokens, K), FLOAT32) for r in res], moved
    gws, moved_back = _wgrads_back(group, res, gw_rows)
    return gys, gws, moved + moved_back


class Hier(Transport):
    """The hier transport behind the interface of transports/base.py (the functions above)."""

    name = "hier"
    # dispatch_bytes / combine_bytes know the one-stage transports (docs/semantics.md): under
    # hier they give dedup's plan from the count words alone; its stages' bytes are
    # dispatch_bytes_of / combine_bytes_of here.
    accounting = CountWordsDedup()

    def wire_plan(self, group: Group, idx, kept, words=None) -> HierPlan:
        return plan(group, node_counts(idx, kept, group.num_ranks, group.num_experts,
                                       group.ranks_per_node))

    def dispatch_bytes_of(self, group: Group, p: HierPlan) -> List[np.ndarray]:
        return dispatch_bytes_of(group, p)

    def combine_bytes_of(self, group: Group, p: HierPlan, y_dtype=None) -> List[np.ndarray]:
        return combine_bytes_of(group, p, y_dtype)

    def dispatch(self, group: Group, xs, idx, ws, kept, rank_major: bool):
        return dispatch(group, xs, idx, ws, kept, rank_major)

    def reduce_back(self, res, ys: List[np.ndarray], weighted: bool):
        return reduce_back(res, ys, weighted)

    def combine_backward(self, res, grad_outs: List[np.ndarray], ys: List[np.ndarray],
                         weighted: bool):
        return combine_backward(res, grad_outs, ys, weighted)


HIER = Hier()
