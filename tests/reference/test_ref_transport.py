"""Transports x exchange variants: bit-for-bit equal to the canonical computation; bytes."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit import reference as ref
from epkit.reference import accounting, transports
from epkit.reference.capacity import kept_mask
from epkit.reference.records import Group
from refcases import F32, assert_lists_bitwise, assert_results_bitwise, cases, payload_row_bytes

EXCHANGES = ("ragged", "padded", "equal", "static", "auto")


def wire_counts(case, kept=None):
    """Worked out from the routing alone (not from the reference's plan), per (s, d): token rows
    (tokens with a kept slot on d), kept slots on d, and whether two kept slots of one token
    share d. ``kept``: R bool arrays [T, K] (None: every used slot)."""
    tok, slots, shared, _ = kept_per_token_row(case, kept)
    return tok, slots, shared


def kept_per_token_row(case, kept=None):
    """``(tok, slots, shared, ns)``: as wire_counts, and ``ns[s][d]`` the list of n (kept slots
    of the token on d) over s's token rows to d."""
    tok = np.zeros((case.R, case.R), np.int64)
    slots = np.zeros((case.R, case.R), np.int64)
    shared = np.zeros((case.R, case.R), bool)
    ns = [[[] for _ in range(case.R)] for _ in range(case.R)]
    for s in range(case.R):
        keep = case.idx[s] >= 0 if kept is None else kept[s]
        for row, krow in zip(case.idx[s], keep):
            on = [int(e) // case.L for e, k in zip(row, krow) if k]
            for d in set(on):
                tok[s, d] += 1
                ns[s][d].append(on.count(d))
            for d in on:
                slots[s, d] += 1
                shared[s, d] |= on.count(d) >= 2
    return tok, slots, shared, ns


def uniform(c):
    return bool((c == c.flat[0]).all())


def expected_dispatch_bytes(tr, variant, tok, slots, payload_bytes, max_t, K, L):
    """docs/design.md's wire format, section by section: pairs ``P + 16`` per kept slot; dedup
    ``P + 8`` per token row plus 8 per slot row; padded: each section's group-wide max rows;
    static: a header row plus ``cap`` rows per chunk and section."""
    slot_cap = None if max_t is None else max_t * min(K, L)
    tok_cap = None if max_t is None else min(max_t, slot_cap)   # a token row needs a kept slot
    sections = ([(slots, payload_bytes + 16, slot_cap)] if tr == "pairs" else
                [(tok, payload_bytes + 8, tok_cap), (slots, 8, slot_cap)])
    total = np.zeros(tok.shape, np.int64)
    for c, row, cap in sections:
        if variant in ("ragged", "equal"):
            total += c * row
        elif variant == "padded":
            total += c.max() * row
        else:
            total += (1 + cap) * row
    return total


@settings(max_examples=40, deadline=None)
@given(cases(payloads=(None, None, "mxfp8", "fp8_block128")), st.sampled_from(("pairs", "dedup")), st.booleans())
def test_transports_equal_canonical(case, tr, weighted):
    kw = case.kw(rank_major=True)
    base = ref.dispatch(case.xs, case.idx, case.ws, **kw)
    ys = case.rows_like([r.expert_x.shape for r in base], case.dtype, salt=3)
    go = case.rows_like([x.shape for x in case.xs], case.dtype, salt=4)
    want = (ref.combine(ys, base, weighted), ref.dispatch_backward(ys, base),
            ref.combine_backward(go, ys, base, weighted))
    max_t = max(x.shape[0] for x in case.xs)
    base_kept, refused = [r.source.kept for r in base], False
    for ex in EXCHANGES:
        args = dict(kw, transport=tr, exchange=ex, max_tokens_per_rank=max_t + case.seed % 2)
        try:
            res = ref.dispatch(case.xs, case.idx, case.ws, **args)
        except ref.InputError as err:       # only the equal exchange may refuse, on a non-uniform plan
            assert ex == "equal" and err.code == ref.Reason.EQUAL_NONUNIFORM
            assert not case.uniform or case.capacity is not None
            refused = True
            continue
        assert_results_bitwise(base, res)
        got = (ref.combine(ys, res, weighted), ref.dispatch_backward(ys, res),
               ref.combine_backward(go, ys, res, weighted))
        assert_lists_bitwise(got[0], want[0], f"{tr}/{ex} combine")
        assert_lists_bitwise(got[1], want[1], f"{tr}/{ex} dispatch_backward")
        assert_lists_bitwise(got[2][0], want[2][0], f"{tr}/{ex} grad expert_y")
        assert_lists_bitwise(got[2][1], want[2][1], f"{tr}/{ex} grad weights")
        # byte accounting: what the simulated exchanges moved == the formulas == the wire format
        bkw = dict(num_experts=case.E, hidden=case.H, transport=tr, exchange=ex,
                   capacity=case.capacity, payload=case.payload,
                   max_tokens_per_rank=args["max_tokens_per_rank"])
        moved = np.stack([r.bytes_sent for r in res])
        assert np.array_equal(moved, ref.dispatch_bytes(case.idx, dtype=case.dtype, **bkw))
        _, moved_back = transports.reduce_back(res, ys, weighted)
        assert np.array_equal(moved_back, ref.combine_bytes(case.idx, dtype=ys[0].dtype, **bkw))
        _, _, moved_cb = transports.combine_backward(res, go, ys, weighted)
        group = Group(case.R, case.E, case.H, case.K, go[0].dtype, case.align, case.capacity,
                      case.payload, tr, ex, args["max_tokens_per_rank"])
        want_cb = accounting.combine_backward_bytes_of(group, res[0].wire.plan, weighted)
        assert len(moved_cb) == len(want_cb) == (2 if weighted and case.K else 1)
        for got_m, want_m in zip(moved_cb, want_cb):
            assert np.array_equal(got_m, want_m), (tr, ex, got_m, want_m)
        tok, slots, _ = wire_counts(case, [r.source.kept for r in res])
        sections = (slots,) if tr == "pairs" else (tok, slots)
        variant = res[0].wire.plan.variant
        assert variant == (ex if ex != "auto" else
                           "equal" if all(uniform(c) for c in sections) else "ragged")
        payload_bytes = payload_row_bytes(case.payload, case.H, case.dtype.itemsize)
        assert np.array_equal(moved, expected_dispatch_bytes(
            tr, variant, tok, slots, payload_bytes, args["max_tokens_per_rank"], case.K, case.L))
    # equal refuses exactly the plans with a section that is not uniform
    tok, slots, _ = wire_counts(case, base_kept)
    sections = (slots,) if tr == "pairs" else (tok, slots)
    assert refused == (not all(uniform(c) for c in sections))


@settings(max_examples=15, deadline=None)
@given(cases(uniform=True, capacity=False), st.sampled_from(("pairs", "dedup")))
def test_uniform_plans_take_the_equal_exchange(case, tr):
    res = ref.dispatch(case.xs, case.idx, case.ws, transport=tr, exchange="equal", **case.kw())
    assert_results_bitwise(ref.dispatch(case.xs, case.idx, case.ws, **case.kw()), res)
    assert res[0].wire.plan.variant == "equal"
    auto = ref.dispatch(case.xs, case.idx, case.ws, transport=tr, exchange="auto", **case.kw())
    assert auto[0].wire.plan.variant == "equal"


def test_equal_on_nonuniform_plan_raises():
    xs = [np.ones((2, 4), F32), np.ones((1, 4), F32)]
    idx = [np.array([[0], [1]]), np.array([[0]])]
    ws = [np.ones((2, 1), F32), np.ones((1, 1), F32)]
    with pytest.raises(ref.InputError) as err:
        ref.dispatch(xs, idx, ws, num_experts=2, transport="dedup", exchange="equal")
    assert err.value.code == ref.Reason.EQUAL_NONUNIFORM and err.value.rank == 1  # counts [[1,1],[1,0]]
    assert str(err.value) == "epkit: rank 1: exchange='equal' needs a uniform plan (every count the same)"
    auto = ref.dispatch(xs, idx, ws, num_experts=2, transport="dedup", exchange="auto")
    assert auto[0].wire.plan.variant == "ragged"


@settings(max_examples=150, deadline=None)
@given(cases(payloads=(None, None, "mxfp8", "fp8_block128")), st.sampled_from(EXCHANGES))
def test_dedup_never_sends_more_bytes_than_pairs(case, ex):
    """Capacity or not, per (s, d): dedup's dispatch moves ``rows * (P + 8) + slots * 8``
    against pairs' ``slots * (P + 16)``, and every token row has a kept slot (``rows <= slots``);
    strictly fewer whenever two of a token's kept slots share d (ragged / equal: on that (s, d);
    padded: exactly when the token section's max is below the slot section's). Its combine moves
    ``min(n, per)`` rows of y's dtype per token row with n kept slots (``per = 4 / itemsize``)
    against pairs' n: strictly fewer where a token row has ``n > per``; float32 and bfloat16."""
    max_t = max(x.shape[0] for x in case.xs) + case.seed % 2
    kw = dict(num_experts=case.E, hidden=case.H, dtype=case.dtype, payload=case.payload,
              exchange=ex, max_tokens_per_rank=max_t, capacity=case.capacity)
    kept = ref.capacity.kept_mask(case.idx, case.E, case.capacity)
    tok, slots, shared, ns = kept_per_token_row(case, kept)
    try:
        dedup = ref.dispatch_bytes(case.idx, transport="dedup", **kw)
    except ref.InputError as err:           # equal needs both of dedup's sections uniform
        assert ex == "equal" and err.code == ref.Reason.EQUAL_NONUNIFORM
        assert not (uniform(tok) and uniform(slots))
        return
    pairs = ref.dispatch_bytes(case.idx, transport="pairs", **kw)   # uniform slots: pairs too
    assert (tok <= slots).all()
    assert np.array_equal(dedup, ref.fast.dispatch_bytes(case.idx, transport="dedup", **kw))
    P = payload_row_bytes(case.payload, case.H, case.dtype.itemsize)
    assert (dedup <= pairs).all(), (dedup, pairs)
    variant = ex if ex != "auto" else "equal" if uniform(tok) and uniform(slots) else "ragged"
    if variant in ("ragged", "equal"):
        assert np.array_equal(dedup, tok * (P + 8) + slots * 8)
        assert np.array_equal(dedup < pairs, shared)
    elif variant == "padded":
        assert (dedup < pairs).all() == (tok.max() < slots.max())
    elif shared.any():
        assert (dedup < pairs).all()
    for ydt in (F32, ref.dtypes.BFLOAT16):   # combine: expert_y float32 or bfloat16
        per = 4 // ydt.itemsize
        ckw = dict(kw, payload=None, dtype=ydt)
        cd = ref.combine_bytes(case.idx, transport="dedup", **ckw)
        cp = ref.combine_bytes(case.idx, transport="pairs", **ckw)
        assert np.array_equal(cd, ref.fast.combine_bytes(case.idx, transport="dedup", **ckw))
        assert (cd <= cp).all(), (ydt, cd, cp)
        units = np.array([[sum(min(n, per) for n in ns[s][d]) for d in range(case.R)]
                          for s in range(case.R)], np.int64)
        more = np.array([[any(n > per for n in ns[s][d]) for d in range(case.R)]
                         for s in range(case.R)])
        if variant == "ragged":
            assert np.array_equal(cd, units.T * case.H * ydt.itemsize)
            assert np.array_equal(cd < cp, more.T)
        if variant in ("ragged", "equal"):
            assert np.array_equal(cp, slots.T * case.H * ydt.itemsize)


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from(EXCHANGES))
def test_dedup_combine_backward_never_moves_more_bytes_than_pairs(case, ex):
    """Capacity or not, per (s, d): the combine backward's gradient rows forward are dedup's
    token rows against pairs' kept slots, ``H * itemsize(g)`` bytes each, so never more, and
    fewer exactly where pairs' count is larger (ragged / equal: where a token row has n >= 2;
    padded: when the token section's max is below the slot section's; static: whenever
    ``min(K, L) >= 2`` and the chunk holds a token); its weight gradients back are one float32
    per kept slot in the slot rows' order, exactly pairs' bytes in every variant."""
    max_t = max(x.shape[0] for x in case.xs) + case.seed % 2
    kept = kept_mask(case.idx, case.E, case.capacity)
    tok, slots, shared, _ = kept_per_token_row(case, kept)
    moved = {}
    for tr in ("pairs", "dedup"):
        group = Group(case.R, case.E, case.H, case.K, case.dtype, case.align, case.capacity,
                      None, tr, ex, max_t)
        try:
            p = accounting.wire_plan(group, case.idx, kept)
        except ref.InputError as err:       # equal: pairs needs its rows uniform, dedup both sections
            assert ex == "equal" and err.code == ref.Reason.EQUAL_NONUNIFORM
            assert not (uniform(tok) and uniform(slots))
            return
        moved[tr] = accounting.combine_backward_bytes_of(group, p, weighted=True)
        variant = p.variant
        unweighted = accounting.combine_backward_bytes_of(group, p, weighted=False)
        assert len(unweighted) == 1 and np.array_equal(unweighted[0], moved[tr][0])
        if case.K == 0:                     # no slot, no weight gradient
            assert len(moved[tr]) == 1
            moved[tr].append(np.zeros((case.R, case.R), np.int64))
    (grad_p, wgrad_p), (grad_d, wgrad_d) = moved["pairs"], moved["dedup"]
    B = case.H * case.dtype.itemsize
    assert (grad_d <= grad_p).all(), (grad_d, grad_p)
    assert np.array_equal(wgrad_d, wgrad_p), (wgrad_d, wgrad_p)
    if variant in ("ragged", "equal"):
        assert np.array_equal(grad_d, tok * B) and np.array_equal(grad_p, slots * B)
        assert np.array_equal(grad_d < grad_p, shared)
        assert np.array_equal(wgrad_d, slots.T * 4)
    elif variant == "padded":
        assert (grad_d < grad_p).all() == (tok.max() < slots.max())
        assert (wgrad_d == slots.max() * 4).all()
    else:
        per = min(case.K, case.L)
        assert (grad_d < grad_p).all() == (per >= 2 and max_t >= 1)
        assert (wgrad_d == (case.K > 0) * (2 + max_t * per) * 4).all()  # 8-byte count: 2 rows


def test_dedup_fewer_bytes_when_experts_share_a_rank():
    # 2 ranks, 8 experts (4 per rank), every token's 4 experts all on one rank: dedup sends each
    # token's payload once (P + 8 bytes) plus four 8-byte slot rows, pairs four P + 16 rows.
    idx = [np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), np.array([[7, 6, 5, 4]])]
    kw = dict(num_experts=8, hidden=256, dtype="bfloat16", exchange="ragged")
    dedup = ref.dispatch_bytes(idx, transport="dedup", **kw)
    pairs = ref.dispatch_bytes(idx, transport="pairs", **kw)
    assert dedup.tolist() == [[512 + 8 + 4 * 8] * 2, [0, 512 + 8 + 4 * 8]]
    assert pairs.tolist() == [[4 * (512 + 16)] * 2, [0, 4 * (512 + 16)]]
    # static (max 2 tokens): token chunk 1 + 2 rows, slot chunk 1 + 2 * min(4, 4) rows
    st_kw = dict(kw, exchange="static", max_tokens_per_rank=2)
    assert (ref.dispatch_bytes(idx, transport="dedup", **st_kw) == 3 * 520 + 9 * 8).all()
    assert (ref.dispatch_bytes(idx, transport="pairs", **st_kw) == 9 * 528).all()
    # padded: token rows pad to 1, slot rows to 4
    pd_kw = dict(kw, exchange="padded")
    assert (ref.dispatch_bytes(idx, transport="dedup", **pd_kw) == 520 + 4 * 8).all()


def _decode_dedup(group, s, xs, idx, ws, kept):
    """Rank s's dedup sections, decoded: per peer, token rows (x, t, n) and slot rows (k, j, w)."""
    send, (token_rows, slot_rows) = transports.of("dedup").send(group, s, xs[s], None, idx[s], ws[s], kept[s])
    P = group.payload_bytes
    assert token_rows.shape[1] == P + 8 and slot_rows.shape[1] == 8
    toks = [(np.frombuffer(r[:P].tobytes(), F32).tolist(),) + struct.unpack("<ii", r[P:].tobytes())
            for r in token_rows]
    slots = []
    for r in slot_rows:
        code, w = struct.unpack("<If", r.tobytes())
        slots.append((code >> 24, code & 0xFFFFFF, w))
    return send, toks, slots


def test_dedup_wire_rows_of_the_worked_example():
    """The rows themselves (docs/semantics.md's worked example, capacity 2): rank 1's token 0
    lost its only slot on rank 0 and no longer travels there; the count exchange ran its second
    all-gather (token rows), which without the drop it does not."""
    xs = [np.array([[1, 2], [3, 4], [5, 6]], F32), np.array([[7, 8], [9, 10]], F32)]
    idx = [np.array([[0, 2], [3, -1], [1, 0]]), np.array([[2, 0], [2, 3]])]
    ws = [np.array([[0.5, 0.5], [1, 0], [0.25, 0.75]], F32), np.array([[0.5, 0.5], [0.75, 0.25]], F32)]
    group = Group(2, 4, 2, 2, F32, 2, 2, None, "dedup", "ragged")
    kept = kept_mask(idx, 4, 2)
    send, toks, slots = _decode_dedup(group, 1, xs, idx, ws, kept)
    assert send == [[], [0, 1]]
    assert toks == [([7, 8], 0, 1), ([9, 10], 1, 1)]                   # all to rank 1
    assert slots == [(0, 0, 0.5), (1, 1, 0.25)]                        # all to rank 1
    send, toks, slots = _decode_dedup(group, 0, xs, idx, ws, kept)
    assert toks == [([1, 2], 0, 1), ([5, 6], 2, 2), ([1, 2], 0, 1), ([3, 4], 1, 1)]
    assert slots == [(0, 0, 0.5), (0, 1, 0.25), (1, 0, 0.75), (1, 0, 0.5), (0, 1, 1.0)]
    res = ref.dispatch(xs, idx, ws, num_experts=4, align=2, capacity=2, transport="dedup",
                       exchange="ragged", rank_major=True)
    assert res[0].rank_major.recv_topk_idx.tolist() == [[0, -1], [1, 0]]
    assert res[0].rank_major.recv_topk_weights.tolist() == [[0.5, 0], [0.25, 0.75]]
    assert [r.bytes_sent.tolist() for r in res] == [[2 * 16 + 3 * 8, 2 * 16 + 2 * 8],
                                                    [0, 2 * 16 + 2 * 8]]
    p = res[0].wire.plan
    assert p.dropped and p.rows.tolist() == [[2, 2], [0, 2]]
    assert p.tokens_per_rank.tolist() == [[2, 2], [1, 2]]              # pre-capacity: 1 -> 0
    whole = ref.dispatch(xs, idx, ws, num_experts=4, align=2, transport="dedup", exchange="ragged")
    assert not whole[0].wire.plan.dropped                             # no drop: one gather


def test_dedup_slot_codes_with_large_k():
    """k << 24 | j sets the sign bit of the int32 for k >= 128: the rows still round-trip."""
    rng = np.random.default_rng(7)
    K, R, L, H = 200, 2, 100, 2
    idx = [rng.permutation(R * L)[:K].reshape(1, K), rng.permutation(R * L)[:K].reshape(1, K)]
    xs = [rng.standard_normal((1, H)).astype(F32) for _ in range(R)]
    ws = [rng.random((1, K)).astype(F32) for _ in range(R)]
    base = ref.dispatch(xs, idx, ws, num_experts=R * L, rank_major=True)
    res = ref.dispatch(xs, idx, ws, num_experts=R * L, transport="dedup", exchange="ragged",
                       rank_major=True)
    assert_results_bitwise(base, res)
    with pytest.raises(ref.InputError, match="limit of 255"):
        big = [np.arange(256).reshape(1, 256)]
        ref.dispatch([np.ones((1, H), F32)], big, [np.ones((1, 256), F32)], num_experts=256,
                     transport="dedup", exchange="ragged")


def test_equal_needs_both_dedup_sections_uniform():
    """Token rows uniform (1 everywhere) but slot rows not (rank 0's token has two experts on
    rank 0): dedup's equal exchange refuses, naming rank 0; pairs' rows are not uniform either;
    auto falls back to ragged."""
    xs = [np.ones((1, 4), F32), np.ones((1, 4), F32)]
    idx = [np.array([[0, 1, 2]]), np.array([[0, 2, 3]])]
    ws = [np.ones((1, 3), F32)] * 2
    tok = ref.layout(idx, 4)
    assert [t.tokens_per_rank.tolist() for t in tok] == [[1, 1], [1, 1]]
    with pytest.raises(ref.InputError) as err:
        ref.dispatch(xs, idx, ws, num_experts=4, transport="dedup", exchange="equal")
    assert err.value.code == ref.Reason.EQUAL_NONUNIFORM and err.value.rank == 0
    with pytest.raises(ref.InputError):
        ref.fast.dispatch_bytes(idx, num_experts=4, hidden=4, transport="dedup", exchange="equal")
    auto = ref.dispatch(xs, idx, ws, num_experts=4, transport="dedup", exchange="auto")
    assert auto[0].wire.plan.variant == "ragged"
    # both sections uniform with different counts (1 token row, 2 slot rows per pair): equal
    idx = [np.array([[0, 1, 2, 3]]), np.array([[1, 0, 3, 2]])]
    ws = [np.ones((1, 4), F32)] * 2
    res = ref.dispatch(xs, idx, ws, num_experts=4, transport="dedup", exchange="auto")
    assert res[0].wire.plan.variant == "equal"
    assert [r.bytes_sent.tolist() for r in res] == [[4 * 4 + 8 + 2 * 8] * 2] * 2
    assert_results_bitwise(ref.dispatch(xs, idx, ws, num_experts=4), res)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**32 - 1), st.sampled_from([(), (3,), (2, 2)]),
       st.sampled_from([np.float32, np.int64, np.uint8]))
def test_exchange_variants(R, seed, tail, dtype):
    rng = np.random.default_rng(seed)
    uniform = seed % 3 == 0
    counts = np.full((R, R), seed % 4) if uniform else rng.integers(0, 4, size=(R, R))
    xs = [rng.integers(0, 100, size=(int(counts[s].sum()),) + tail).astype(dtype) for s in range(R)]
    want = [np.concatenate([xs[s][counts[s, :d].sum():counts[s, :d + 1].sum()] for s in range(R)])
            for d in range(R)]
    for variant in ("ragged", "padded", "auto", "static") + (("equal",) if uniform else ()):
        got = ref.exchange(xs, counts, variant=variant, cap=int(counts.max()) + seed % 2)
        assert_lists_bitwise(got, want, variant)
        back = ref.exchange(got, counts.T, variant=variant, cap=int(counts.max()))   # backward
        assert_lists_bitwise(back, xs, variant + " backward")
    if not uniform and not (counts == counts[0, 0]).all():
        with pytest.raises(ref.InputError):
            ref.exchange(xs, counts, variant="equal")
    if counts.max() > 0:
        with pytest.raises(ref.InputError) as err:
            ref.exchange(xs, counts, variant="static", cap=int(counts.max()) - 1)
        assert err.value.code == ref.Reason.STATIC_OVERFLOW


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(("ragged", "padded", "static")))
def test_plan_from_count_words_alone_bounds_the_bytes(case, ex):
    """``epkit simulate`` plans from the count words alone: where they do not fix dedup's token
    rows (capacity dropped something) or its return path (which needs every token row's n), the
    plan says ``exact=False`` and its bytes bound the exact ones from above, never above pairs'."""
    max_t = max(x.shape[0] for x in case.xs)
    for ydt in (F32, ref.dtypes.BFLOAT16):
        group = Group(case.R, case.E, case.H, case.K, ydt, 1, case.capacity, None, "dedup", ex,
                      max_t)
        words = transports.count_words(case.idx, case.R, case.E)
        loose = accounting.plan(group, words)
        kept = kept_mask(case.idx, case.E, case.capacity)
        exact = accounting.wire_plan(group, case.idx, kept)
        assert exact.exact and not loose.exact
        assert loose.dropped == exact.dropped
        pg = Group(**dict(group.__dict__, transport="pairs"))
        pairs = accounting.plan(pg, words)
        for of in (accounting.dispatch_bytes_of, accounting.combine_bytes_of):
            e, b, p = of(group, exact), of(group, loose), of(pg, pairs)
            assert (e <= b).all() and (b <= p).all(), (of.__name__, e, b, p)
        if not exact.dropped:
            assert np.array_equal(accounting.dispatch_bytes_of(group, loose),
                                  accounting.dispatch_bytes_of(group, exact))
