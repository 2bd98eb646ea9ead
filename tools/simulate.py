"""``epkit simulate``: the reference as a traffic planner for groups far larger than one machine.

No process group and no token payload: for ``R`` ranks (up to 1024 and beyond), ``E`` experts,
top-``K``, ``T`` tokens per rank and a routing distribution, it draws the routing rank block by
rank block, keeps only the count words every rank would all-gather
(``[tokens_per_expert (E) | tokens_per_rank (R)]``, exactly ``reference.transport.count_words``),
and hands them to the reference's own plan and byte accounting
(``reference.transport.plan``, ``dispatch_bytes_of``, ``combine_bytes_of``: the functions behind
``epkit.reference.dispatch_bytes`` / ``combine_bytes``). It prints, for pairs and dedup, the
bytes each rank sends (max and mean), expert load imbalance, the slots a capacity factor drops,
and a predicted dispatch and combine time from the bandwidth model below. For the hier
transport, whose counts need each token's kept slots per rank and node (not in the count
words), it also keeps, per source rank, ``reference.hier.NodeCounts`` (tokens with one / two or
more kept slots per rank and per node, kept slots per rank), vectorized and equal to
``reference.hier.node_counts``, and asks ``reference.hier.plan``, ``dispatch_bytes_of`` and
``combine_bytes_of`` for its two stages' bytes.

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

Bandwidth model (documented in docs/benchmarks.md): ranks sit ``--ranks-per-node`` to a node.
Each rank has an intra-node link of ``--intra-gbps`` and an inter-node link of ``--inter-gbps``
(GB/s, each direction, full duplex), used at the same time. For an exchange with byte matrix
``B[s, d]`` (the diagonal, a local copy, costs nothing), rank ``r`` needs
``t_intra_r = max(intra_out_r, intra_in_r) / intra`` on its intra-node link and
``t_inter_r = max(inter_out_r, inter_in_r) / inter`` on its inter-node link; the two tiers run
concurrently, so ``t_r = max(t_intra_r, t_inter_r)``, and the exchange ends with the slowest
rank: ``t = latency + max_r t_r``. The report gives each tier's own time too (``intra_ms =
max_r t_intra_r``, ``inter_ms = max_r t_inter_r``). A pass of several stages that depend on
each other (hier: the inter-node stage, then the intra-node one) costs the sum of its stages'
times, each with its latency (no pipelining between the stages is modelled). An all-to-all's
duration under ideal scheduling; congestion, incast and message rate are not modelled.

Capacity: ``--capacity-factor F`` sets ``C = ceil(F * R * T * K / E)`` slots per expert,
group-wide (epkit's capacity: the first ``C`` slots in (source rank, token) order are kept).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Optional, Sequence

import numpy as np

from epkit.reference.accounting import combine_bytes_of, dispatch_bytes_of, plan
from epkit.reference.dtypes import FLOAT_DTYPES
from epkit.reference.fast import count_words, count_words_block
from epkit.reference.records import Group
from epkit.reference.transports import hier

ROUTINGS = ("uniform", "zipf", "hot", "grouped")
TRANSPORTS = ("pairs", "dedup", "hier")
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


def kept_block(idx: np.ndarray, before: np.ndarray, capacity: Optional[int]) -> np.ndarray:
    """The kept mask ``[n, K] bool`` of consecutive ranks' routing (rows in (rank, token)
    order), given ``before [E]``, the used slots of every expert on the ranks before them, which
    it advances: a slot is kept iff the used slots to its expert before it, in (rank, token)
    order, are fewer than ``capacity`` (reference.capacity)."""
    used = idx >= 0
    e = idx[used]
    if capacity is None:
        np.add.at(before, e, 1)
        return used
    order = np.argsort(e, kind="stable")          # slots of one expert stay in (rank, token) order
    first = np.searchsorted(e[order], e[order], side="left")
    place = np.empty(len(e), np.int64)
    place[order] = np.arange(len(e)) - first
    kept = np.zeros(idx.shape, bool)
    kept[used] = before[e] + place < capacity
    before += np.bincount(e, minlength=len(before))
    return kept


def _repeats(col: np.ndarray):
    """Per slot of ``col [n, K]`` (-1: none): (first of its value in the row, second of it)."""
    seen = np.zeros(col.shape, np.int64)
    for k in range(1, col.shape[1]):
        seen[:, k] = (col[:, :k] == col[:, k:k + 1]).sum(axis=1)
    valid = col >= 0
    return valid & (seen == 0), valid & (seen == 1)


def node_counts_block(idx: np.ndarray, kept: np.ndarray, tokens: Sequence[int], R: int, E: int,
                      G: int) -> dict:
    """``reference.hier.NodeCounts``'s rows of consecutive ranks, vectorized: a dict of
    ``[len(tokens), R]`` / ``[len(tokens), R / G]`` int64 arrays."""
    n_ranks, L, N = len(tokens), E // R, R // G
    owner = np.repeat(np.arange(n_ranks, dtype=np.int64), np.asarray(tokens, np.int64))[:, None]
    dest = np.where(kept, idx // L, -1)
    node = np.where(kept, dest // G, -1)
    out = {}
    for name, col, width in (("", dest, R), ("node_", node, N)):
        first, second = _repeats(col)
        key = owner * width + col
        count = lambda m: np.bincount(key[m], minlength=n_ranks * width).reshape(n_ranks, width)
        out[name + "tokens"], out[name + "multi"] = count(first), count(second)
        if not name:
            out["slots"] = count(col >= 0)
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
        kept = kept_block(idx, before, capacity)
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


# ---- traffic and the bandwidth model -----------------------------------------------------

def traffic(words: np.ndarray, E: int, K: int, H: int, dtype="bfloat16", transport="dedup",
            exchange="ragged", capacity: Optional[int] = None):
    """``(dispatch [R, R], combine [R, R])`` bytes rank s sends rank d, from the count words,
    through the reference's plan and byte accounting."""
    stages = traffic_stages(words, E, K, H, dtype, transport, exchange, capacity)
    return sum(stages["dispatch"]), sum(stages["combine"])


def traffic_stages(words: np.ndarray, E: int, K: int, H: int, dtype="bfloat16",
                   transport="dedup", exchange="ragged", capacity: Optional[int] = None,
                   ranks_per_node: int = 1, node_counts: Optional[hier.NodeCounts] = None) -> dict:
    """``{"dispatch": [B...], "combine": [B...]}``: each pass's exchanges in the order they run,
    each an [R, R] int64 byte matrix (pairs, dedup: one exchange a pass; hier: stage 1 then
    stage 2, and back, from ``node_counts``)."""
    R = words.shape[0]
    dtype = _dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    group = Group(R, E, H, K, dtype, 1, capacity, None, transport, exchange, None, ranks_per_node)
    if transport == "hier":
        p = hier.plan(group, node_counts)
        return {"dispatch": hier.dispatch_bytes_of(group, p),
                "combine": hier.combine_bytes_of(group, p)}
    if transport == "dedup" and node_counts is not None:
        # the exact dedup plan: the kept token rows (what the count exchange's second
        # all-gather carries under capacity) and the single-slot ones (the way back's raw rows)
        p = plan(group, words, node_counts.tokens, node_counts.tokens - node_counts.multi)
    else:  # from the count words alone: for dedup an upper bound (Plan.exact False)
        p = plan(group, words)
    return {"dispatch": [dispatch_bytes_of(group, p)], "combine": [combine_bytes_of(group, p)]}


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


def tier_seconds(B: np.ndarray, ranks_per_node: int, intra_gbps: float, inter_gbps: float):
    """Per rank, ``(t_intra_r, t_inter_r)`` seconds (module docstring): each tier's busier
    direction over that tier's link."""
    intra, inter = split_tiers(B, ranks_per_node)
    return (np.maximum(intra.sum(1), intra.sum(0)) / (intra_gbps * 1e9),
            np.maximum(inter.sum(1), inter.sum(0)) / (inter_gbps * 1e9))


def predict_seconds(B: np.ndarray, ranks_per_node: int, intra_gbps: float, inter_gbps: float,
                    latency_us: float = 0.0):
    """The bandwidth model of the module docstring for one exchange: ``(t, per-rank t_r)``
    seconds, the two tiers concurrent."""
    t_intra, t_inter = tier_seconds(B, ranks_per_node, intra_gbps, inter_gbps)
    t_r = np.maximum(t_intra, t_inter)
    return latency_us * 1e-6 + float(t_r.max()), t_r


def price(stages, ranks_per_node: int, intra_gbps: float, inter_gbps: float,
          latency_us: float = 0.0) -> dict:
    """A pass of exchanges run one after the other: ``predicted_ms`` (the sum of each
    exchange's :func:`predict_seconds`), ``intra_ms`` / ``inter_ms`` (the sum over exchanges of
    the slowest rank's time on that tier alone)."""
    out = {"predicted_ms": 0.0, "intra_ms": 0.0, "inter_ms": 0.0}
    for B in stages:
        t, _ = predict_seconds(B, ranks_per_node, intra_gbps, inter_gbps, latency_us)
        t_intra, t_inter = tier_seconds(B, ranks_per_node, intra_gbps, inter_gbps)
        out["predicted_ms"] += 1e3 * t
        out["intra_ms"] += 1e3 * float(t_intra.max())
        out["inter_ms"] += 1e3 * float(t_inter.max())
    return out


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


def _pass(stages, args) -> dict:
    return dict(byte_stats(sum(stages), args.ranks_per_node),
                **price(stages, args.ranks_per_node, args.intra_gbps, args.inter_gbps,
                        args.latency_us))


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
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
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
    for tr in TRANSPORTS:
        stages = traffic_stages(words, E, K, H, args.dtype, tr, args.exchange, capacity,
                                args.ranks_per_node, nodes)
        mats[tr] = sum(stages["dispatch"])
        out["transports"][tr] = {ph: _pass(stages[ph], args) for ph in ("dispatch", "combine")}
    if capacity is not None:
        from epkit.reference.capacity import kept_counts

        kept = int(kept_counts(counts, capacity).sum())
        out["dropped"] = {"slots": used - kept, "fraction": (used - kept) / max(used, 1)}
    else:
        out["dropped"] = {"slots": 0, "fraction": 0.0}
    out["tokens_per_rank_mean_distinct_ranks"] = float(words[:, E:].sum() / (R * T)) if T else 0.0
    out["seconds"] = {"routing_and_counts": t_draw, "total": time.perf_counter() - t0}
    out["_matrices"] = mats
    return out


# ---- report --------------------------------------------------------------------------------

def _mb(v: float) -> str:
    return f"{v / 1e6:,.1f}"


def _gb(v: float) -> str:
    return f"{v / 1e9:,.2f}"


def report(res: dict) -> str:
    c = res["config"]
    lines = [f"epkit simulate: {c['ranks']} ranks ({c['ranks_per_node']} per node, intra "
             f"{c['intra_gbps']} GB/s, inter {c['inter_gbps']} GB/s), {c['experts']} experts, "
             f"top-{c['topk']}, {c['tokens']} tokens/rank, hidden {c['hidden']}, {c['dtype']}, "
             f"routing {c['routing']}" + (f" (skew {c['skew']})" if c["routing"] == "zipf" else "")
             + (f" (expert {c['hot_expert']} in {c['hot_fraction']:.0%} of tokens)"
                if c["routing"] == "hot" else "")
             + (f" ({c['nodes_per_token']} nodes per token)" if c["routing"] == "grouped" else "")
             + f", {c['exchange']} exchange"]
    el, rl = res["expert_load"], res["rank_load"]
    lines.append(f"expert load: max {el['max']:,} mean {el['mean']:,.1f} slots "
                 f"(imbalance {el['imbalance_max_over_mean']:.2f}); rank load imbalance "
                 f"{rl['imbalance_max_over_mean']:.2f}; a token visits "
                 f"{res['tokens_per_rank_mean_distinct_ranks']:.2f} ranks on average")
    if res["capacity"] is not None:
        lines.append(f"capacity {res['capacity']:,} slots per expert (factor "
                     f"{c['capacity_factor']}): dropped {res['dropped']['slots']:,} slots "
                     f"({res['dropped']['fraction']:.2%})")
    lines.append(f"  {'transport':<10}{'pass':<10}{'max MB out':>12}{'max MB in':>12}"
                 f"{'inter GB':>11}{'intra GB':>11}{'inter ms':>10}{'intra ms':>10}"
                 f"{'predicted ms':>14}")
    for tr, d in res["transports"].items():
        for ph in ("dispatch", "combine"):
            s = d[ph]
            lines.append(f"  {tr:<10}{ph:<10}{_mb(s['max_bytes_per_rank']):>12}"
                         f"{_mb(s['max_bytes_received']):>12}{_gb(s['inter_node_bytes']):>11}"
                         f"{_gb(s['intra_node_bytes']):>11}{s['inter_ms']:>10.3f}"
                         f"{s['intra_ms']:>10.3f}{s['predicted_ms']:>14.3f}")
    lines.append("(MB: per rank, to / from other ranks; GB: the whole group's bytes over "
                 "inter-node and intra-node pairs; ms: the slowest rank on that tier alone, "
                 "and the predicted pass, tiers concurrent, stages in sequence; the local copy "
                 f"is left out; {res['seconds']['total']:.1f} s)")
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


def _relative(B: np.ndarray):
    """``(off, mean, rel)``: the bytes without the diagonal, the mean off-diagonal pair, and
    every pair divided by that mean."""
    R = B.shape[0]
    off = B.astype(np.float64).copy()
    np.fill_diagonal(off, 0.0)
    mean = off.sum() / max(1, R * (R - 1))
    return off, mean, (off / mean if mean > 0 else off)


def heatmap_caption(B: np.ndarray) -> str:
    """The heatmap's caption: what to look for, and how much of it this matrix holds."""
    R = B.shape[0]
    off, mean, rel = _relative(B)
    cols, rows = off.sum(0), off.sum(1)
    hot_col, hot_row = int(cols.argmax()), int(rows.argmax())
    cmean, rmean = cols.mean() or 1.0, rows.mean() or 1.0
    spread = float(np.percentile(np.abs(rel[~np.eye(R, dtype=bool)] - 1), 90)) if R > 1 else 0.0
    return (f"What to look for: a red column is a destination rank receiving more than its "
            f"share (hot experts), a red row a source sending more; pale means even.\n"
            f"Here: hottest destination rank {hot_col} receives ×{cols[hot_col] / cmean:.2f} "
            f"the mean; busiest source rank {hot_row} sends ×{rows[hot_row] / rmean:.2f}; "
            f"90 % of pairs lie within ±{100 * spread:.0f} % of the mean pair. Grey: the "
            "diagonal (a local copy, not sent) and empty pairs.")


def heatmap(path: str, B: np.ndarray, title: str, ranks_per_node: int) -> None:
    """The ``[R, R]`` byte matrix as each pair's bytes relative to the mean pair: a diverging
    colour scale centred on the mean (white), logarithmic and symmetric (``×1/m`` to ``×m``, at
    least ``×0.8`` to ``×1.25``), ticks at round factors (:func:`relative_ticks`); the diagonal
    (a local copy) and empty pairs grey; node boundaries drawn and labelled; a caption saying
    what to look for and naming the hottest column and row (:func:`heatmap_caption`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    R = B.shape[0]
    _, mean, rel = _relative(B)
    data = np.ma.masked_less_equal(rel, 0.0)
    m = max(1.25, float(data.max()) if data.count() else 1.0,
            1.0 / float(data.min()) if data.count() else 1.0)
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.8")
    fig = plt.figure(figsize=(7.6, 7.4), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(data, cmap=cmap, norm=LogNorm(vmin=1 / m, vmax=m), interpolation="nearest")
    cb = fig.colorbar(im, ax=ax, shrink=0.82, pad=0.02)
    ticks = relative_ticks(m)
    cb.ax.yaxis.set_major_locator(FixedLocator(ticks))
    cb.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _times(v)))
    cb.ax.yaxis.set_minor_locator(NullLocator())
    cb.set_label(f"bytes sent / the mean pair's {mean / 1e6:,.2f} MB (log scale; white = mean)")
    nodes = R // ranks_per_node if 1 < ranks_per_node < R and R % ranks_per_node == 0 else 0
    if nodes:
        if nodes <= 64:
            alpha = 0.5 if nodes <= 16 else 0.25
            for b in range(ranks_per_node, R, ranks_per_node):
                ax.axhline(b - 0.5, color="black", lw=0.5, alpha=alpha)
                ax.axvline(b - 0.5, color="black", lw=0.5, alpha=alpha)
        every = max(1, math.ceil(nodes / 16))  # at most 16 node labels per axis
        centres = [n * ranks_per_node + (ranks_per_node - 1) / 2 for n in range(0, nodes, every)]
        labels = [f"node {n}" if nodes <= 8 else str(n) for n in range(0, nodes, every)]
        starts = list(range(0, R, ranks_per_node * every))
        ax.set_xticks(starts, [str(v) for v in starts])
        ax.set_yticks(starts, [str(v) for v in starts])
        top = ax.secondary_xaxis("top")
        top.set_xticks(centres, labels, fontsize=7)
        top.tick_params(length=0)
        right = ax.secondary_yaxis("right")
        right.set_yticks(centres, labels, fontsize=7)
        right.tick_params(length=0)
        node_word = f"nodes of {ranks_per_node} ranks" + (" (every %d labelled)" % every if every > 1 else "")
        top.set_xlabel(node_word, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set(xlabel="destination rank", ylabel="source rank")
    fig.suptitle(title, fontsize=10)
    caption = heatmap_caption(B)
    fig.text(0.01, 0.005, caption, fontsize=7.5, ha="left", va="bottom", wrap=True)
    fig.get_layout_engine().set(rect=(0, 0.075, 1, 0.925))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                    help="routing distribution (see above)")
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
    ap.add_argument("--intra-gbps", type=float, default=150.0, help="GB/s per rank and link, each way")
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per rank and link, each way")
    ap.add_argument("--latency-us", type=float, default=0.0, help="fixed cost per exchange")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="capacity C = ceil(F * R * T * K / E) slots per expert (default: none)")
    ap.add_argument("--exchange", choices=["ragged", "padded"], default="ragged",
                    help="exchange whose bytes are counted")
    ap.add_argument("--seed", type=int, default=0, help="seed of the routing")
    ap.add_argument("--json", metavar="PATH", help="write the report's figures here")
    ap.add_argument("--plot", metavar="PATH", help="PNG heatmap of the rank x rank dispatch bytes")
    ap.add_argument("--plot-transport", choices=list(TRANSPORTS), default="dedup",
                    help="whose dispatch bytes --plot shows")
    return ap


def parse_args(argv):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.experts % args.ranks:
        ap.error("--experts must be a positive multiple of --ranks")
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
    mats = res.pop("_matrices")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        c = res["config"]
        routing = c["routing"] + (f" (skew {c['skew']})" if c["routing"] == "zipf" else "")
        heatmap(args.plot, mats[args.plot_transport],
                f"{args.plot_transport} dispatch: bytes each source rank sends each destination "
                f"rank\n{c['ranks']} ranks, {c['experts']} experts, top-{c['topk']}, "
                f"{c['tokens']} tokens/rank, hidden {c['hidden']} {c['dtype']}, {routing} routing",
                args.ranks_per_node)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
