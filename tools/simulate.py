"""``epkit simulate``: the reference as a traffic planner for groups far larger than one machine.

No process group and no token payload: for ``R`` ranks (up to 1024 and beyond), ``E`` experts,
top-``K``, ``T`` tokens per rank and a routing distribution, it draws the routing rank block by
rank block, keeps only the count words every rank would all-gather
(``[tokens_per_expert (E) | tokens_per_rank (R)]``, exactly ``reference.transports.count_words``)
and, per source rank, ``reference.transports.hier.NodeCounts`` (kept token rows, token rows with
two or more kept slots and kept slots, per rank and per node: what dedup's exact plan and hier's
two stages need), counted by the reference's own rules (``reference.capacity.kept_counts`` for
the kept slots, ``reference.fast.count_words_block`` of the kept routing for the token rows), and
hands them to the reference's plans and byte accounting (``reference.accounting.plan``,
``dispatch_bytes_of``, ``combine_bytes_of``, the functions behind
``epkit.reference.dispatch_bytes`` / ``combine_bytes``; ``reference.transports.hier.plan`` and
its ``dispatch_bytes_of`` / ``combine_bytes_of`` for hier). Every transport is one row of
:data:`TABLE`: its plan, its byte matrices per stage, and its stages (which peers each stage
runs among, and the sections whose messages it sends). It prints, per transport and pass, the
messages and bytes each rank sends, expert load imbalance, the slots a capacity factor drops,
and a predicted time from the link model below.

Routing (every token names ``K`` distinct experts):
    uniform   every expert alike
    zipf      expert of popularity rank ``i`` (1-based) has weight ``i ** -skew``; popularity
              ranks are a seeded random permutation of the experts (placement is not sorted by
              load); ``K`` experts drawn one after another without replacement, each in
              proportion to the weights of those not yet taken
    hot       one hot expert (``--hot-expert``) is named by a fraction ``--hot-fraction`` of the
              tokens; every other slot is uniform over the other experts
    grouped   node-limited (DeepSeek-V3 style): a node is ``--ranks-per-node`` ranks, so
              ``E * ranks_per_node / R`` experts; each token draws ``M = --nodes-per-token``
              distinct nodes uniformly without replacement, then its ``K`` experts uniformly
              without replacement among the ``M * E * ranks_per_node / R`` experts of those
              nodes (so a token reaches at most ``M`` nodes; a drawn node may get none of the K,
              as when DeepSeek-V3 picks its nodes before its experts)

Bytes, split by tier: a pair ``s -> d`` is intra-node when ``s // ranks_per_node == d //
ranks_per_node``, else inter-node. The diagonal ``s == d`` (a local copy) is excluded from
``total_bytes``, ``intra_node_bytes`` and ``inter_node_bytes`` alike, so
``intra_node_bytes + inter_node_bytes == total_bytes`` (whole group, per transport and pass).

Link model (documented in docs/benchmarks.md, with the sources of its defaults): ranks sit
``--ranks-per-node`` to a node. Each rank has an intra-node link (``--intra-gbps``, GB/s each
way, full duplex; ``--intra-us`` per message) and an inter-node link (``--inter-gbps``,
``--inter-us``), used at the same time. A message is one section of one exchange between one
pair of ranks (pairs: one section; dedup's dispatch: two, token rows then slot rows; hier: two
in each dispatch stage); a ragged exchange sends a message to each peer it has rows for, a
padded one to every peer of its stage. For an exchange with byte matrix ``B[s, d]`` and message
matrix ``M[s, d]`` (the diagonal, a local copy, costs nothing), rank ``r`` needs on each tier
``t_tier_r = max(M_out * alpha + B_out / beta, M_in * alpha + B_in / beta)`` (that tier's
messages and bytes out of and into ``r``); the tiers run concurrently, so
``t_r = max(t_intra_r, t_inter_r)``, and the exchange ends with the slowest rank:
``t = latency + max_r t_r`` (``--latency-us``, a fixed cost per exchange stage, 0 by default).
The report gives each tier's own time (``intra_ms``, ``inter_ms``) and the messages' alpha
alone (``message_ms``). A pass of several stages that depend on each other (hier: the
inter-node stage, then the intra-node one) costs the sum of its stages' times (no pipelining
between the stages is modelled). An all-to-all's duration under ideal scheduling, the messages
of a rank one after another; congestion and incast are not modelled.

Heatmaps (every run draws one, epkit-simulate.png in the working folder or ``--plot PATH``; the
path is printed; ``--no-plot`` skips it): up to 128 ranks, the dispatch bytes rank by rank; past that, node by
node beside one node rank by rank. hier's two stages are drawn one panel each (stage 1
inter-node, stage 2 intra-node).

Capacity: ``--capacity-factor F`` sets ``C = ceil(F * R * T * K / E)`` slots per expert,
group-wide (epkit's capacity: the first ``C`` slots in (source rank, token) order are kept).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from epkit.reference.accounting import combine_bytes_of, dispatch_bytes_of, plan
from epkit.reference.capacity import kept_counts, sorted_slots
from epkit.reference.dtypes import FLOAT_DTYPES
from epkit.reference.exchange import VARIANTS
from epkit.reference.fast import count_words_block
from epkit.reference.records import Group
from epkit.reference.transports import hier

ROUTINGS = ("uniform", "zipf", "hot", "grouped")
# the link model's defaults (sources in docs/benchmarks.md, "The link model")
INTRA_GBPS = 450.0   # NVLink 4 (H100 / H200): 900 GB/s per GPU both ways
INTER_GBPS = 50.0    # ConnectX-7 NDR InfiniBand: 400 Gb/s per port, one port a GPU
INTRA_US = 1.5       # one intra-node message (NVLink), microseconds
INTER_US = 3.0       # one inter-node RDMA message, microseconds
_MAX_SLOTS_PER_BLOCK = 1 << 22  # routing drawn at most ~4M slots at a time (memory bound)


# ---- routing -------------------------------------------------------------------------------

def expert_weights(E: int, routing: str, skew: float, rng: np.random.Generator,
                   hot_expert: int = 0) -> Optional[np.ndarray]:
    """Sampling weights over experts (``None`` = uniform). ``hot``: uniform over the others."""
    if routing == "uniform":
        return None
    if routing == "zipf":
        w = np.arange(1, E + 1, dtype=np.float64) ** -float(skew)
        return w[rng.permutation(E)]
    if routing == "hot":
        w = np.ones(E)
        w[hot_expert] = 0.0
        return w
    if routing == "grouped":
        return None
    raise ValueError(f"epkit simulate: routing must be one of {ROUTINGS}, got {routing!r}")


def _draw_excluding(rng, chosen: np.ndarray, w: np.ndarray, cdf: np.ndarray) -> np.ndarray:
    """One expert per row, in proportion to ``w`` over the experts not in that row of
    ``chosen [n, k]``: a uniform point on the remaining mass, mapped onto the full cumulative
    weights by stepping over the taken experts' intervals in ascending order."""
    n, k = chosen.shape
    taken = np.sort(chosen, axis=1)
    x = rng.random(n) * (cdf[-1] - w[chosen].sum(axis=1))
    start = cdf - w
    for i in range(k):
        c = taken[:, i]
        x += np.where(start[c] <= x, w[c], 0.0)
    return np.minimum(np.searchsorted(cdf, x, side="right"), len(w) - 1)


def sample_topk(rng: np.random.Generator, n: int, E: int, K: int,
                weights: Optional[np.ndarray] = None, max_rounds: int = 64) -> np.ndarray:
    """``[n, K]`` int64, distinct experts per row, drawn by successive sampling without
    replacement: expert ``k`` of a row follows the weights of the experts the row has not
    taken yet. Uniform: column ``k`` is redrawn where it repeats an earlier column (rare when
    ``K << E``). Weighted: drawn directly from the remaining weights (:func:`_draw_excluding`);
    any row that rounding still lets collide is redrawn."""
    w = None if weights is None else np.asarray(weights, np.float64)
    avail = E if w is None else int((w > 0).sum())
    if K > avail:
        raise ValueError(f"epkit simulate: top-{K} needs {K} experts with weight > 0, have {avail}")
    cdf = None if w is None else np.cumsum(w)
    idx = np.empty((n, K), np.int64)

    def draw(rows):
        if w is None:
            return rng.integers(0, E, len(rows), dtype=np.int64)
        return _draw_excluding(rng, idx[rows, :k], w, cdf)

    for k in range(K):
        todo = np.arange(n)
        col = np.empty(n, np.int64)
        for _ in range(max_rounds):
            col[todo] = draw(todo)
            todo = todo[(idx[todo, :k] == col[todo, None]).any(axis=1)]
            if not len(todo):
                break
        for i in todo:  # never reached in practice
            p = np.ones(E) if w is None else w.copy()
            p[idx[i, :k]] = 0.0
            col[i] = rng.choice(E, p=p / p.sum())
        idx[:, k] = col
    return idx


def sample_grouped(rng: np.random.Generator, n: int, E: int, K: int, nodes: int,
                   nodes_per_token: int) -> np.ndarray:
    """Node-limited routing ``[n, K]`` int64 (module docstring, ``grouped``): ``nodes_per_token``
    distinct nodes of ``nodes`` uniformly, then ``K`` distinct experts uniformly among theirs.
    Node ``m`` holds experts ``m * E / nodes`` to ``(m + 1) * E / nodes - 1``."""
    per_node = E // nodes
    if not 1 <= nodes_per_token <= nodes or K > nodes_per_token * per_node:
        raise ValueError(f"epkit simulate: grouped routing needs 1 <= nodes-per-token <= {nodes} "
                         f"and top-{K} <= nodes-per-token * {per_node} experts per node")
    chosen = sample_topk(rng, n, nodes, nodes_per_token)           # [n, M] distinct nodes
    pick = sample_topk(rng, n, nodes_per_token * per_node, K)      # [n, K] into their experts
    return chosen[np.arange(n)[:, None], pick // per_node] * per_node + pick % per_node


def sample_routing(rng: np.random.Generator, n: int, E: int, K: int, routing: str,
                   weights: Optional[np.ndarray], hot_expert: int = 0,
                   hot_fraction: float = 0.5, nodes: int = 1,
                   nodes_per_token: int = 1) -> np.ndarray:
    """``n`` tokens' routing ``[n, K]`` under ``routing`` (``weights``: :func:`expert_weights`;
    ``nodes``, ``nodes_per_token``: the grouped routing's)."""
    if routing == "grouped":
        return sample_grouped(rng, n, E, K, nodes, nodes_per_token)
    idx = sample_topk(rng, n, E, K, weights)
    if routing == "hot":
        idx[rng.random(n) < hot_fraction, 0] = hot_expert
    return idx


# ---- count words ---------------------------------------------------------------------------

def draw_count_words(R: int, E: int, K: int, T: int, routing: str = "uniform", skew: float = 1.2,
                     hot_expert: int = 0, hot_fraction: float = 0.5, seed: int = 0,
                     ranks_per_node: int = 1, nodes_per_token: int = 1) -> np.ndarray:
    """Draw the whole group's routing rank block by rank block; keep only its count words
    ``int64 [R, E + R]`` (the routing itself, ``R * T * K`` slots, is never held at once)."""
    words = np.empty((R, E + R), np.int64)
    for s0, n, idx in routing_blocks(R, E, K, T, routing, skew, hot_expert, hot_fraction, seed,
                                     ranks_per_node, nodes_per_token):
        words[s0:s0 + n] = count_words_block(idx, [T] * n, R, E)
    return words


def kept_block(idx: np.ndarray, tokens: Sequence[int], counts: np.ndarray, before: np.ndarray,
               capacity: Optional[int]) -> np.ndarray:
    """The kept mask ``[n, K] bool`` of consecutive ranks' routing (rows in (rank, token)
    order, ``tokens`` rows per rank, ``counts [ranks, E]`` their used slots per expert), given
    ``before [E]``, the used slots of every expert on the ranks before them, which it advances.
    The rule is the reference's own: ``reference.capacity.kept_counts`` gives each rank's kept
    slots per expert from the slots before it, and a rank keeps its first that many slots to an
    expert in token order (their order within an expert from ``reference.capacity.sorted_slots``,
    keyed by (rank, expert))."""
    used = idx >= 0
    if capacity is None:
        before += counts.sum(axis=0)
        return used
    n_ranks, E = counts.shape
    kept_n = kept_counts(np.vstack([before[None], counts]), capacity)[1:]   # [ranks, E]
    before += counts.sum(axis=0)
    owner = np.repeat(np.arange(n_ranks, dtype=np.int64), np.asarray(tokens, np.int64))[:, None]
    key = np.where(used, owner * E + idx, -1).ravel()
    f_sorted, e_sorted, _, _, ordinal, _, _ = sorted_slots(key, n_ranks * E, None)
    kept = np.zeros(key.shape, bool)
    kept[f_sorted] = ordinal < kept_n.ravel()[e_sorted]
    return kept.reshape(idx.shape)


def node_counts_block(idx: np.ndarray, kept: np.ndarray, tokens: Sequence[int], R: int, E: int,
                      G: int) -> dict:
    """``reference.transports.hier.NodeCounts``'s rows of consecutive ranks (a dict of
    ``[len(tokens), R]`` / ``[len(tokens), R / G]`` int64 arrays), counted by the reference's
    count words (``reference.fast.count_words_block``) of the kept routing: its
    ``tokens_per_rank`` are the token rows (tokens with a kept slot on ``d``), the same count
    with ``R / G`` "ranks" of ``E * G / R`` experts the node token rows, and with every token's
    first kept slot on each rank (node) left out, the tokens with two or more there (``multi``,
    ``node_multi``; each row's experts sorted, so a rank's or node's slots are adjacent)."""
    n_ranks, L, N = len(tokens), E // R, R // G
    k_idx = np.sort(np.where(kept, idx, -1), axis=1)
    words = count_words_block(k_idx, tokens, R, E)
    out = {"tokens": words[:, E:], "slots": words[:, :E].reshape(n_ranks, R, L).sum(axis=2),
           "node_tokens": count_words_block(k_idx, tokens, N, E)[:, E:]}
    for name, width in (("multi", R), ("node_multi", N)):
        unit = k_idx // (E // width)                        # -1 (no kept slot) stays negative
        again = np.zeros(k_idx.shape, bool)
        again[:, 1:] = (unit[:, 1:] == unit[:, :-1]) & (k_idx[:, 1:] >= 0)
        out[name] = count_words_block(np.where(again, k_idx, -1), tokens, width, E)[:, E:]
    return out


def draw_counts(R: int, E: int, K: int, T: int, routing: str = "uniform", skew: float = 1.2,
                hot_expert: int = 0, hot_fraction: float = 0.5, seed: int = 0,
                ranks_per_node: int = 1, nodes_per_token: int = 1,
                capacity: Optional[int] = None):
    """The draw of :func:`draw_count_words`, keeping the count words and the group's
    ``hier.NodeCounts`` under ``capacity`` (nodes of ``ranks_per_node``)."""
    G, N = ranks_per_node, R // ranks_per_node
    words = np.empty((R, E + R), np.int64)
    parts = {k: np.empty((R, w), np.int64) for k, w in (("tokens", R), ("multi", R), ("slots", R),
                                                         ("node_tokens", N), ("node_multi", N))}
    before = np.zeros(E, np.int64)
    for s0, n, idx in routing_blocks(R, E, K, T, routing, skew, hot_expert, hot_fraction, seed,
                                     ranks_per_node, nodes_per_token):
        words[s0:s0 + n] = count_words_block(idx, [T] * n, R, E)
        kept = kept_block(idx, [T] * n, words[s0:s0 + n, :E], before, capacity)
        for k, v in node_counts_block(idx, kept, [T] * n, R, E, G).items():
            parts[k][s0:s0 + n] = v
    return words, hier.NodeCounts(**parts)


def routing_blocks(R: int, E: int, K: int, T: int, routing: str, skew: float, hot_expert: int,
                   hot_fraction: float, seed: int, ranks_per_node: int, nodes_per_token: int):
    """Yield ``(first rank, ranks, routing [ranks * T, K] int64)``, ranks ascending, about 4 M
    slots at a time: the one seeded draw behind every count the simulator keeps."""
    rng = np.random.default_rng(seed)
    weights = expert_weights(E, routing, skew, rng, hot_expert)
    nodes = R // ranks_per_node if routing == "grouped" else 1
    block = max(1, _MAX_SLOTS_PER_BLOCK // max(1, T * K))
    for s0 in range(0, R, block):
        n = min(block, R - s0)
        yield s0, n, sample_routing(rng, n * T, E, K, routing, weights, hot_expert, hot_fraction,
                                    nodes, nodes_per_token)


# ---- the transport table, traffic and the link model ----------------------------------------

@dataclass(frozen=True)
class Stage:
    """One exchange of a pass: its name, the peers it runs among (``group``: every rank;
    ``inter``: the ranks of one local index, one a node, hier's stage 1; ``intra``: the ranks of
    one node, hier's stage 2), and its sections' row counts ``[R, R]`` from the plan (each
    section is an exchange of its own: a message per peer it reaches)."""

    name: str
    peers: str
    sections: Callable


@dataclass(frozen=True)
class Transport:
    """A row of the transport table: the reference's plan for it (from the count words and
    the drawn NodeCounts), its byte matrices per stage and pass, and its stages."""

    plan: Callable          # (group, words, NodeCounts or None) -> plan
    dispatch: Callable      # (group, plan) -> [B [R, R] per stage]
    combine: Callable
    stages: dict            # pass -> (Stage, ...) in the order they run


def _dedup_plan(group, words, c):
    """The exact dedup plan with the drawn NodeCounts: the kept token rows (what the count
    exchange's second all-gather carries under capacity) and the single-slot ones (the way
    back's raw rows); from the count words alone, an upper bound (Plan.exact False)."""
    return plan(group, words) if c is None else plan(group, words, c.tokens, c.tokens - c.multi)


_ONE_PASS = {"dispatch": lambda g, p: [dispatch_bytes_of(g, p)],
             "combine": lambda g, p: [combine_bytes_of(g, p)]}
TABLE = {
    "pairs": Transport(lambda g, w, c: plan(g, w), **_ONE_PASS, stages={
        "dispatch": (Stage("all-to-all", "group", lambda p: [p.rows]),),
        "combine": (Stage("all-to-all", "group", lambda p: [p.rows.T]),)}),
    "dedup": Transport(_dedup_plan, **_ONE_PASS, stages={
        "dispatch": (Stage("all-to-all", "group", lambda p: [p.rows, p.slots]),),
        "combine": (Stage("all-to-all", "group", lambda p: [p.rows.T]),)}),
    "hier": Transport(lambda g, w, c: hier.plan(g, c), hier.dispatch_bytes_of,
                      hier.combine_bytes_of, stages={
        "dispatch": (Stage("inter-node", "inter", lambda p: [p.s1_tok, p.s1_slot]),
                     Stage("intra-node", "intra", lambda p: [p.s2_tok, p.s2_slot])),
        "combine": (Stage("intra-node", "intra", lambda p: [p.s2_tok.T]),
                    Stage("inter-node", "inter", lambda p: [p.s1_tok.T]))}),
}
TRANSPORTS = tuple(TABLE)


def traffic(words: np.ndarray, E: int, K: int, H: int, dtype="bfloat16", transport="dedup",
            exchange="ragged", capacity: Optional[int] = None):
    """``(dispatch [R, R], combine [R, R])`` bytes rank s sends rank d, from the count words,
    through the reference's plan and byte accounting."""
    stages = traffic_stages(words, E, K, H, dtype, transport, exchange, capacity)
    return sum(stages["dispatch"]), sum(stages["combine"])


def traffic_stages(words: np.ndarray, E: int, K: int, H: int, dtype="bfloat16",
                   transport="dedup", exchange="ragged", capacity: Optional[int] = None,
                   ranks_per_node: int = 1, node_counts: Optional[hier.NodeCounts] = None,
                   messages: bool = False) -> dict:
    """``{"dispatch": [B...], "combine": [B...]}``: each pass's exchanges in the order they run,
    each an [R, R] int64 byte matrix (the transport's row of :data:`TABLE`; hier needs
    ``node_counts``). With ``messages``, also ``"messages": {pass: [M...]}``, the messages
    ``s -> d`` of each stage (:func:`stage_messages`)."""
    R = words.shape[0]
    dtype = _dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    group = Group(R, E, H, K, dtype, 1, capacity, None, transport, exchange, None, ranks_per_node)
    row = TABLE[transport]
    p = row.plan(group, words, node_counts)
    out = {ph: getattr(row, ph)(group, p) for ph in ("dispatch", "combine")}
    if messages:
        out["messages"] = {ph: [stage_messages(st, p, ranks_per_node) for st in row.stages[ph]]
                           for ph in ("dispatch", "combine")}
    return out


def peer_mask(R: int, ranks_per_node: int, peers: str) -> np.ndarray:
    """[R, R] bool: the pairs ``s -> d`` (``s != d``) a stage of ``peers`` can use."""
    G = max(1, ranks_per_node)
    r = np.arange(R)
    mask = {"group": np.ones((R, R), bool), "intra": same_node(R, G),
            "inter": (r[:, None] % G == r[None, :] % G) & ~same_node(R, G)}[peers]
    return mask & ~np.eye(R, dtype=bool)


def stage_messages(stage: Stage, p, ranks_per_node: int) -> np.ndarray:
    """[R, R] int64 messages ``s -> d`` of one stage: one per section and peer it sends rows to
    (ragged), or, padded, one per section to every peer of the stage (a padded chunk travels
    empty or not); the diagonal (a local copy) is none."""
    sections = stage.sections(p)
    mask = peer_mask(sections[0].shape[0], ranks_per_node, stage.peers)
    fixed = VARIANTS[getattr(p, "variant", "ragged")].fixed  # a fixed chunk travels even empty
    return sum((np.ones_like(mask) if fixed else (c > 0)) & mask
               for c in sections).astype(np.int64)


def _dtype(name: str) -> np.dtype:
    for dt in FLOAT_DTYPES:
        if dt.name == name:
            return dt
    raise ValueError(f"epkit simulate: dtype must be float32 or bfloat16, got {name!r}")


def same_node(R: int, ranks_per_node: int) -> np.ndarray:
    """[R, R] bool: ``s // ranks_per_node == d // ranks_per_node`` (the diagonal included)."""
    node = np.arange(R) // max(1, ranks_per_node)
    return node[:, None] == node[None, :]


def split_tiers(B: np.ndarray, ranks_per_node: int):
    """``(intra [R, R], inter [R, R])`` float64: ``B`` without its diagonal, split by tier."""
    same = same_node(B.shape[0], ranks_per_node)
    intra = np.where(same, B, 0).astype(np.float64)
    np.fill_diagonal(intra, 0)
    return intra, np.where(same, 0, B).astype(np.float64)


def tier_seconds(B: np.ndarray, ranks_per_node: int, intra_gbps: float, inter_gbps: float,
                 M: Optional[np.ndarray] = None, intra_us: float = 0.0, inter_us: float = 0.0):
    """Per rank, ``(t_intra_r, t_inter_r)`` seconds (module docstring): on each tier the busier
    direction, ``messages * alpha + bytes / beta`` (``M``: messages [R, R]; none: bytes only)."""
    out = []
    for (b_tier, m_tier), gbps, us in zip(
            zip(split_tiers(B, ranks_per_node),
                split_tiers(np.zeros_like(B) if M is None else M, ranks_per_node)),
            (intra_gbps, inter_gbps), (intra_us, inter_us)):
        cost = lambda axis: m_tier.sum(axis) * us * 1e-6 + b_tier.sum(axis) / (gbps * 1e9)
        out.append(np.maximum(cost(1), cost(0)))
    return tuple(out)


def predict_seconds(B: np.ndarray, ranks_per_node: int, intra_gbps: float, inter_gbps: float,
                    latency_us: float = 0.0, M: Optional[np.ndarray] = None,
                    intra_us: float = 0.0, inter_us: float = 0.0):
    """The link model of the module docstring for one exchange: ``(t, per-rank t_r)``
    seconds, the two tiers concurrent."""
    t_intra, t_inter = tier_seconds(B, ranks_per_node, intra_gbps, inter_gbps, M, intra_us,
                                    inter_us)
    t_r = np.maximum(t_intra, t_inter)
    return latency_us * 1e-6 + float(t_r.max()), t_r


def price(stages, ranks_per_node: int, intra_gbps: float, inter_gbps: float,
          latency_us: float = 0.0, messages=None, intra_us: float = 0.0,
          inter_us: float = 0.0) -> dict:
    """A pass of exchanges run one after the other: ``predicted_ms`` (the sum of each
    exchange's :func:`predict_seconds`), ``intra_ms`` / ``inter_ms`` (the sum over exchanges of
    the slowest rank's time on that tier alone), ``message_ms`` (the same for the messages'
    alpha alone, tiers concurrent)."""
    out = {"predicted_ms": 0.0, "intra_ms": 0.0, "inter_ms": 0.0, "message_ms": 0.0}
    for i, B in enumerate(stages):
        M = None if messages is None else messages[i]
        t, _ = predict_seconds(B, ranks_per_node, intra_gbps, inter_gbps, latency_us, M,
                               intra_us, inter_us)
        t_intra, t_inter = tier_seconds(B, ranks_per_node, intra_gbps, inter_gbps, M,
                                        intra_us, inter_us)
        out["predicted_ms"] += 1e3 * t
        out["intra_ms"] += 1e3 * float(t_intra.max())
        out["inter_ms"] += 1e3 * float(t_inter.max())
        if M is not None:
            a_intra, a_inter = tier_seconds(0 * B, ranks_per_node, 1.0, 1.0, M, intra_us,
                                            inter_us)
            out["message_ms"] += 1e3 * float(np.maximum(a_intra, a_inter).max())
    return out


def message_stats(names, messages, ranks_per_node: int) -> dict:
    """One pass's message counts: per stage the most and the mean a rank sends (``intra``,
    ``inter``: the most on each tier), and the most a rank sends over the whole pass."""
    per = []
    for name, M in zip(names, messages):
        intra, inter = split_tiers(M, ranks_per_node)
        sent = (intra + inter).sum(1)
        per.append({"stage": name, "max_per_rank": int(sent.max()),
                    "mean_per_rank": float(sent.mean()), "intra_max_per_rank": int(intra.sum(1).max()),
                    "inter_max_per_rank": int(inter.sum(1).max())})
    total = sum(M - np.diag(np.diag(M)) for M in messages)
    return {"stages": per, "max_per_rank": int(total.sum(1).max())}


def byte_stats(B: np.ndarray, ranks_per_node: int) -> dict:
    """One pass's figures from its [R, R] byte matrix (all its exchanges summed): per rank sent
    and received, and the whole group's bytes by tier, the diagonal (a local copy) left out of
    every one (``intra_node_bytes + inter_node_bytes == total_bytes``)."""
    intra, inter = split_tiers(B, ranks_per_node)
    off = intra + inter
    sent = off.sum(1)
    return {"max_bytes_per_rank": float(sent.max()), "mean_bytes_per_rank": float(sent.mean()),
            "max_bytes_received": float(off.sum(0).max()),
            "total_bytes": float(off.sum()),
            "intra_node_bytes": float(intra.sum()), "inter_node_bytes": float(inter.sum()),
            "local_copy_bytes_mean": float(np.diag(B).mean())}


def _pass(stages, messages, names, args) -> dict:
    return dict(byte_stats(sum(stages), args.ranks_per_node),
                messages=message_stats(names, messages, args.ranks_per_node),
                **price(stages, args.ranks_per_node, args.intra_gbps, args.inter_gbps,
                        args.latency_us, messages, args.intra_us, args.inter_us))


def simulate(args) -> dict:
    """Everything ``epkit simulate`` reports, as a dict (see :func:`main`)."""
    R, E, K, T, H = args.ranks, args.experts, args.topk, args.tokens, args.hidden
    t0 = time.perf_counter()
    capacity = None
    if args.capacity_factor is not None:
        capacity = int(math.ceil(args.capacity_factor * R * T * K / E))
    words, nodes = draw_counts(R, E, K, T, args.routing, args.skew, args.hot_expert,
                               args.hot_fraction, args.seed, args.ranks_per_node,
                               args.nodes_per_token, capacity)
    t_draw = time.perf_counter() - t0
    counts = words[:, :E]
    load = counts.sum(axis=0)
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "no_plot", "markdown")},
           "capacity": capacity,
           "expert_load": {"max": int(load.max()), "mean": float(load.mean()),
                           "min": int(load.min()),
                           "imbalance_max_over_mean": float(load.max() / max(load.mean(), 1e-12))},
           "transports": {}}
    rank_load = load.reshape(R, E // R).sum(axis=1)
    out["rank_load"] = {"max": int(rank_load.max()), "mean": float(rank_load.mean()),
                        "imbalance_max_over_mean":
                            float(rank_load.max() / max(rank_load.mean(), 1e-12))}
    used = int(counts.sum())
    mats = {}
    for tr, row in TABLE.items():
        st = traffic_stages(words, E, K, H, args.dtype, tr, args.exchange, capacity,
                            args.ranks_per_node, nodes, messages=True)
        mats[tr] = st["dispatch"]
        out["transports"][tr] = {
            ph: dict(_pass(st[ph], st["messages"][ph], [s.name for s in row.stages[ph]], args),
                     stages=[s.name for s in row.stages[ph]])
            for ph in ("dispatch", "combine")}
    kept = int(kept_counts(counts, capacity).sum())
    out["dropped"] = {"slots": used - kept, "fraction": (used - kept) / max(used, 1)}
    out["tokens_per_rank_mean_distinct_ranks"] = float(words[:, E:].sum() / (R * T)) if T else 0.0
    out["seconds"] = {"routing_and_counts": t_draw, "total": time.perf_counter() - t0}
    out["_matrices"] = mats
    return out


# ---- report --------------------------------------------------------------------------------

def _mb(v: float) -> str:
    return f"{v / 1e6:,.1f}"


def _gb(v: float) -> str:
    return f"{v / 1e9:,.2f}"


def _msgs(s: dict) -> str:
    """Messages the busiest rank sends in a pass, stage by stage (``127+7``: hier's two)."""
    return "+".join(str(st["max_per_rank"]) for st in s["messages"]["stages"])


COLUMNS = ("transport", "pass", "msgs/rank", "max MB out", "max MB in", "inter GB", "intra GB",
           "msg ms", "inter ms", "intra ms", "predicted ms")


def table_rows(res: dict) -> list[list[str]]:
    """The report's table, one list of cells (:data:`COLUMNS`) per transport and pass."""
    return [[tr, ph, _msgs(s), _mb(s["max_bytes_per_rank"]), _mb(s["max_bytes_received"]),
             _gb(s["inter_node_bytes"]), _gb(s["intra_node_bytes"]), f"{s['message_ms']:.3f}",
             f"{s['inter_ms']:.3f}", f"{s['intra_ms']:.3f}", f"{s['predicted_ms']:.3f}"]
            for tr, d in res["transports"].items() for ph in ("dispatch", "combine")
            for s in (d[ph],)]


def markdown(res: dict) -> str:
    """The report's table as Markdown (``--markdown``: what docs/benchmarks.md quotes)."""
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in COLUMNS[2:]) + " |"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table_rows(res)])


def report(res: dict) -> str:
    c = res["config"]
    lines = [f"epkit simulate: {c['ranks']} ranks ({c['ranks_per_node']} per node), "
             f"{c['experts']} experts, "
             f"top-{c['topk']}, {c['tokens']} tokens/rank, hidden {c['hidden']}, {c['dtype']}, "
             f"routing {c['routing']}" + (f" (skew {c['skew']})" if c["routing"] == "zipf" else "")
             + (f" (expert {c['hot_expert']} in {c['hot_fraction']:.0%} of tokens)"
                if c["routing"] == "hot" else "")
             + (f" ({c['nodes_per_token']} nodes per token)" if c["routing"] == "grouped" else "")
             + f", {c['exchange']} exchange",
             f"links: intra-node {c['intra_gbps']:g} GB/s + {c['intra_us']:g} us a message, "
             f"inter-node {c['inter_gbps']:g} GB/s + {c['inter_us']:g} us a message"
             + (f", {c['latency_us']:g} us an exchange" if c["latency_us"] else "")]
    el, rl = res["expert_load"], res["rank_load"]
    lines.append(f"expert load: max {el['max']:,} mean {el['mean']:,.1f} slots "
                 f"(imbalance {el['imbalance_max_over_mean']:.2f}); rank load imbalance "
                 f"{rl['imbalance_max_over_mean']:.2f}; a token visits "
                 f"{res['tokens_per_rank_mean_distinct_ranks']:.2f} ranks on average")
    if res["capacity"] is not None:
        lines.append(f"capacity {res['capacity']:,} slots per expert (factor "
                     f"{c['capacity_factor']}): dropped {res['dropped']['slots']:,} slots "
                     f"({res['dropped']['fraction']:.2%})")
    widths = (10, 10, 10, 12, 12, 11, 11, 8, 10, 10, 14)
    for i, cells in enumerate([list(COLUMNS)] + table_rows(res)):
        lines.append("  " + "".join(f"{v:<{w}}" if j < 2 else f"{v:>{w}}"
                                    for j, (v, w) in enumerate(zip(cells, widths))))
    lines.append("(msgs/rank: the busiest rank's messages, one per section and peer, per stage "
                 "(hier: inter-node + intra-node; dedup's dispatch has two sections, token rows "
                 "and slot rows); MB: per rank, to / from other ranks; GB: the whole group's bytes "
                 "over inter-node and intra-node pairs; msg ms: the messages' per-message cost "
                 "alone; inter / intra ms: the slowest rank on that tier, messages and bytes; "
                 "predicted: tiers concurrent, stages in sequence; the local copy is left out; "
                 f"{res['seconds']['total']:.1f} s)")
    return "\n".join(lines)


# colour-bar ticks, coarse to fine: the finest levels that leave at most 9 ticks in range
TICK_LEVELS = ((1.0, 0.1, 10.0, 0.01, 100.0, 0.001, 1000.0), (0.5, 2.0, 0.05, 20.0, 0.005, 200.0),
               (0.2, 5.0, 0.02, 50.0, 0.002, 500.0), (0.8, 1.25), (0.67, 1.5, 0.33, 3.0),
               (0.9, 1.1))


def relative_ticks(m: float) -> list[float]:
    """Round factors within ``[1/m, m]``: all of a level or none, at most 9 (at least 1)."""
    ticks: list[float] = []
    for level in TICK_LEVELS:
        more = [t for t in level if 1 / m <= t <= m]
        if len(ticks) + len(more) > 9:
            break
        ticks += more
    return sorted(ticks)


def _times(v: float) -> str:
    return f"×{v:g}"


RANK_LEVEL_MAX = 128   # past this many ranks (and with nodes) a heatmap goes node by node


def _relative(B: np.ndarray, mask: Optional[np.ndarray] = None):
    """``(off, mean, rel)``: the bytes of the pairs ``mask`` keeps (default: every pair off the
    diagonal), zero elsewhere; the mean of those pairs; every pair divided by that mean."""
    if mask is None:
        mask = ~np.eye(B.shape[0], dtype=bool)
    off = np.where(mask, B, 0).astype(np.float64)
    mean = off.sum() / max(1, int(mask.sum()))
    return off, mean, (off / mean if mean > 0 else off)


def _hot(B: np.ndarray, mask: Optional[np.ndarray] = None, unit: str = "rank",
         labels: Optional[Sequence[int]] = None) -> str:
    """The hottest column and row of ``B`` against the mean, and the spread of its pairs."""
    off, mean, rel = _relative(B, mask)
    mask = ~np.eye(B.shape[0], dtype=bool) if mask is None else mask
    labels = list(range(B.shape[0])) if labels is None else list(labels)
    cols, rows = off.sum(0), off.sum(1)
    hot_col, hot_row = int(cols.argmax()), int(rows.argmax())
    cmean, rmean = cols[mask.any(0)].mean() or 1.0, rows[mask.any(1)].mean() or 1.0
    spread = float(np.percentile(np.abs(rel[mask] - 1), 90)) if mask.any() else 0.0
    pairs = "pairs" if unit == "rank" else f"{unit} pairs"
    return (f"hottest destination {unit} {labels[hot_col]} receives ×{cols[hot_col] / cmean:.2f} "
            f"the mean; busiest source {unit} {labels[hot_row]} sends "
            f"×{rows[hot_row] / rmean:.2f}; 90 % of {pairs} lie within ±{100 * spread:.0f} % of "
            "the mean pair")


def heatmap_caption(B: np.ndarray) -> str:
    """The rank-by-rank heatmap's caption: what to look for, and how much of it ``B`` holds."""
    return ("What to look for: a red column is a destination rank receiving more than its "
            "share (hot experts), a red row a source sending more; pale means even.\n"
            f"Here: {_hot(B)}. Grey: the diagonal (a local copy, not sent) and empty pairs.")


def node_matrix(B: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """[N, N]: the bytes from each node's ranks to each node's ranks."""
    N, G = B.shape[0] // ranks_per_node, ranks_per_node
    return B.reshape(N, G, N, G).sum(axis=(1, 3))


@dataclass
class Panel:
    """One heatmap: ``B`` drawn relative to the mean of the pairs ``mask`` keeps (grey
    elsewhere); ``unit`` rank or node; ``first``: the global index of its first row."""

    B: np.ndarray
    mask: np.ndarray
    title: str
    unit: str = "rank"
    first: int = 0
    ranks_per_node: int = 0      # node boundaries drawn in a rank-by-rank panel of the group


def _zoom(B: np.ndarray, G: int, title: str, mask: np.ndarray) -> Panel:
    """The rank-by-rank block of the node whose ranks receive the most (within ``mask``)."""
    got = np.where(mask, B, 0).sum(axis=0).reshape(-1, G).sum(axis=1)
    n = int(got.argmax())
    sl = slice(n * G, (n + 1) * G)
    return Panel(B[sl, sl], ~np.eye(G, dtype=bool), f"{title}: inside node {n}, rank by rank",
                 first=n * G)


def heatmap_panels(stages: Sequence[np.ndarray], ranks_per_node: int,
                   stage_names: Sequence[str] = ()) -> tuple[list[Panel], str]:
    """What :func:`heatmap` draws, and its caption. One exchange (pairs, dedup): up to
    :data:`RANK_LEVEL_MAX` ranks one rank-by-rank panel; past it, node by node (the inter-node
    pairs) beside one node rank by rank (the node receiving the most). Two stages (hier): one
    panel per stage, stage 1 (inter-node: only pairs of one local index on different nodes)
    and stage 2 (intra-node: inside each node); past :data:`RANK_LEVEL_MAX` ranks stage 1 node
    by node and stage 2 inside one node."""
    R, G = stages[0].shape[0], ranks_per_node
    nodes = R // G if 1 < G < R and R % G == 0 else 0
    big = R > RANK_LEVEL_MAX and nodes > 1
    off_node = ~np.eye(max(nodes, 1), dtype=bool)
    if len(stages) == 1:
        B = stages[0]
        if not big:
            return [Panel(B, ~np.eye(R, dtype=bool), "", ranks_per_node=G if nodes else 0)], \
                heatmap_caption(B)
        NB = node_matrix(B, G)
        zoom = _zoom(B, G, "intra-node pairs", same_node(R, G) & ~np.eye(R, dtype=bool))
        return [Panel(NB, off_node, "node by node (inter-node pairs)", unit="node"), zoom], (
            f"{R} ranks are too many to draw rank by rank: left, node by node (a node's row: "
            f"what its {G} ranks send each other node; the diagonal, inside a node, grey); "
            f"right, node {zoom.first // G}'s ranks (the node receiving the most inside itself) "
            "rank by rank, its diagonal (a local copy) grey. Each panel relative to its own mean "
            "pair. What to look for: a red column is a destination receiving more than its "
            "share (hot experts), a red row a source sending more; pale means even.\n"
            f"Here, node by node: {_hot(NB, off_node, 'node')}; inside node "
            f"{zoom.first // G}: {_hot(zoom.B, zoom.mask, 'rank', range(zoom.first, zoom.first + G))}.")
    s1, s2 = stages
    names = list(stage_names) or ["stage 1", "stage 2"]
    inter, intra = peer_mask(R, G, "inter"), peer_mask(R, G, "intra")
    if big:
        p1 = Panel(node_matrix(s1, G), off_node, f"stage 1, {names[0]}: node by node", unit="node")
        p2 = _zoom(s2, G, f"stage 2, {names[1]}", intra)
    else:
        p1 = Panel(s1, inter, f"stage 1, {names[0]}", ranks_per_node=G)
        p2 = Panel(s2, intra, f"stage 2, {names[1]}", ranks_per_node=G)
    labels2 = range(p2.first, p2.first + p2.B.shape[0])
    return [p1, p2], (
        "hier moves the pass in two stages, one after the other: stage 1 (inter-node) sends a "
        "token once to each node holding one of its kept slots, to the rank there with the "
        "sender's local index, so only pairs of one local index on different nodes carry bytes; "
        "stage 2 (intra-node) fans the rows out inside each node. Each panel is relative to its "
        "own stage's mean pair; grey: pairs the stage does not use (and empty ones).\n"
        f"Here: stage 1 moves {_gb(float(np.where(inter, s1, 0).sum()))} GB, "
        f"{_hot(p1.B, p1.mask, p1.unit)}; stage 2 moves {_gb(float(np.where(intra, s2, 0).sum()))}"
        f" GB, {_hot(p2.B, p2.mask, 'rank', labels2)}.")


def _node_ticks(ax, R: int, G: int) -> None:
    """A rank-by-rank panel's nodes: boundaries, rank numbers at each node's first rank
    (bottom, left) and node names ``n0``, ``n1``... in italics at their centres (top, right)."""
    nodes = R // G
    if nodes <= 64:
        for b in range(G, R, G):
            for line in (ax.axhline, ax.axvline):
                line(b - 0.5, color="black", lw=0.5, alpha=0.5 if nodes <= 16 else 0.25)
    every = max(1, math.ceil(nodes / 16))  # at most 16 node labels per axis
    starts = list(range(0, R, G * every))
    ax.set_xticks(starts, [str(v) for v in starts])
    ax.set_yticks(starts, [str(v) for v in starts])
    centres = [n * G + (G - 1) / 2 for n in range(0, nodes, every)]
    names = [f"n{n}" for n in range(0, nodes, every)]
    top, right = ax.secondary_xaxis("top"), ax.secondary_yaxis("right")
    top.set_xticks(centres, names, fontsize=7, style="italic", color="0.3")
    right.set_yticks(centres, names, fontsize=7, style="italic", color="0.3")
    top.tick_params(length=0)
    right.tick_params(length=0)
    ax.set_title(f"nodes of {G} ranks (n0, n1, ...)" + (f", every {every}th named" if every > 1
                                                      else ""), fontsize=8, color="0.3")


def _index_ticks(ax, n: int, first: int, prefix: str) -> None:
    every = max(1, math.ceil(n / 16))
    pos = list(range(0, n, every))
    ax.set_xticks(pos, [f"{prefix}{first + p}" for p in pos], rotation=90 if n > 8 else 0)
    ax.set_yticks(pos, [f"{prefix}{first + p}" for p in pos])


def heatmap(path: str, stages, title: str, ranks_per_node: int,
            stage_names: Sequence[str] = ()) -> None:
    """The byte matrices of one pass (one ``[R, R]`` array, or hier's two stages) as each
    pair's bytes relative to its panel's mean pair (:func:`heatmap_panels`): a diverging colour
    scale centred on the mean (white), logarithmic and symmetric (``×1/m`` to ``×m``, at least
    ``×0.8`` to ``×1.25``), ticks at round factors (:func:`relative_ticks`); pairs outside a
    panel (the diagonal, a local copy) and empty pairs grey; nodes drawn and named ``n0``...
    (ranks by number); a caption saying what to look for and measuring it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    stages = [stages] if isinstance(stages, np.ndarray) else list(stages)
    panels, caption = heatmap_panels(stages, ranks_per_node, stage_names)
    shown = []
    for p in panels:
        _, mean, rel = _relative(p.B, p.mask)
        shown.append((mean, np.ma.masked_where(~p.mask | (rel <= 0), rel)))
    m = max([1.25] + [float(d.max()) for _, d in shown if d.count()]
            + [1.0 / float(d.min()) for _, d in shown if d.count()])
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.8")
    fig = plt.figure(figsize=(7.6 if len(panels) == 1 else 13.5, 7.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, p, (mean, data) in zip(axes, panels, shown):
        im = ax.imshow(data, cmap=cmap, norm=LogNorm(vmin=1 / m, vmax=m), interpolation="nearest")
        n = p.B.shape[0]
        if p.ranks_per_node:
            _node_ticks(ax, n, p.ranks_per_node)
        elif p.unit == "node":
            _index_ticks(ax, n, 0, "n")
        else:
            _index_ticks(ax, n, p.first, "")
        ax.tick_params(labelsize=7)
        ax.set(xlabel=f"destination {p.unit}", ylabel=f"source {p.unit}")
        if p.title or len(panels) > 1:
            ax.set_xlabel(f"destination {p.unit}\n{p.title} (mean pair {mean / 1e6:,.2f} MB)",
                          fontsize=9)
    cb = fig.colorbar(im, ax=list(axes), shrink=0.82, pad=0.02)
    cb.ax.yaxis.set_major_locator(FixedLocator(relative_ticks(m)))
    cb.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _times(v)))
    cb.ax.yaxis.set_minor_locator(NullLocator())
    label = "bytes sent / the mean pair" + (f"'s {shown[0][0] / 1e6:,.2f} MB" if len(panels) == 1
                                            else " of its panel")
    cb.set_label(label + " (log scale; white = mean)")
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.005, caption, fontsize=7.5, ha="left", va="bottom", wrap=True)
    fig.get_layout_engine().set(rect=(0, 0.09, 1, 0.91))
    fig.savefig(path, dpi=110)
    plt.close(fig)


LINK_FLAGS = (
    ("--intra-gbps", INTRA_GBPS, "intra-node link, GB/s per rank each way (NVLink 4 on H100 / "
                                 "H200: 900 GB/s both ways, docs/benchmarks.md)"),
    ("--inter-gbps", INTER_GBPS, "inter-node link, GB/s per rank each way (one ConnectX-7 NDR "
                                 "InfiniBand port a GPU: 400 Gb/s)"),
    ("--intra-us", INTRA_US, "cost of one intra-node message, microseconds (alpha: paid per "
                             "peer and section, at the sender and at the receiver)"),
    ("--inter-us", INTER_US, "cost of one inter-node message (RDMA), microseconds"))


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter

    ap = argparse.ArgumentParser(prog="epkit simulate", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--ranks", type=int, default=64, help="ranks R of the simulated group")
    ap.add_argument("--experts", type=int, default=256, help="experts E (a multiple of --ranks)")
    ap.add_argument("--topk", type=int, default=8, help="experts per token K")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size H of a token row")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="token dtype")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform",
                    help="how each token picks its top-k distinct experts: uniform (every "
                         "expert alike); zipf (expert of popularity rank i has weight "
                         "i ** -skew, --skew); hot (expert --hot-expert in a fraction "
                         "--hot-fraction of the tokens, the other slots uniform); grouped "
                         "(node-limited, DeepSeek-V3 style: --nodes-per-token nodes drawn "
                         "first, then the experts among theirs)")
    ap.add_argument("--skew", type=float, default=1.2, help="Zipf exponent (routing zipf)")
    ap.add_argument("--hot-expert", type=int, default=0, help="the hot expert (routing hot)")
    ap.add_argument("--hot-fraction", type=float, default=0.5,
                    help="fraction of tokens naming the hot expert (routing hot)")
    ap.add_argument("--ranks-per-node", type=int, default=8,
                    help="ranks per node (a divisor of --ranks): pairs s -> d with s // "
                         "ranks_per_node == d // ranks_per_node are intra-node (--intra-gbps), "
                         "the others inter-node (--inter-gbps)")
    ap.add_argument("--nodes-per-token", type=int, default=4,
                    help="routing grouped: each token draws this many distinct nodes uniformly, "
                         "then its top-k distinct experts uniformly among those nodes' experts")
    for flag, default, text in LINK_FLAGS:   # the link model's four figures
        ap.add_argument(flag, type=float, default=default, help=text)
    ap.add_argument("--latency-us", type=float, default=0.0,
                    help="a fixed cost per exchange stage on top of the per-message costs "
                         "(launch, synchronisation); 0 by default")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="capacity C = ceil(F * R * T * K / E) slots per expert (default: none)")
    ap.add_argument("--exchange", choices=["ragged", "padded"], default="ragged",
                    help="exchange whose bytes are counted")
    ap.add_argument("--seed", type=int, default=0, help="seed of the routing")
    ap.add_argument("--json", metavar="PATH", help="write the report's figures here")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as Markdown too (what docs/benchmarks.md quotes)")
    ap.add_argument("--plot", metavar="PATH", default="epkit-simulate.png",
                    help="where the PNG heatmap of the dispatch bytes each source sends each "
                         f"destination goes (rank by rank up to {RANK_LEVEL_MAX} ranks; past that "
                         "node by node beside one node rank by rank)")
    ap.add_argument("--no-plot", action="store_true", help="draw no heatmap")
    ap.add_argument("--plot-transport", choices=list(TRANSPORTS), default="dedup",
                    help="whose dispatch bytes --plot shows (hier: one panel per stage, "
                         "inter-node then intra-node)")
    return ap


def experts_hint(experts: int, ranks: int) -> str:
    """The error for an --experts that is not a positive multiple of --ranks, with the
    nearest valid values."""
    up = ranks * max(1, math.ceil(experts / ranks))
    more = f" or --experts {4 * ranks} (4 a rank)" if up != 4 * ranks else ""
    return (f"--experts must be a positive multiple of --ranks ({ranks}): got {experts}; try "
            f"--experts {up} ({up // ranks} a rank){more}")


def parse_args(argv):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error("--ranks must be at least 1")
    if args.experts < 1 or args.experts % args.ranks:
        ap.error(experts_hint(args.experts, args.ranks))
    if not 1 <= args.topk <= args.experts:
        ap.error("--topk must be in [1, experts]")
    if args.routing == "hot" and not 0 <= args.hot_expert < args.experts:
        ap.error("--hot-expert must name an expert")
    if args.routing == "hot" and args.topk > args.experts - 1:
        ap.error("routing hot needs --topk < --experts")
    if args.ranks_per_node < 1 or args.ranks % args.ranks_per_node:
        ap.error("--ranks-per-node must be a positive divisor of --ranks")
    nodes = args.ranks // args.ranks_per_node
    if args.routing == "grouped" and not (
            1 <= args.nodes_per_token <= nodes
            and args.topk <= args.nodes_per_token * args.experts // nodes):
        ap.error(f"routing grouped needs 1 <= --nodes-per-token <= {nodes} (nodes) and --topk <= "
                 "nodes-per-token * experts per node")
    return args


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    res = simulate(args)
    print(report(res))
    if args.markdown:
        print(markdown(res))
    mats = res.pop("_matrices")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    if not args.no_plot and _has_matplotlib():
        c = res["config"]
        routing = c["routing"] + (f" (skew {c['skew']})" if c["routing"] == "zipf" else "")
        tr = args.plot_transport
        what = "(two stages)" if len(mats[tr]) > 1 else ""
        heatmap(args.plot, mats[tr],
                f"{tr} dispatch: bytes each source sends each destination {what}\n"
                f"{c['ranks']} ranks ({c['ranks_per_node']} a node), {c['experts']} experts, "
                f"top-{c['topk']}, {c['tokens']} tokens/rank, hidden {c['hidden']} {c['dtype']}, "
                f"{routing} routing", args.ranks_per_node,
                res["transports"][tr]["dispatch"]["stages"])
        print(f"wrote {args.plot} (--no-plot to skip)")
    return 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no heatmap: matplotlib is not installed (pip install 'epkit[plot]'; --no-plot to skip)")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
