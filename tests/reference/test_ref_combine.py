"""Combine and the backward passes: arithmetic, adjointness, round trip, padding."""

import numpy as np
from hypothesis import given, settings

from epkit import reference as ref
from epkit.reference.dtypes import BFLOAT16 as BF16
from epkit.verify.tolerances import weight_grad_allowed_error
from refcases import F32, assert_lists_bitwise, bits, cases


def dot64(xs, ys):
    """Sum of elementwise products in float64 (exact on small integers)."""
    return sum(float((np.asarray(a, np.float64) * np.asarray(b, np.float64)).sum()) for a, b in zip(xs, ys))


def expected_combine(case, res, ys, weighted):
    """The two-level sum written out from the inputs alone (not from the reference's helpers)."""
    L, outs = case.L, []
    for s in range(case.R):
        out = np.zeros((case.idx[s].shape[0], case.H), F32)
        for t in range(out.shape[0]):
            total = np.zeros(case.H, F32)
            for d in range(case.R):
                part = np.zeros(case.H, F32)
                for k in range(case.K):
                    e = case.idx[s][t, k]
                    if e < 0 or e // L != d or not res[s].source.kept[t, k]:
                        continue
                    m = [i for i, src in enumerate(res[d].row_src.tolist()) if src == [s, t, k]][0]
                    c = case.ws[s][t, k] if weighted else np.float32(1)
                    part = part + c * ys[d][m].astype(F32)
                total = total + part
            out[t] = total
        outs.append(out.astype(case.dtype))
    return outs


@settings(max_examples=60, deadline=None)
@given(cases(payloads=(None, "mxfp8", "fp8_block128")))
def test_combine_arithmetic_and_padding(case):
    res = ref.dispatch(case.xs, case.idx, case.ws, **case.kw())
    ydt = BF16 if case.seed % 2 else F32
    ys = case.rows_like([r.expert_x.shape for r in res], ydt, salt=3)
    for w in (True, False):
        out = ref.combine(ys, res, weighted=w)
        assert all(o.dtype == case.dtype and o.shape == x.shape for o, x in zip(out, case.xs))
        assert_lists_bitwise(out, expected_combine(case, res, ys, w), "combine")
        # padding rows are ignored whatever they hold, NaN included
        noisy = [y.copy() for y in ys]
        for y, r in zip(noisy, res):
            y[r.row_src[:, 0] < 0] = np.nan
        assert_lists_bitwise(ref.combine(noisy, res, weighted=w), out, "NaN padding")
        assert_lists_bitwise(ref.dispatch_backward(noisy, res), ref.dispatch_backward(ys, res), "NaN padding")
        gys, _ = ref.combine_backward(out, ys, res, weighted=w)
        for gy, r in zip(gys, res):
            assert not bits(gy[r.row_src[:, 0] < 0]).any()


@settings(max_examples=60, deadline=None)
@given(cases())
def test_adjointness(case):
    res = ref.dispatch(case.xs, case.idx, case.ws, **case.kw())
    xs = case.rows_like([x.shape for x in case.xs], case.dtype, salt=7, ints=4)
    res = ref.dispatch(xs, case.idx, case.ws, **case.kw())
    g = case.rows_like([r.expert_x.shape for r in res], case.dtype, salt=8, ints=4)
    assert dot64([r.expert_x for r in res], g) == dot64(xs, ref.dispatch_backward(g, res))
    # combine: <combine(y), g> == <y, combine_backward(g)>; weights small integers too
    ws = [np.asarray(w * 0 + np.round(w * 4) - 2, np.float32) for w in case.ws]
    res = ref.dispatch(xs, case.idx, ws, **case.kw())
    ys = case.rows_like([r.expert_x.shape for r in res], case.dtype, salt=9, ints=4)
    go = case.rows_like([x.shape for x in xs], case.dtype, salt=10, ints=4)
    for w in (True, False):
        out = ref.combine(ys, res, weighted=w)
        gys, gws = ref.combine_backward(go, ys, res, weighted=w)
        assert dot64(out, go) == dot64(ys, gys)
        # weight gradient: d<combine, g>/dw[s, t, k] = <g_s[t], y(s, t, k)>, exact on integers
        for s in range(case.R):
            for t in range(xs[s].shape[0]):
                for k in range(case.K):
                    if not w or not res[s].source.kept[t, k]:
                        assert gws[s][t, k] == 0
                        continue
                    d = case.idx[s][t, k] // case.L
                    m = [i for i, src in enumerate(res[d].row_src.tolist()) if src == [s, t, k]][0]
                    assert gws[s][t, k] == dot64([go[s][t]], [ys[d][m]])


@settings(max_examples=60, deadline=None)
@given(cases())
def test_round_trip_identity_experts(case):
    res = ref.dispatch(case.xs, case.idx, case.ws, **case.kw())
    ys = [r.expert_x.astype(F32) for r in res]               # identity experts
    n = [r.source.kept.sum(axis=1).astype(F32)[:, None] for r in res]
    unweighted = ref.combine(ys, res, weighted=False)
    weighted = ref.combine(ys, res, weighted=True)
    for s in range(case.R):
        x = case.xs[s].astype(np.float64)
        wsum = (np.where(res[s].source.kept, case.ws[s], 0).astype(np.float64).sum(axis=1))[:, None]
        if case.values == "dyadic":       # exact: every partial sum is representable
            assert np.array_equal(unweighted[s], (x * n[s]).astype(F32).astype(case.dtype))
            assert np.array_equal(weighted[s], (x * wsum).astype(F32).astype(case.dtype))
        else:
            tol = 2.0 ** -20 if case.dtype == F32 else 2.0 ** -7
            scale = np.abs(x) * np.maximum(1, np.abs(case.ws[s]).sum(axis=1))[:, None] + 1e-30
            assert np.all(np.abs(unweighted[s].astype(np.float64) - x * n[s]) <= tol * scale * 4)
            assert np.all(np.abs(weighted[s].astype(np.float64) - x * wsum) <= tol * scale * 4)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_combine_backward_values(case):
    res = ref.dispatch(case.xs, case.idx, case.ws, **case.kw())
    ys = case.rows_like([r.expert_x.shape for r in res], case.dtype, salt=11)
    go = case.rows_like([x.shape for x in case.xs], F32, salt=12)
    gys, gws = ref.combine_backward(go, ys, res, weighted=True)
    for d, r in enumerate(res):
        assert gys[d].dtype == ys[d].dtype
        for m, (s, t, k) in enumerate(r.row_src.tolist()):
            if s >= 0:
                want = (np.float32(case.ws[s][t, k]) * go[s][t]).astype(ys[d].dtype)
                assert np.array_equal(bits(gys[d][m]), bits(want))
                g64, y64 = go[s][t].astype(np.float64), ys[d][m].astype(np.float64)
                exact = float((g64 * y64).sum())
                bound = weight_grad_allowed_error(case.H, float(np.abs(g64 * y64).sum()))
                assert abs(float(gws[s][t, k]) - exact) <= bound        # docs/design.md item 6
    for s in range(case.R):
        assert gws[s].dtype == np.float32 and gws[s].shape == case.idx[s].shape
        assert not gws[s][~res[s].source.kept].any()
    gys_u, gws_u = ref.combine_backward(go, ys, res, weighted=False)
    assert all(not g.any() for g in gws_u)
