"""The error bound of a sum (``bounded``) and the weight gradient's tolerance (``exact``).

:func:`sum_bound` is the bound on any summation order of a sum; :func:`_bounded` compares an
output with the float64 value under it and says where and by how much it is off;
:func:`weight_grad_tolerance` applies :mod:`epkit.verify.tolerances` to ``grad_topk_weights``.
The float64 sums they need (the exact value, the terms' magnitudes, the term counts) are made
here from the rows the implementation was fed.
"""

from __future__ import annotations

import numpy as np

from .cases import np_dtype
from .compare import _fmt, _kind_mismatch, _where
from .tolerances import weight_grad_allowed_error

__all__ = ["special_ok", "sum_bound", "ulps", "unit_roundoff", "weight_grad_tolerance"]


def unit_roundoff(dtype) -> float:
    """u of a float dtype: half the gap between 1 and the next float (2**-24 for float32,
    2**-8 for bfloat16)."""
    return {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float64": 2.0**-53,
            "float16": 2.0**-11}[np.dtype(np_dtype(str(dtype))).name]


_TINY = 2.0**-133  # half the smallest bfloat16 subnormal: an underflow's absolute error
# float16's: half its smallest subnormal (2**-24), far above the others' (which _TINY covers)
_TINY16 = 2.0**-25
_F16_OVERFLOW = 65520.0  # float16 rounds a value of this magnitude or more to infinity


def sum_bound(abs_sum, exact, nterms, out_dtype, accumulate="float32"):
    """The bound on ``|computed - exact|`` of a sum of ``nterms`` terms ``c_i * v_i``:

        gamma(n + 2, u_acc) * sum |c_i v_i| * (1 + u_out) + u_out * |exact|
            + (n + 2) * 2**-133 + n * 2**-53 * sum |c_i v_i|

    with ``gamma(m, u) = m u / (1 - m u)``, ``u_acc`` the unit roundoff of the accumulation
    dtype and ``u_out`` that of the output dtype. Any summation order (sequential, pairwise,
    per rank then across ranks, atomics) rounds at most ``n - 1`` additions on the way from a
    term to the result, plus the product and one conversion of each factor into the
    accumulation dtype: ``n + 2`` roundings, each by at most ``u_acc`` (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and eq. 4.4); then one rounding to
    the output dtype. The last two terms cover underflow and the float64 reference itself
    (float16, in the accumulation or the output, underflows at 2**-25, half its smallest
    subnormal, not 2**-133)."""
    n = np.asarray(nterms, dtype=np.float64)
    u = unit_roundoff(accumulate)
    u_out = unit_roundoff(out_dtype)
    m = (n + 2) * u
    gamma = np.where(m < 1, m / np.maximum(1 - m, 1e-300), np.inf)
    a = np.asarray(abs_sum, dtype=np.float64)
    tiny = (n + 2) * (_TINY16 if _name(accumulate) == "float16" else _TINY)
    tiny = tiny + (_TINY16 if _name(out_dtype) == "float16" else 0.0)
    return gamma * a * (1 + u_out) + u_out * np.abs(exact) + tiny + n * 2.0**-53 * a


def _name(dtype) -> str:
    return np.dtype(np_dtype(str(dtype))).name


def ulps(err, exact, dtype):
    """``err`` in units of the last place of ``exact`` in ``dtype`` (float32 / bfloat16 /
    float16)."""
    bits, emin = {"float32": (24, -126), "bfloat16": (8, -126),
                  "float16": (11, -14)}.get(_name(dtype), (53, -1022))
    e = np.abs(np.asarray(exact, dtype=np.float64))
    expo = np.floor(np.log2(np.where(e > 0, e, 1.0)))
    spacing = np.where(e > 0, np.exp2(np.maximum(expo, emin) - (bits - 1)),
                       2.0**(emin - (bits - 1)))
    return np.asarray(err) / spacing


def special_ok(got, exact, inf_may_be_nan=False):
    """``(special, ok)``: where ``exact`` (float64) is NaN or infinite, and whether ``got``
    is NaN there / the same infinity. A sum with a NaN or an infinite term is exactly that
    however it is summed, so no bound applies there. ``inf_may_be_nan``: the sum converts
    float32 factors to a narrower accumulation dtype, where a subnormal factor may become 0
    and its product with an infinity NaN."""
    exact = np.asarray(exact, dtype=np.float64)
    g = np.asarray(got, dtype=np.float64)
    special = ~np.isfinite(exact)
    ok = np.where(np.isnan(exact), np.isnan(g), (g == exact) | (inf_may_be_nan & np.isnan(g)))
    return special, ok


def _bounded(got, exact, abs_sum, nterms, out_dtype, accumulate, mask=None,
             narrowed=False, factors=None):
    """(message or None, worst ratio, its ulps): ``got`` against float64 ``exact``. Where
    ``exact`` is NaN the result must be NaN, where it is infinite the same infinity; an
    error against an exact zero is reported in absolute terms.

    ``narrowed``: the sum converts float32 factors to a bfloat16 (float16) accumulation. A
    factor in the subnormal range then loses up to half a subnormal step (2**-133, float16:
    2**-25) absolutely, which
    the product scales by the other factor: the bound grows by ``2**-133 * factors`` (the sum
    of the factors' magnitudes, ``|c_i| + |v_i|``), and an infinite exact value may come out
    NaN (a subnormal factor of the infinity became 0)."""
    inf_may_be_nan = narrowed
    want_shape = np.shape(exact)
    got_a, msg = _kind_mismatch(got, np.zeros(want_shape, np_dtype(str(out_dtype))))
    if msg:
        return msg, np.inf, np.inf
    if got_a.size == 0:
        return None, 0.0, 0.0
    exact = np.asarray(exact, dtype=np.float64)
    g = got_a.astype(np.float64)
    special, special_good = special_ok(g, exact, inf_may_be_nan)
    finite_exact = np.where(special, 0.0, exact)
    bound = sum_bound(np.where(special, 0.0, abs_sum), finite_exact, nterms, out_dtype,
                      accumulate)
    if narrowed and factors is not None:
        step = _TINY16 if _name(accumulate) == "float16" else 2.0**-133
        bound = bound + step * np.where(special, 0.0, np.asarray(factors, np.float64))
    err = np.where(special, np.where(special_good, 0.0, np.inf), np.abs(g - finite_exact))
    if _name(out_dtype) == "float16":  # a finite sum within its bound of float16's overflow
        over16 = np.isinf(g) & (np.sign(g) == np.sign(finite_exact)) & ~special
        err = np.where(over16 & (np.abs(finite_exact) + bound >= _F16_OVERFLOW), 0.0, err)
    over = ~(err <= bound)  # NaN counts as over
    if mask is not None:
        over &= mask
        err = np.where(mask, err, 0.0)
    ratio = np.where(np.isnan(err), np.inf, err / bound)
    ratio = np.where(over, np.where(np.isfinite(ratio), ratio, np.inf), ratio)
    worst = int(np.argmax(np.where(np.isfinite(ratio), ratio, -1.0)))
    worst_ratio = float(ratio.reshape(-1)[worst]) if np.isfinite(ratio).any() else 0.0
    worst_ulps = float(ulps(err.reshape(-1)[worst], finite_exact.reshape(-1)[worst],
                            out_dtype))
    if not over.any():
        return None, worst_ratio, worst_ulps
    first = int(np.flatnonzero(over.reshape(-1))[np.argmax(ratio.reshape(-1)[over.reshape(-1)])])
    ex = float(exact.reshape(-1)[first])
    b = float(np.asarray(bound).reshape(-1)[first])
    n = int(np.asarray(nterms).reshape(-1)[first])
    head = (f"{got_a.dtype} {list(want_shape)}: worst at {_where(want_shape, first)}: got "
            f"{_fmt(got_a.reshape(-1)[first])}, exact {ex!r}")
    tail = (f"; {int(over.sum())} of {got_a.size} elements outside the bound")
    if not np.isfinite(ex):
        return (head + (" (a term is NaN or the infinities cancel: the result must be NaN)"
                        if np.isnan(ex) else " (an infinite term: the result must be that "
                        "infinity)") + tail), np.inf, np.inf
    e = float(err.reshape(-1)[first])
    if ex == 0.0:  # units of a bound that is itself ~2**-133 say nothing: absolute terms
        return (head + f", |error| {e:.3g} against an exact zero (bound {b:.3g}, {n} terms, "
                f"accumulate {accumulate})" + tail), worst_ratio, worst_ulps
    return (head + f", |error| {e:.3g} = {float(ratio.reshape(-1)[first]):.3g} bounds "
            f"({float(ulps(e, ex, out_dtype)):.3g} ulps; bound {b:.3g}, {n} terms, accumulate "
            f"{accumulate})" + tail), worst_ratio, worst_ulps


def weight_grad_tolerance(got, grad_outs, expert_ys, res, topk, hidden):
    """Check ``grad_topk_weights`` of every rank within the stated tolerance (contract exact).

    Returns ``{rank: message}`` for the ranks that fail. ``exact`` is computed here in float64
    from the gradient and expert rows actually fed, placed by the reference's ``row_src``."""
    exact, bound, _, _ = _weight_grad_exact(grad_outs, expert_ys, res, topk)
    bad = {}
    for s in range(len(grad_outs)):
        want_shape = exact[s].shape
        g, msg = _kind_mismatch(got[s], np.zeros(want_shape, np.float32))
        if msg:
            bad[s] = msg
            continue
        special, special_good = special_ok(g, exact[s])
        tol = weight_grad_allowed_error(hidden, np.where(special, 0.0, bound[s]))
        err = np.where(special, np.where(special_good, 0.0, np.inf),
                       np.abs(g.astype(np.float64) - np.where(special, 0.0, exact[s])))
        over = ~(err <= tol)  # NaN counts as over
        if over.any():
            first = int(np.flatnonzero(over)[0])
            t, k = np.unravel_index(first, want_shape)
            bad[s] = (f"[{want_shape[0]}, {want_shape[1]}] float32: token {t}, slot {k}: got "
                      f"{float(g[t, k])!r}, exact {float(exact[s][t, k])!r}, |error| "
                      f"{err[t, k]:.3g} > tolerance {tol[t, k]:.3g}; {int(over.sum())} of "
                      f"{g.size} outside")
    return bad


def _weight_grad_exact(grad_outs, expert_ys, res, topk):
    """Per source rank, [T, K] float64: the exact ``<g, y>`` of every kept slot, the sum of
    ``|g_h * y_h|``, the number of terms (H for a kept slot, 0 elsewhere) and the sum of the
    factors' magnitudes ``|g_h| + |y_h|`` (:func:`_bounded`'s ``factors``)."""
    R = len(grad_outs)
    exact = [np.zeros((len(grad_outs[s]), topk), dtype=np.float64) for s in range(R)]
    absum = [np.zeros_like(e) for e in exact]
    nterms = [np.zeros_like(e) for e in exact]
    factors = [np.zeros_like(e) for e in exact]
    for d in range(R):
        src = np.asarray(res[d].row_src)
        real = np.flatnonzero(src[:, 0] >= 0)
        if not len(real):
            continue
        y = np.asarray(expert_ys[d][: len(src)]).astype(np.float64)[real]
        s, t, k = src[real, 0], src[real, 1], src[real, 2]
        for r in np.unique(s):
            sel = s == r
            g = np.asarray(grad_outs[r]).astype(np.float64)[t[sel]]
            prod = g * y[sel]
            exact[r][t[sel], k[sel]] = prod.sum(axis=1)
            absum[r][t[sel], k[sel]] = np.abs(prod).sum(axis=1)
            nterms[r][t[sel], k[sel]] = prod.shape[1]
            factors[r][t[sel], k[sel]] = (np.abs(g) + np.abs(y[sel])).sum(axis=1)
    return exact, absum, nterms, factors


# -- sums in float64, for the bound ----------------------------------------------------------
def _token_sums(rows_of, res, weighted, tokens, hidden):
    """Per source rank, [T, H] float64: the exact two-level sum of combine (or, unweighted, of
    dispatch's backward) over every kept slot, the sum of the terms' magnitudes, and the number
    of terms per token; and the sum of the factors' magnitudes ``|c| + |y|`` (weighted;
    :func:`_bounded`'s ``factors``)."""
    R = len(res)
    exact = [np.zeros((tokens[s], hidden)) for s in range(R)]
    absum = [np.zeros((tokens[s], hidden)) for s in range(R)]
    factors = [np.zeros((tokens[s], hidden)) for s in range(R)]
    count = [np.zeros((tokens[s], 1)) for s in range(R)]
    for d in range(R):
        src = np.asarray(res[d].row_src)
        real = np.flatnonzero(src[:, 0] >= 0)
        if not len(real):
            continue
        v = np.asarray(rows_of[d]).astype(np.float64)[real]
        f = np.abs(v)
        if weighted:
            c = np.asarray(res[d].row_weight, dtype=np.float64)[real, None]
            v, f = v * c, f + np.abs(c)
        s, t = src[real, 0], src[real, 1]
        for r in np.unique(s):
            sel = s == r
            np.add.at(factors[r], t[sel], f[sel])
            np.add.at(exact[r], t[sel], v[sel])
            np.add.at(absum[r], t[sel], np.abs(v[sel]))
            np.add.at(count[r], t[sel], 1.0)
    return (exact, absum, [np.broadcast_to(c, e.shape) for c, e in zip(count, exact)],
            factors)
