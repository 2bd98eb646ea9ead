"""The hier transport (reference/transports/hier.py) and the grouped summation order (ranks_per_node)."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit import reference as ref
from epkit.reference.transports import hier
from epkit.reference.arith import grouped_total_sum, total_sum
from epkit.reference.capacity import kept_mask
from epkit.reference.records import Group
from refcases import F32, assert_lists_bitwise, assert_results_bitwise, bits, cases

EXCHANGES = ("ragged", "padded", "equal", "static", "auto")


def divisors(R):
    return [g for g in range(1, R + 1) if R % g == 0]


def passes(case, res, ys, go, weighted):
    return (ref.combine(ys, res, weighted), ref.dispatch_backward(ys, res),
            ref.combine_backward(go, ys, res, weighted))


def assert_passes_bitwise(got, want, what):
    assert_lists_bitwise(got[0], want[0], f"{what} combine")
    assert_lists_bitwise(got[1], want[1], f"{what} dispatch_backward")
    assert_lists_bitwise(got[2][0], want[2][0], f"{what} grad expert_y")
    assert_lists_bitwise(got[2][1], want[2][1], f"{what} grad weights")


@settings(max_examples=60, deadline=None)
@given(cases(payloads=(None, None, "mxfp8", "fp8_block128")), st.data())
def test_hier_equals_pairs_and_dedup_bit_for_bit(case, data):
    """Same ranks_per_node: canonical, pairs, dedup and hier give the same expert-major and
    rank-major arrays, combine, dispatch backward and combine backward, bit for bit; hier's
    exchanges move exactly what its byte accounting says."""
    G = data.draw(st.sampled_from(divisors(case.R)), "ranks_per_node")
    ex = data.draw(st.sampled_from(EXCHANGES), "exchange")
    weighted = data.draw(st.booleans(), "weighted")
    max_t = max(x.shape[0] for x in case.xs) + case.seed % 2
    kw = case.kw(rank_major=True, ranks_per_node=G)
    base = ref.dispatch(case.xs, case.idx, case.ws, **kw)
    y_dtype = data.draw(st.sampled_from((F32, ref.dtypes.BFLOAT16)), "y dtype")
    ys = case.rows_like([r.expert_x.shape for r in base], y_dtype, salt=3)
    go = case.rows_like([x.shape for x in case.xs], case.dtype, salt=4)
    want = passes(case, base, ys, go, weighted)
    for tr in ("pairs", "dedup", "hier"):
        args = dict(kw, transport=tr, exchange=ex, max_tokens_per_rank=max_t)
        try:
            res = ref.dispatch(case.xs, case.idx, case.ws, **args)
        except ref.InputError as err:       # only equal may refuse, on a non-uniform plan
            assert ex == "equal" and err.code == ref.Reason.EQUAL_NONUNIFORM
            continue
        assert_results_bitwise(base, res)
        assert_passes_bitwise(passes(case, res, ys, go, weighted), want, f"{tr}/{ex}/G={G}")
    if ex == "equal":
        return
    group = Group(case.R, case.E, case.H, case.K, case.dtype, case.align, case.capacity,
                  case.payload, "hier", ex, max_t, G)
    p = res[0].wire.plan
    assert np.array_equal(np.stack([r.bytes_sent for r in res]),
                          sum(hier.dispatch_bytes_of(group, p)))
    for want_m, got_m in zip(hier.dispatch_bytes_of(group, p), res[0].wire.moved):
        assert np.array_equal(want_m, got_m)
    _, moved = hier.reduce_back(res, ys, weighted)
    for want_m, got_m in zip(hier.combine_bytes_of(group, p, y_dtype), moved):
        assert np.array_equal(want_m, got_m)


@st.composite
def order_cases(draw):
    """Groups of several nodes, every token with 2 to 8 slots and expert outputs spread over 48
    binades, so that almost every change of summation order changes bits."""
    R = draw(st.sampled_from([2, 4, 6, 8]))
    G = draw(st.sampled_from([g for g in divisors(R) if g > 1]))
    L = draw(st.integers(1, 3))
    K = draw(st.integers(2, min(R * L, 8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Ts = [int(rng.integers(0, 5)) for _ in range(R)]
    idx = [np.argsort(rng.random((T, R * L)), axis=1)[:, :K].astype(np.int64) for T in Ts]
    ws = [rng.uniform(0.5, 2, (T, K)).astype(F32) for T in Ts]
    xs = [np.ones((T, 2), F32) for T in Ts]
    cap = draw(st.sampled_from([None, None, 1, 3]))
    return R, G, R * L, xs, idx, ws, cap, rng


@settings(max_examples=60, deadline=None)
@given(order_cases(), st.sampled_from((F32, ref.dtypes.BFLOAT16)), st.booleans())
def test_every_transport_sums_in_the_grouped_order(c, y_dtype, weighted):
    """With wide-range expert outputs the grouped order matters; canonical, pairs, dedup and
    hier agree bit for bit on it (combine and dispatch backward), node partials included."""
    R, G, E, xs, idx, ws, cap, rng = c
    base = ref.dispatch(xs, idx, ws, num_experts=E, capacity=cap, ranks_per_node=G)
    ys = [(rng.standard_normal(r.expert_x.shape) * 2.0 ** rng.integers(-24, 24, r.expert_x.shape))
          .astype(y_dtype) for r in base]
    want = ref.combine(ys, base, weighted), ref.dispatch_backward(ys, base)
    for tr in ("pairs", "dedup", "hier"):
        res = ref.dispatch(xs, idx, ws, num_experts=E, capacity=cap, ranks_per_node=G,
                           transport=tr, exchange="ragged")
        assert_lists_bitwise(ref.combine(ys, res, weighted), want[0], f"{tr} combine")
        assert_lists_bitwise(ref.dispatch_backward(ys, res), want[1], f"{tr} dispatch_backward")


def inter_node(B, G):
    node = np.arange(B.shape[0]) // G
    return np.where(node[:, None] != node[None, :], B, 0)


@settings(max_examples=80, deadline=None)
@given(cases(payloads=(None, None, "mxfp8", "fp8_block128")), st.data())
def test_hier_never_moves_more_inter_node_bytes_than_pairs(case, data):
    """Ragged exchange, with capacity: per source and remote node, hier's stage 1 moves
    ``rows * (P + 8) + slots * 8`` against pairs' ``slots * (P + 16)`` to that node's ranks, and
    its combine ``min(n, u)`` rows per token row against pairs' n; so in both passes hier's
    inter-node bytes never exceed pairs', pair of nodes by pair of nodes."""
    G = data.draw(st.sampled_from(divisors(case.R)), "ranks_per_node")
    y_dtype = data.draw(st.sampled_from((F32, ref.dtypes.BFLOAT16)), "y dtype")
    kw = dict(num_experts=case.E, hidden=case.H, dtype=case.dtype, payload=case.payload,
              exchange="ragged", capacity=case.capacity)
    pairs_d = ref.dispatch_bytes(case.idx, transport="pairs", **kw)
    pairs_c = ref.combine_bytes(case.idx, transport="pairs", **dict(kw, dtype=y_dtype, payload=None))
    R, N = case.R, case.R // G
    group = Group(R, case.E, case.H, case.K, case.dtype, 1, case.capacity, case.payload, "hier",
                  "ragged", None, G)
    kept = kept_mask(case.idx, case.E, case.capacity)
    p = hier.plan(group, hier.node_counts(case.idx, kept, R, case.E, G))
    disp, comb = hier.dispatch_bytes_of(group, p), hier.combine_bytes_of(group, p, y_dtype)
    hd, hc = sum(inter_node(B, G) for B in disp), sum(inter_node(B, G) for B in comb)
    fold = lambda B: B.reshape(N, G, N, G).sum(axis=(1, 3))          # bytes node -> node
    assert (fold(hd) <= fold(inter_node(pairs_d, G))).all()
    assert (fold(hc) <= fold(inter_node(pairs_c, G))).all()
    assert (inter_node(disp[1], G) == 0).all() and (inter_node(comb[0], G) == 0).all()


def decode_stage1(group, case, s, kept):
    """Source s's stage-1 rows, decoded: per node, token rows (t, n) and slot rows (k, j, w)."""
    rows, _ = ref.payloads.wire_rows(case.xs, None)
    sent, tok, slot = hier._stage1_send(group, rows[s], None, case.idx[s], case.ws[s], kept[s])
    P = group.payload_bytes
    toks = [struct.unpack("<ii", r[P:].tobytes()) for r in tok]
    slots = [(c >> 24, c & 0xFFFFFF, w) for c, w in (struct.unpack("<If", r.tobytes()) for r in slot)]
    return sent, toks, slots


@settings(max_examples=40, deadline=None)
@given(cases(max_ranks=6), st.data())
def test_a_token_crosses_to_each_node_at_most_once(case, data):
    G = data.draw(st.sampled_from(divisors(case.R)), "ranks_per_node")
    res = ref.dispatch(case.xs, case.idx, case.ws, transport="hier", exchange="ragged",
                       ranks_per_node=G, **case.kw())
    group = Group(case.R, case.E, case.H, case.K, case.dtype, 1, case.capacity, None, "hier",
                  "ragged", None, G)
    kept = [r.source.kept for r in res]
    stage1, stage2 = res[0].wire.moved
    GL = G * case.L
    for s in range(case.R):
        sent, toks, slots = decode_stage1(group, case, s, kept)
        assert [t for t, _ in toks] == [t for tokens in sent for t in tokens]
        for n, tokens in enumerate(sent):
            assert len(set(tokens)) == len(tokens)             # at most once per node
            want = [t for t in range(len(case.idx[s]))
                    if any(kept[s][t, k] and case.idx[s][t, k] // GL == n for k in range(case.K))]
            assert tokens == want                               # exactly those with a kept slot there
        assert sum(n for _, n in toks) == len(slots) == int(kept[s].sum())
        # stage 1 goes only to the forwarders (s's local index on each node); stage 2 stays inside
        for d in range(case.R):
            if stage1[s, d]:
                assert d % G == s % G
            if stage2[s, d]:
                assert d // G == s // G


def test_hier_wire_rows_of_a_small_case():
    """4 ranks in 2 nodes of 2, 1 expert a rank: rank 1's token 0 names experts 2 and 3 (both on
    node 1) and 0: it crosses to node 1 once, to rank 3 (local index 1), as one token row with
    n = 2 and two slot rows naming node-local experts 0 and 1; rank 3 fans it out to ranks 2
    and 3 as (s = 1, t = 0, n = 1) rows."""
    xs = [np.ones((1, 2), F32), np.array([[5, 6]], F32), np.ones((0, 2), F32), np.ones((0, 2), F32)]
    idx = [np.array([[0, -1, -1]]), np.array([[2, 0, 3]]), np.zeros((0, 3), np.int64),
           np.zeros((0, 3), np.int64)]
    ws = [np.ones((1, 3), F32), np.array([[0.5, 0.25, 0.125]], F32), np.zeros((0, 3), F32),
          np.zeros((0, 3), F32)]
    group = Group(4, 4, 2, 3, F32, 1, None, None, "hier", "ragged", None, 2)
    kept = [i >= 0 for i in idx]
    rows = [x for x in xs]
    sent, tok, slot = hier._stage1_send(group, rows[1], None, idx[1], ws[1], kept[1])
    assert sent == [[0], [0]]
    assert [np.frombuffer(r[:8].tobytes(), F32).tolist() + list(struct.unpack("<ii", r[8:].tobytes()))
            for r in tok] == [[5, 6, 0, 1], [5, 6, 0, 2]]
    assert [struct.unpack("<If", r.tobytes()) for r in slot] == [(1 << 24 | 0, 0.25),
                                                                 (0 << 24 | 0, 0.5),
                                                                 (2 << 24 | 1, 0.125)]
    res = ref.dispatch(xs, idx, ws, num_experts=4, transport="hier", exchange="ragged",
                       ranks_per_node=2)
    stage1, stage2 = res[0].wire.moved
    P = 8
    assert stage1[1].tolist() == [0, P + 8 + 8, 0, P + 8 + 2 * 8]    # itself (local), rank 3
    assert stage2[1].tolist() == [P + 12 + 8, 0, 0, 0]               # from itself to rank 0
    assert stage2[3].tolist() == [0, 0, P + 12 + 8, P + 12 + 8]      # fan-out inside node 1
    assert res[3].wire.arrivals == [(1, 0, [(0, 2, 0, np.float32(0.5)), (2, 3, 0, np.float32(0.125))])]
    assert res[3].wire.fan == [[0], [0]]
    assert res[2].row_src.tolist() == [[1, 0, 0]] and res[3].row_src.tolist() == [[1, 0, 2]]


# --- the summation order -------------------------------------------------------------------

SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 3e38, -3e38, np.inf, -np.inf, np.nan, 1e-45, -1e-45,
                    2.0 ** -24, 1e8], F32)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_grouped_order_with_one_rank_per_node_is_the_rank_by_rank_order(R, H, seed):
    """G = 1: +0.0 + N_0 + N_1 + ... with N_d = +0.0 + P_d is bitwise +0.0 + P_0 + P_1 + ...
    (-0.0, infinities, NaN, overflow and subnormals included; ranks left out as dedup does)."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(SPECIAL) + 3, size=(R, H))
    with np.errstate(over="ignore"):
        noise = (rng.standard_normal((R, H)) * 10.0 ** rng.integers(-45, 39, (R, H))).astype(F32)
    P = np.where(pick < len(SPECIAL), SPECIAL[np.minimum(pick, len(SPECIAL) - 1)], noise).astype(F32)
    present = [d for d in range(R) if rng.random() < 0.8]
    with np.errstate(over="ignore", invalid="ignore"):      # inf - inf is part of the test
        want = total_sum([P[d] for d in present], H)
        got = grouped_total_sum([(d, P[d]) for d in present], 1, H)
    assert np.array_equal(bits(got), bits(want))


def test_grouped_order_differs_from_the_flat_one_and_every_transport_follows_it():
    """P = (1e8, 1, -1e8, 1) in float32: by nodes of 2, (1e8 + 1) + (-1e8 + 1) = 1e8 - 1e8 = 0;
    rank by rank ((1e8 + 1) - 1e8) + 1 = 1. Each rank holds one expert; rank 0's one token
    names all four, so its combine is exactly that sum, and every transport must give 0 with
    ranks_per_node = 2 and 1 with ranks_per_node = 1."""
    y = [1e8, 1.0, -1e8, 1.0]
    xs = [np.ones((1, 1), F32)] + [np.ones((0, 1), F32)] * 3
    idx = [np.array([[0, 1, 2, 3]])] + [np.zeros((0, 4), np.int64)] * 3
    ws = [np.ones((1, 4), F32)] + [np.zeros((0, 4), F32)] * 3
    ys = [np.array([[v]], F32) for v in y]
    assert grouped_total_sum(enumerate(np.array(y, F32).reshape(4, 1)), 2, 1)[0] == 0
    for G, want in ((1, 1.0), (2, 0.0), (4, 1.0)):      # G = 4: one node, the flat order again
        for tr, ex in ((None, None), ("pairs", "ragged"), ("dedup", "ragged"), ("hier", "ragged")):
            res = ref.dispatch(xs, idx, ws, num_experts=4, transport=tr, exchange=ex,
                               ranks_per_node=G)
            out = ref.combine(ys, res)[0]
            assert out[0, 0] == want, (G, tr, out)
            assert ref.dispatch_backward(ys, res)[0][0, 0] == want
