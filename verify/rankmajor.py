"""Rank-major results (one row per token and destination rank, DeepEP's normal-mode layout)
against the reference's rank-major output."""

from __future__ import annotations

import numpy as np

from .cases import TAG_GRAD_X, TAG_Y, np_dtype, sane_row_src
from .compare import compare_bitwise
from .verdict import CONTRACTS, NA, PASSED, weaker


RANK_MAJOR = ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src")


def _rank_major_checks(case, results, ref, contract, v, todo, settle, value_check):
    """A rank-major result (one row per token and destination rank, DeepEP's normal-mode
    layout) against the reference's rank-major output. ``reordered`` matches rows by
    ``recv_src``. Combine is the sum, over ranks ascending, of each token's rows (the expert
    side applied the weights); dispatch's backward the same sum of the gradient rows; the
    gradient of a row is ``grad_out`` of its token in the row's dtype."""
    R = case.world_size
    xs, idxs, ws = case.all_inputs()
    res = ref.dispatch(xs, idxs, ws, num_experts=case.num_experts, align=case.align,
                       capacity=case.capacity, payload=case.payload, rank_major=True,
                       ranks_per_node=case.ranks_per_node)
    if todo("dispatch"):
        v.status["dispatch"] = PASSED
        for d in range(R):
            _rank_major_dispatch(case, results[d]["dispatch"], res[d].rank_major, d, contract, v)
    if todo("dispatch_backward"):
        want, ex, ab, n = _rank_major_token_sums(case, res, TAG_GRAD_X, case.dtype, case.dtype)
        v.status["dispatch_backward"] = PASSED
        for s in range(R):
            value_check("dispatch_backward", s, "grad_x", results[s].get("grad_x"), want[s],
                        ex[s], ab[s], n[s], case.dtype)
    if todo("combine"):
        want, ex, ab, n = _rank_major_token_sums(case, res, TAG_Y, case.dtype, case.y_dtype)
        v.status["combine"] = PASSED
        for s in range(R):
            value_check("combine", s, "out", results[s].get("out"), want[s], ex[s], ab[s],
                        n[s], case.dtype)
    if todo("combine_backward"):
        gos = [np.asarray(results[s]["grad_out"]) for s in range(R)]
        v.status["combine_backward"] = PASSED
        for d in range(R):
            g = _rank_major_grad_rows(case, results[d], gos)
            value_check("combine_backward", d, "grad_expert_y", results[d].get("grad_y"),
                        g.astype(np_dtype(case.y_dtype)), g.astype(np.float64),
                        np.abs(g.astype(np.float64)), np.ones_like(g, dtype=np.float64),
                        case.y_dtype)
    v.status["weight_grad"] = NA  # combine of a rank-major result takes no weights


def _rank_major_dispatch(case, got, want, d, contract, v) -> None:
    """One rank's rank-major fields against the reference's (``want``, its ``RankMajor``):
    exact (the reference's rows in its order) or reordered (the same rows matched by
    ``recv_src``, each token (s, t) once)."""
    fields = RANK_MAJOR + (("recv_scale",) if case.payload is not None else ())
    Tmax = max(case.tokens) if case.tokens else 0
    wsrc = np.asarray(want.recv_src)
    exact = [(n, m) for n in fields
             if (m := compare_bitwise(got.get(n), getattr(want, n))) is not None]
    src = got.get("recv_src")
    if src is None or np.shape(src) != np.shape(wsrc) or np.asarray(src).dtype != np.int64:
        weak = [("recv_src", compare_bitwise(src, wsrc) or "malformed")]
    else:
        src = np.asarray(src)
        wkey = wsrc[:, 0] * (Tmax + 1) + wsrc[:, 1]
        key = src[:, 0] * (Tmax + 1) + src[:, 1]
        order = np.argsort(wkey)
        pos = np.clip(np.searchsorted(wkey[order], key), 0, max(len(wkey) - 1, 0))
        ok = len(wkey) > 0 and (wkey[order][pos] == key).all() and \
            len(np.unique(key)) == len(key)
        if not ok:
            weak = [("recv_src", "the rows are not the reference's tokens (s, t) on this "
                     "rank, each once")]
        else:
            perm = order[pos]
            weak = [(n, m) for n in fields
                    if n != "recv_src" and (m := compare_bitwise(
                        got.get(n), np.asarray(getattr(want, n))[perm])) is not None]
    level = "exact" if not exact else (None if weak else "reordered")
    v.met["dispatch"] = weaker(v.met.get("dispatch", "exact"), level)
    if level == "reordered":
        v.not_exact.setdefault("dispatch", "row order")
    if level is None or CONTRACTS.index(level) > CONTRACTS.index(contract):
        for n, m in (exact if contract == "exact" else weak):
            v.fail("dispatch", d, n, m)


def _rank_major_token_sums(case, res, tag, dtype, fed_dtype):
    """Per rank: the fed rows in the reference layout; per source: the float32 sum over ranks
    ascending (cast to ``dtype``), the float64 sum, magnitudes, term counts."""
    R, H = case.world_size, case.hidden
    fed = [case.token_rows(d, tag, res[d].rank_major.recv_src, fed_dtype) for d in range(R)]
    acc = [np.zeros((case.tokens[s], H), np.float32) for s in range(R)]
    ex = [np.zeros((case.tokens[s], H)) for s in range(R)]
    ab = [np.zeros((case.tokens[s], H)) for s in range(R)]
    n = [np.zeros((case.tokens[s], H)) for s in range(R)]
    for d in range(R):
        src = np.asarray(res[d].rank_major.recv_src)
        for s in range(R):
            rows = np.flatnonzero(src[:, 0] == s)
            t = src[rows, 1]
            f = fed[d][rows]
            acc[s][t] = acc[s][t] + f.astype(np.float32)
            ex[s][t] += f.astype(np.float64)
            ab[s][t] += np.abs(f.astype(np.float64))
            n[s][t] += 1
    return [a.astype(np_dtype(dtype)) for a in acc], ex, ab, n


def _rank_major_grad_rows(case, result, gos) -> np.ndarray:
    """float32 [rows, H]: each rank-major row's gradient, its token's ``grad_out``."""
    R, H = case.world_size, case.hidden
    rows = int(np.shape(result["expert_y"])[0])
    src = sane_row_src(result["dispatch"].get("recv_src"), rows, width=2)
    real = (src[:, 0] >= 0) & (src[:, 0] < R)
    g = np.zeros((rows, H), np.float32)
    for i in np.flatnonzero(real):
        s, t = src[i]
        if t < case.tokens[s]:
            g[i] = gos[s][t].astype(np.float32)
    return g
