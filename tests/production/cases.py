"""Whole-group cases for the production tests, and the reference's answer for them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from epkit import reference as ref
from epkit.verify.tolerances import weight_grad_allowed_error

BF16 = ml_dtypes.bfloat16
DTYPES = {"float32": np.float32, "bfloat16": BF16}


@st.composite
def group_cases(draw, max_world=4, transports=("dedup", "pairs"),
                exchanges=("ragged", "padded", "auto", "lazy", "static")):
    R = draw(st.integers(1, max_world))
    L = draw(st.integers(1, 3))
    E = R * L
    K = draw(st.integers(1, min(E, 4)))
    H = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    Ts = [draw(st.integers(0, 6)) for _ in range(R)]
    hot = draw(st.booleans())
    xs, idxs, ws, gouts = [], [], [], []
    for T in Ts:
        idx = np.full((T, K), -1, np.int64)
        for t in range(T):
            experts = rng.permutation(E)[:K]
            if hot:
                experts[0] = 0 if 0 not in experts[1:] else experts[0]
            used = rng.random(K) > 0.2
            idx[t, used] = experts[used]
        xs.append(rng.standard_normal((T, H)).astype(np.float32).astype(DTYPES[dtype]))
        idxs.append(idx if draw(st.booleans()) else idx.astype(np.int32))
        ws.append(rng.random((T, K)).astype(np.float32))
        gouts.append(rng.standard_normal((T, H)).astype(np.float32).astype(DTYPES[dtype]))
    opts = dict(
        E=E, align=draw(st.integers(1, 4)),
        capacity=draw(st.one_of(st.none(), st.integers(0, 4))),
        transport=draw(st.sampled_from(transports)), exchange=draw(st.sampled_from(exchanges)),
        y_dtype=draw(st.sampled_from(sorted(DTYPES))), weighted=draw(st.booleans()),
    )
    if opts["exchange"] == "static":
        opts["max_tokens_per_rank"] = max(Ts) + draw(st.integers(0, 2))
    return R, xs, idxs, ws, gouts, opts


def expected(xs, idxs, ws, gouts, opts, ref=ref):
    """The reference's answer for rank_fns.forward_backward, per rank (``ref``: the clear
    tier, or ``epkit.reference.fast`` for big cases: the same bits)."""
    nodes = {"ranks_per_node": opts["ranks_per_node"]} if opts.get("ranks_per_node") else {}
    res = ref.dispatch(xs, idxs, ws, num_experts=opts["E"], align=opts["align"],
                       capacity=opts["capacity"], **nodes)
    ydt = DTYPES[opts["y_dtype"]]
    ys = []
    for r in res:
        y = (r.expert_x.astype(np.float32) * np.float32(2.0)).astype(ydt)
        y[r.row_src[:, 0] < 0] = np.nan
        ys.append(y)
    outs = ref.combine(ys, res, weighted=opts["weighted"])
    gys, gws = ref.combine_backward(gouts, ys, res, weighted=opts["weighted"])
    gexs = []
    for r, gy in zip(res, gys):
        gex = (gy.astype(np.float32) * np.float32(2.0)).astype(r.expert_x.dtype)
        gex[r.row_src[:, 0] < 0] = 0
        gexs.append(gex)
    gxs = ref.dispatch_backward(gexs, res)
    return [
        {"expert_x": r.expert_x, "tokens_per_expert": r.tokens_per_expert,
         "expert_offsets": r.expert_offsets, "row_src": r.row_src, "row_weight": r.row_weight,
         "dropped_per_expert": r.dropped_per_expert, "out": o, "grad_x": gx, "grad_w": gw,
         "y": y}
        for r, o, gx, gw, y in zip(res, outs, gxs, gws, ys)
    ]


def assert_bitwise(name, got, want, rank):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"rank {rank} {name}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"rank {rank} {name}: dtype {got.dtype} != {want.dtype}"
    g = got.view(np.uint8) if got.size else got
    w = want.view(np.uint8) if want.size else want
    if not np.array_equal(g, w):
        bad = np.argwhere(got.astype(np.float64) != want.astype(np.float64))
        first = tuple(bad[0]) if len(bad) else "(bit pattern only, e.g. -0.0 vs +0.0)"
        raise AssertionError(f"rank {rank} {name}: first difference at {first}: "
                             f"got {got[first] if len(bad) else got}, want {want[first] if len(bad) else want}")


def weight_grad_bound(gouts, ys, res, H):
    """docs/design.md item 6, per source slot (:mod:`epkit.verify.tolerances`)."""
    out = [{} for _ in gouts]
    for d, (r, y) in enumerate(zip(res, ys)):
        for m, (s, t, k) in enumerate(r.row_src):
            if s < 0:
                continue
            g = np.asarray(gouts[s][t], np.float64)
            out[s][(t, k)] = weight_grad_allowed_error(
                H, float(np.abs(g * np.asarray(y[m], np.float64)).sum()))
    return out


def assert_weight_grad(got, want, bound, rank):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"rank {rank} grad_topk_weights: shape {got.shape} != {want.shape}"
    for (t, k), b in bound.items():
        assert abs(got[t, k] - want[t, k]) <= b, (
            f"rank {rank} grad_topk_weights[{t},{k}]: {got[t, k]} vs {want[t, k]} (bound {b})")
    mask = np.ones(got.shape, bool)
    for (t, k) in bound:
        mask[t, k] = False
    assert np.all(got[mask] == 0) and np.all(want[mask] == 0), f"rank {rank}: unused slots' weight grads must be 0"
