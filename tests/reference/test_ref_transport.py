"""Transports x exchange variants: bit-for-bit equal to the canonical computation; bytes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epkit import reference as ref
from epkit.reference import transport
from refcases import F32, assert_lists_bitwise, assert_results_bitwise, cases

EXCHANGES = ("ragged", "padded", "equal", "static", "auto")


@settings(max_examples=40, deadline=None)
@given(cases(payloads=(None, None, "mxfp8")), st.sampled_from(("pairs", "dedup")), st.booleans())
def test_transports_equal_canonical(case, tr, weighted):
    kw = case.kw(rank_major=True)
    base = ref.dispatch(case.xs, case.idx, case.ws, **kw)
    ys = case.rows_like([r.expert_x.shape for r in base], case.dtype, salt=3)
    go = case.rows_like([x.shape for x in case.xs], case.dtype, salt=4)
    want = (ref.combine(ys, base, weighted), ref.dispatch_backward(ys, base),
            ref.combine_backward(go, ys, base, weighted))
    max_t = max(x.shape[0] for x in case.xs)
    for ex in EXCHANGES:
        args = dict(kw, transport=tr, exchange=ex, max_tokens_per_rank=max_t + case.seed % 2)
        try:
            res = ref.dispatch(case.xs, case.idx, case.ws, **args)
        except ref.InputError as err:       # only the equal exchange may refuse, on a non-uniform plan
            assert ex == "equal" and err.code == ref.Reason.EQUAL_NONUNIFORM
            assert not case.uniform or case.capacity is not None
            continue
        assert_results_bitwise(base, res)
        got = (ref.combine(ys, res, weighted), ref.dispatch_backward(ys, res),
               ref.combine_backward(go, ys, res, weighted))
        assert_lists_bitwise(got[0], want[0], f"{tr}/{ex} combine")
        assert_lists_bitwise(got[1], want[1], f"{tr}/{ex} dispatch_backward")
        assert_lists_bitwise(got[2][0], want[2][0], f"{tr}/{ex} grad expert_y")
        assert_lists_bitwise(got[2][1], want[2][1], f"{tr}/{ex} grad weights")
        # byte accounting: what the simulated exchanges moved == the formulas
        bkw = dict(num_experts=case.E, hidden=case.H, transport=tr, exchange=ex,
                   capacity=case.capacity, payload=case.payload,
                   max_tokens_per_rank=args["max_tokens_per_rank"])
        moved = np.stack([r.bytes_sent for r in res])
        assert np.array_equal(moved, ref.dispatch_bytes(case.idx, dtype=case.dtype, **bkw))
        _, moved_back = transport.reduce_back(res, ys, weighted)
        assert np.array_equal(moved_back, ref.combine_bytes(case.idx, dtype=ys[0].dtype, **bkw))
        if res[0].wire.plan.variant == "ragged":
            row = case.H * case.dtype.itemsize if case.payload is None else case.H + case.H // 32
            row += 16 if tr == "pairs" else 16 * -(-(4 + 8 * case.K) // 16)
            assert np.array_equal(moved, res[0].wire.plan.rows * row)


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


@settings(max_examples=60, deadline=None)
@given(cases(capacity=False))
def test_dedup_rows_never_exceed_pairs(case):
    """Without capacity: per (s, d), dedup sends one row per token and pairs one per slot, so
    dedup sends no more payload, and strictly less exactly where a token has two experts on d."""
    kw = dict(num_experts=case.E, hidden=case.H, dtype=case.dtype, exchange="ragged")
    dedup = ref.dispatch_bytes(case.idx, transport="dedup", **kw)
    pairs = ref.dispatch_bytes(case.idx, transport="pairs", **kw)
    payload = case.H * case.dtype.itemsize
    dedup_rows = dedup // (payload + 16 * -(-(4 + 8 * case.K) // 16))
    pairs_rows = pairs // (payload + 16)
    assert (dedup_rows <= pairs_rows).all()
    for s in range(case.R):
        for d in range(case.R):
            shared = any(sum(1 for e in row if e >= 0 and e // case.L == d) >= 2 for row in case.idx[s])
            assert (dedup_rows[s, d] < pairs_rows[s, d]) == shared
    # combine direction: dedup rows are float32 partials (4 H bytes), pairs rows y (H itemsize)
    cd = ref.combine_bytes(case.idx, transport="dedup", **kw)
    cp = ref.combine_bytes(case.idx, transport="pairs", **kw)
    assert np.array_equal(cd // (4 * case.H), dedup_rows.T)
    assert np.array_equal(cp // payload, pairs_rows.T)


def test_dedup_fewer_bytes_when_experts_share_a_rank():
    # 2 ranks, 8 experts (4 per rank), every token's 4 experts all on one rank: dedup sends each
    # token once instead of four times.
    idx = [np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), np.array([[7, 6, 5, 4]])]
    kw = dict(num_experts=8, hidden=256, dtype="bfloat16", exchange="ragged")
    dedup = ref.dispatch_bytes(idx, transport="dedup", **kw)
    pairs = ref.dispatch_bytes(idx, transport="pairs", **kw)
    assert dedup.sum() < pairs.sum()
    assert dedup.tolist() == [[512 + 48, 512 + 48], [0, 512 + 48]]
    assert pairs.tolist() == [[4 * (512 + 16), 4 * (512 + 16)], [0, 4 * (512 + 16)]]


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
