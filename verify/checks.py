"""Compare what the ranks returned with the reference, under a contract.

Contracts (docs/verify.md), from the strictest:

- ``exact``: the canonical layout and every value bit for bit (``grad_topk_weights`` within the
  tolerance of docs/design.md item 6, defined once in :mod:`epkit.verify.tolerances`).
- ``reordered``: rows inside an expert in any order, padding anywhere inside an expert's
  segment (as many rows as the implementation likes, keeping ``align``); rows are matched to the
  reference's by ``row_src``; values bit for bit.
- ``bounded``: ``reordered``, and every sum within :func:`sum_bound` of the float64 value.

Every property is evaluated at every level on every example (nothing is skipped), so a verdict
also knows the strongest contract each property met and, when that is not ``exact``, why.
A failure names the property, the rank, the output, the first differing element with both
values (and their bits, or the error in units of the bound and in ulps), and the case with a
snippet that replays it.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import numpy as np

from epkit.reference import payloads
from .accumulate import accumulation_dtype, parse_accumulate
from .capabilities import Capabilities
from .cases import STAGES, TAG_GRAD_X, TAG_Y, Case, ModeSpec, np_dtype, sane_row_src
from .tolerances import weight_grad_allowed_error

__all__ = ["CONTRACTS", "PROPERTIES", "Mismatch", "Verdict", "check_case", "compare_bitwise",
           "sum_bound", "ulps", "unit_roundoff", "weight_grad_tolerance"]

# Properties (columns of the closing table) and the stage that produces each.
PROPERTIES = ("dispatch", "dispatch_backward", "combine", "combine_backward", "weight_grad")
_STAGE = {"dispatch": 0, "dispatch_backward": 1, "combine": 2, "combine_backward": 3,
          "weight_grad": 3}
PASSED, FAILED, REFUSED, SKIPPED, NA = "passed", "failed", "refused", "skipped", "n/a"
UNSUPPORTED = REFUSED  # the former name of a refusal
CONTRACTS = ("exact", "reordered", "bounded")  # strictest first
_RANK = {c: i for i, c in enumerate(CONTRACTS)}


def weaker(a: str | None, b: str | None) -> str | None:
    """The weaker of two contract levels (None: none met)."""
    if a is None or b is None:
        return None
    return a if _RANK[a] >= _RANK[b] else b


@dataclass
class Mismatch:
    prop: str
    rank: int | None
    output: str
    message: str

    def __str__(self):
        where = f"rank {self.rank}, " if self.rank is not None else ""
        return f"{self.prop}: {where}{self.output}: {self.message}"


@dataclass
class Verdict:
    """The outcome of one case: a status per property, and what went wrong.

    ``met[p]``: the strongest contract property ``p`` met (None: none); ``not_exact[p]``: why
    it is not exact when it met a weaker one; ``worst[p]``: the largest error in units of the
    bound (and in ulps) of the bounded comparisons; ``refusal``: the message of a refusal."""

    case: Case
    mode: ModeSpec
    impl: str
    contract: str = "exact"
    status: dict = field(default_factory=dict)
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # worker exceptions, with tracebacks
    met: dict = field(default_factory=dict)
    not_exact: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    refusal: str | None = None
    redrawn_from: Case | None = None  # the refused draw this case replaced
    refused_for: tuple = ()  # the features that draw was refused for

    @property
    def failed(self) -> bool:
        return any(s == FAILED for s in self.status.values())

    @property
    def refused(self) -> bool:
        return any(s == REFUSED for s in self.status.values())

    @property
    def failed_properties(self) -> list[str]:
        return [p for p in PROPERTIES if self.status.get(p) == FAILED]

    def fail(self, prop, rank, output, message):
        self.status[prop] = FAILED
        self.mismatches.append(Mismatch(prop, rank, output, message))

    def report(self) -> str:
        c = self.case
        lines = [f"FAILED {', '.join(self.failed_properties)} [mode {self.mode.name}, "
                 f"impl {self.impl}, contract {self.contract}]"]
        lines += ["  " + str(m) for m in self.mismatches]
        for e in self.errors:
            lines.append(textwrap.indent(e.rstrip(), "    "))
        lines.append(
            f"  case: world {c.world_size}, experts {c.num_experts}, top-k {c.topk}, hidden "
            f"{c.hidden}, tokens {list(c.tokens)}, x {c.dtype}, expert_y {c.y_dtype}, "
            f"idx {c.idx_dtype}, routing {c.routing}, align {c.align}, capacity {c.capacity}, "
            f"{'weighted' if c.weighted else 'unweighted'}, payload {c.payload}, "
            f"NaN padding {c.nan_padding}, seed {c.seed}")
        if self.redrawn_from is not None:
            lines.append(f"  (redrawn without {', '.join(self.refused_for)}, which the "
                         "implementation refused)")
        lines.append("  reproduce:")
        snippet = c.snippet(self.impl, self.mode.name)
        if self.contract != "exact":
            snippet = snippet[:-1] + f", contract={self.contract!r})"
        lines.append(textwrap.indent(snippet, "    "))
        return "\n".join(lines)


# -- comparisons ------------------------------------------------------------------------------
def _fmt(v) -> str:
    a = np.asarray(v)
    if a.dtype.kind in "iub":
        return str(a.item())
    bits = a.view(np.dtype(f"u{a.dtype.itemsize}")).item()
    return f"{float(a.astype(np.float64))!r} (0x{bits:0{2 * a.dtype.itemsize}x})"


def _where(shape, flat_index) -> str:
    idx = np.unravel_index(flat_index, shape)
    if len(shape) == 2:
        return f"row {idx[0]}, col {idx[1]}"
    return "index " + ", ".join(str(i) for i in idx)


def _kind_mismatch(got, want):
    """(got as an array, None) when it has want's shape and dtype, else (None, message)."""
    want = np.asarray(want)
    if got is None:
        return None, f"missing (expected {want.dtype} {list(want.shape)})"
    got = np.asarray(got)
    if got.shape != want.shape:
        return None, f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return None, f"dtype {got.dtype}, expected {want.dtype}"
    return got, None


def compare_bitwise(got, want) -> str | None:
    """None when ``got`` has ``want``'s shape, dtype and bytes (a NaN matches any NaN); else
    what differs."""
    want = np.asarray(want)
    got, msg = _kind_mismatch(got, want)
    if msg or want.size == 0:
        return msg
    u = np.dtype(f"u{want.dtype.itemsize}")
    diff = np.ascontiguousarray(got).view(u) != np.ascontiguousarray(want).view(u)
    if diff.any() and want.dtype.kind not in "iub":
        # IEEE 754 leaves the sign and payload of a computed NaN open (x86 makes -NaN, torch's
        # bfloat16 cast +NaN): a NaN matches any NaN; every other value, -0.0 included, its bits
        with np.errstate(all="ignore"):
            diff &= ~(np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64)))
    if not diff.any():
        return None
    first = int(np.flatnonzero(diff)[0])
    return (f"{want.dtype} {list(want.shape)}: first difference at "
            f"{_where(want.shape, first)}: got {_fmt(got.reshape(-1)[first])}, expected "
            f"{_fmt(want.reshape(-1)[first])}; {int(diff.sum())} of {want.size} elements differ")


def _compare_with_tail(got, want, fill, static: bool) -> str | None:
    """Like compare_bitwise; a static mode may append all-padding rows (``fill``) at the end."""
    if static and got is not None and np.ndim(got) == np.ndim(want) and np.ndim(want) >= 1 \
            and np.shape(got)[0] > np.shape(want)[0] and np.shape(got)[1:] == np.shape(want)[1:]:
        got = np.asarray(got)
        m = np.shape(want)[0]
        head = compare_bitwise(got[:m], want)
        if head:
            return head
        tail = np.zeros_like(got[m:]) if fill == 0 else np.full_like(got[m:], fill)
        msg = compare_bitwise(got[m:], tail)
        return None if msg is None else f"trailing static rows (from row {m}): {msg}"
    return compare_bitwise(got, want)


# -- the error bound ----------------------------------------------------------------------------
def unit_roundoff(dtype) -> float:
    """u of a float dtype: half the gap between 1 and the next float (2**-24 for float32,
    2**-8 for bfloat16)."""
    return {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float64": 2.0**-53,
            "float16": 2.0**-11}[np.dtype(np_dtype(str(dtype))).name]


_TINY = 2.0**-133  # half the smallest bfloat16 subnormal: an underflow's absolute error


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
    the output dtype. The last two terms cover underflow and the float64 reference itself."""
    n = np.asarray(nterms, dtype=np.float64)
    u = unit_roundoff(accumulate)
    u_out = unit_roundoff(out_dtype)
    m = (n + 2) * u
    gamma = np.where(m < 1, m / np.maximum(1 - m, 1e-300), np.inf)
    a = np.asarray(abs_sum, dtype=np.float64)
    return (gamma * a * (1 + u_out) + u_out * np.abs(exact) + (n + 2) * _TINY
            + n * 2.0**-53 * a)


def ulps(err, exact, dtype):
    """``err`` in units of the last place of ``exact`` in ``dtype`` (float32 / bfloat16)."""
    bits = {"float32": 24, "bfloat16": 8}.get(np.dtype(np_dtype(str(dtype))).name, 53)
    e = np.abs(np.asarray(exact, dtype=np.float64))
    expo = np.floor(np.log2(np.where(e > 0, e, 1.0)))
    spacing = np.where(e > 0, np.exp2(np.maximum(expo, -126) - (bits - 1)),
                       2.0**(-126 - (bits - 1)))
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

    ``narrowed``: the sum converts float32 factors to a bfloat16 accumulation. A factor in
    the subnormal range then loses up to a bfloat16 subnormal step (2**-133) absolutely, which
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
        bound = bound + 2.0**-133 * np.where(special, 0.0, np.asarray(factors, np.float64))
    err = np.where(special, np.where(special_good, 0.0, np.inf), np.abs(g - finite_exact))
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


# -- the layout under reordered ----------------------------------------------------------------
def _slot_keys(src: np.ndarray, K: int, Tmax: int) -> np.ndarray:
    return (src[:, 0] * (Tmax + 1) + src[:, 1]) * (K + 1) + src[:, 2]


def _reordered_dispatch(got: dict, want, case: Case, padding: str):
    """Check one rank's dispatch under ``reordered``. Returns (messages [(output, text)],
    ``perm``): ``perm[m]`` is the reference row of the implementation's row ``m`` (-1 for
    padding or a row that matches none). The steps: the layout (counts, offsets, row_src's
    form), each row's slot found in the reference, where the slots sit, then the values."""
    msgs, layout = _reordered_layout(got, want, case)
    if layout is None:
        return msgs, None
    M, off_a, src = layout
    K, Tmax = case.topk, max(case.tokens) if case.tokens else 0
    perm, found = _slot_permutation(src, np.asarray(want.row_src), K, Tmax)
    problem = _misplaced_slot(src, perm, found, off_a, want, case.local_experts)
    if problem:
        msgs.append(("row_src", problem))
    msgs += _reordered_values(got, want, case, perm, src[:, 0] < 0, M, padding == "ignored")
    return msgs, perm


def _reordered_layout(got: dict, want, case: Case):
    """``(messages, (M, expert_offsets, row_src) or None)``: the layout's form: expert_x 2-D,
    tokens_per_expert the reference's, offsets ascending from 0 within M in multiples of align,
    row_src integers [M, 3]. None where the rest cannot be checked."""
    msgs, L = [], case.local_experts
    ex = got.get("expert_x")
    if ex is None or np.ndim(ex) != 2:
        return [("expert_x", "missing" if ex is None else f"shape {list(np.shape(ex))}, "
                 f"expected [M, {case.hidden}]")], None
    M = int(np.shape(ex)[0])
    msg = compare_bitwise(_ints(got.get("tokens_per_expert")), want.tokens_per_expert)
    if msg:
        msgs.append(("tokens_per_expert", msg))
    off_a = _ints(got.get("expert_offsets"))
    if off_a is None or off_a.shape != (L + 1,) or off_a.dtype != np.int64:
        msgs.append(("expert_offsets", "missing" if off_a is None else
                     f"{off_a.dtype} {list(off_a.shape)}, expected integers [{L + 1}]"))
        return msgs, None
    seg = np.diff(off_a)
    if off_a[0] != 0 or (seg < 0).any() or off_a[-1] > M:
        msgs.append(("expert_offsets", f"{off_a.tolist()} is not a layout of {M} rows "
                     "(starts at 0, ascending, ends at M or before, padding rows after it)"))
        return msgs, None
    if (seg % case.align).any():
        j = int(np.flatnonzero(seg % case.align)[0])
        msgs.append(("expert_offsets", f"expert {j}'s segment has {int(seg[j])} rows, not a "
                     f"multiple of align {case.align}"))
    src = _ints(got.get("row_src"))
    if src is None or src.shape != (M, 3) or src.dtype != np.int64:
        msgs.append(("row_src", "missing" if src is None else
                     f"{src.dtype} {list(src.shape)}, expected integers [{M}, 3]"))
        return msgs, None
    return msgs, (M, off_a, src)


def _slot_permutation(src: np.ndarray, wsrc: np.ndarray, K: int, Tmax: int):
    """``(perm, found)``: the reference row holding each implementation row's slot (by its
    (s, t, k) in row_src; -1 for padding or no match) and whether a real row matched."""
    wreal = wsrc[:, 0] >= 0
    real = src[:, 0] >= 0  # a padding row: source rank -1
    wkeys = _slot_keys(wsrc[wreal], K, Tmax)
    wrows = np.flatnonzero(wreal)
    order = np.argsort(wkeys, kind="stable")
    keys = _slot_keys(src, K, Tmax)
    pos = np.clip(np.searchsorted(wkeys[order], keys), 0, max(len(wkeys) - 1, 0))
    found = real & (len(wkeys) > 0)
    if len(wkeys):
        found &= wkeys[order][pos] == keys
    perm = np.where(found, wrows[order][pos] if len(wkeys) else -1, -1)
    return np.where(real & found, perm, -1), found


def _misplaced_slot(src, perm, found, off_a, want, L) -> str | None:
    """The first thing wrong with where the slots sit, or None: a slot the reference does not
    hold here, one held twice, one in another expert's segment, or slots missing."""
    M, wsrc = src.shape[0], np.asarray(want.row_src)
    real, wreal = src[:, 0] >= 0, wsrc[:, 0] >= 0
    expert_of = np.full(M, -1)  # which expert each row sits in (-1: after the last segment)
    for j in range(L):
        expert_of[off_a[j]:off_a[j + 1]] = j
    want_expert = np.full(len(wsrc), -1)
    for j in range(L):
        want_expert[want.expert_offsets[j]:want.expert_offsets[j + 1]] = j
    want_of = want_expert[np.maximum(perm, 0)] if len(want_expert) else np.full(M, -1)
    if (real & ~found).any():
        m = int(np.flatnonzero(real & ~found)[0])
        return f"row {m}: row_src {src[m].tolist()} is not a slot this rank holds in the reference"
    if len(np.unique(perm[real])) != int(real.sum()):
        vals, counts = np.unique(perm[real], return_counts=True)
        m = int(np.flatnonzero(real & (perm == vals[counts > 1][0]))[1])
        return f"row {m}: slot {src[m].tolist()} appears twice"
    if (real & (expert_of != want_of)).any():
        m = int(np.flatnonzero(real & (expert_of != want_of))[0])
        return (f"row {m}: slot {src[m].tolist()} sits in local expert {int(expert_of[m])}, "
                f"the reference puts it in expert {int(want_expert[perm[m]])}")
    if int(real.sum()) != int(wreal.sum()):
        missing = np.setdiff1d(np.flatnonzero(wreal), perm[real])
        return (f"{int(wreal.sum() - real.sum())} slots missing, e.g. "
                f"{wsrc[missing[0]].tolist()}" if len(missing) else "rows missing")
    return None


def _reordered_values(got, want, case, perm, pad, M, keep_pad) -> list:
    """The value outputs against the reference's rows placed in the implementation's layout
    by ``perm``; padding rows zero (or, ``keep_pad``: whatever the implementation holds)."""

    def in_layout(name, ref_rows):
        ref_rows = np.asarray(ref_rows)
        out = np.zeros((M, *ref_rows.shape[1:]), ref_rows.dtype)
        out[perm >= 0] = ref_rows[perm[perm >= 0]]
        g = got.get(name)
        if keep_pad and g is not None and np.shape(g) == out.shape:
            g = np.asarray(g)
            if g.dtype == out.dtype:
                out[pad] = g[pad]
        return out

    checks = [("expert_x", want.expert_x), ("row_weight", want.row_weight)]
    if case.payload is not None:
        checks.append(("expert_scale", want.expert_scale))
        if got.get("expert_x_hp") is not None:
            checks.append(("expert_x_hp", payloads.decode(case.payload, want.expert_x,
                                                          want.expert_scale)))
    msgs = []
    for name, w in checks:
        msg = compare_bitwise(got.get(name), in_layout(name, w))
        if msg:
            msgs.append((name, msg))
    if got.get("dropped_per_expert") is not None:
        msg = compare_bitwise(_ints(got["dropped_per_expert"]), want.dropped_per_expert)
        if msg:
            msgs.append(("dropped_per_expert", msg))
    return msgs


def _ints(a):
    """An integer array as int64 (reordered / bounded accept any integer dtype); else as is."""
    if a is None:
        return None
    a = np.asarray(a)
    return a.astype(np.int64) if a.dtype.kind in "iu" else a


def _exact_dispatch(got: dict, want, case: Case, static: bool, ref):
    checks = [
        ("tokens_per_expert", want.tokens_per_expert, None),
        ("expert_offsets", want.expert_offsets, None),
        ("row_src", want.row_src, -1),
        ("expert_x", want.expert_x, 0),
        ("row_weight", want.row_weight, 0),
    ]
    if case.payload is not None:
        checks.append(("expert_scale", want.expert_scale, 0))
        if got.get("expert_x_hp") is not None:  # dequantized rows, when offered
            checks.append(("expert_x_hp", payloads.decode(case.payload, want.expert_x,
                                                          want.expert_scale), 0))
    if got.get("dropped_per_expert") is not None:
        checks.append(("dropped_per_expert", want.dropped_per_expert, None))
    msgs = []
    for name, w, fill in checks:
        msg = _compare_with_tail(got.get(name), w, fill, static and fill is not None)
        if msg:
            msgs.append((name, msg))
    return msgs


def _not_exact_layout(got: dict, want) -> str:
    """Why a layout that meets ``reordered`` is not exact: integer outputs of another dtype,
    padding rows where the canonical layout has none or others, rows in another order."""
    narrow = [n for n in ("tokens_per_expert", "expert_offsets", "row_src", "dropped_per_expert")
              if got.get(n) is not None and np.asarray(got[n]).dtype != np.int64]
    reasons = [f"integer dtypes ({', '.join(f'{np.asarray(got[n]).dtype} {n}' for n in narrow)})"
               ] if narrow else []
    try:
        src = np.asarray(got.get("row_src")).astype(np.int64)
        wsrc = np.asarray(want.row_src)
        if src.shape == wsrc.shape and (src == wsrc).all():
            same = all(compare_bitwise(_ints(got.get(n)), getattr(want, n)) is None
                       for n in ("tokens_per_expert", "expert_offsets"))
            if same and narrow:
                return reasons[0]
        ours = src[(src >= 0).all(axis=1)]
        theirs = wsrc[wsrc[:, 0] >= 0]
        if ours.shape == theirs.shape and (ours == theirs).all():
            return ", ".join(reasons + ["padding rows"])
    except Exception:  # noqa: BLE001 - a reason only
        pass
    return ", ".join(reasons + ["row order inside experts"])


# -- the check ----------------------------------------------------------------------------------
def _reference():
    import epkit.reference as ref

    return ref


def check_case(case: Case, mode: ModeSpec, results: list[dict], impl: str = "?",
               reference=None, *, contract: str = "exact", capabilities: Capabilities | None = None,
               accumulate: str | None = None) -> Verdict:
    """Compare per-rank ``results`` (from :func:`epkit.verify.worker.run_rank`) with the
    reference (the ``epkit.reference`` module unless another is given) under ``contract``
    (``exact``, ``reordered`` or ``bounded``). ``capabilities`` says how padding is held
    (``padding``) and the accumulation dtype of the bound (``accumulate``, which the
    argument overrides; default float32).

    The steps, in order (each in :class:`_Check`): the reference's dispatch (an expected input
    error ends the check there), what the ranks raised, then each property that the ranks
    reached: dispatch, dispatch backward, combine, combine backward, weight gradient."""
    if contract not in CONTRACTS:
        raise ValueError(f"contract must be one of {', '.join(CONTRACTS)}, got {contract!r}")
    # NaN and infinities in the inputs are drawn on purpose: no floating-point warnings
    with np.errstate(all="ignore"):
        return _check_case(case, mode, results, impl, reference, contract, capabilities,
                           accumulate)


def _check_case(case, mode, results, impl, reference, contract, capabilities, accumulate):
    caps = capabilities or Capabilities()
    c = _Check(case, mode, results, impl, reference or _reference(), contract, caps,
               parse_accumulate(accumulate or caps.accumulate or "float32"))
    xs, idxs, ws = case.all_inputs()
    try:
        c.res = c.ref.dispatch(xs, idxs, ws, num_experts=case.num_experts, align=case.align,
                               capacity=case.capacity, payload=case.payload,
                               ranks_per_node=case.ranks_per_node)
    except ValueError as exc:  # the reference's InputError: every rank must raise it
        return c.expected_error(exc)
    c.raised()
    rank_major = any((r or {}).get("layout") == "rank_major" for r in results)
    if rank_major:
        _rank_major_checks(case, results, c.ref, contract, c.v, c.todo, c.settle,
                           c.value_check)
        return _finish(c.v)
    c.dispatch()
    c.dispatch_backward()
    ys = c.fed(TAG_Y, case.y_dtype) if _STAGE["combine"] < c.reached else None
    c.combine(ys)
    if c.todo("combine_backward") or c.todo("weight_grad"):
        gos = [np.asarray(results[r]["grad_out"]) for r in range(case.world_size)]
        c.combine_backward(gos, ys)
        c.weight_grad(gos, ys)
    return _finish(c.v)


class _Check:
    """One case's comparison: the verdict so far and what every step needs (the case, the
    ranks' results, the reference's dispatch ``res``, the contract, the capabilities)."""

    def __init__(self, case, mode, results, impl, ref, contract, caps, acc):
        self.case, self.mode, self.results, self.ref = case, mode, results, ref
        self.contract, self.caps, self.acc = contract, caps, acc
        self.v = Verdict(case=case, mode=mode, impl=impl, contract=contract)
        self.R = case.world_size
        self.errs = {r: res["error"] for r, res in enumerate(results) if res.get("error")}
        self.reached = len(STAGES)
        self.res = None

    # -- bookkeeping shared by the steps ---------------------------------------------------
    def todo(self, p):
        return _STAGE[p] < self.reached and p not in self.v.status

    def settle(self, p, rank, output, level, exact_msg, weak_msg, reason):
        """Record what property ``p`` met on ``rank``: the strongest contract ``level`` (None:
        none), the message at the requested contract, the reason it is not exact."""
        v = self.v
        v.met[p] = weaker(v.met.get(p, "exact"), level)
        if level is not None and level != "exact" and reason:
            v.not_exact.setdefault(p, reason)
        if level is None or _RANK[level] > _RANK[self.contract]:
            v.fail(p, rank, output,
                   exact_msg if self.contract == "exact" else (weak_msg or exact_msg))

    def acc_for(self, p) -> str:
        """The accumulation dtype of property ``p``'s sums: the declaration's for the data
        they read and write (x's dtype for dispatch's backward, x's and expert_y's else)."""
        dtypes = (self.case.dtype,) if p == "dispatch_backward" else (self.case.dtype,
                                                                      self.case.y_dtype)
        return accumulation_dtype(self.acc, *dtypes)

    def narrowed(self, p) -> bool:
        """Does ``p``'s sum multiply float32 factors converted to bfloat16 (the declared
        accumulation)? Then an infinite exact value may come out NaN (special_ok)."""
        case = self.case
        factors = {"combine": (case.y_dtype, "float32" if case.weighted else case.y_dtype),
                   "combine_backward": (case.dtype, "float32" if case.weighted else case.dtype),
                   "weight_grad": (case.dtype, case.y_dtype)}.get(p, ())
        return self.acc_for(p) == "bfloat16" and "float32" in factors

    def value_check(self, p, r, output, got, want, exact64, absum, nterms, out_dtype, mask=None,
                    factors=None):
        bit = compare_bitwise(got, want) if mask is None else compare_bitwise(
            np.where(mask, got, want) if got is not None and np.shape(got) == np.shape(want)
            and np.asarray(got).dtype == np.asarray(want).dtype else got, want)
        if bit is None:
            self.settle(p, r, output, "exact", None, None, None)
            return
        msg, ratio, u = _bounded(got, exact64, absum, nterms, out_dtype, self.acc_for(p), mask,
                                 self.narrowed(p), factors)
        if np.isfinite(ratio):
            self.v.worst[p] = max(self.v.worst.get(p, (0.0, 0.0)), (ratio, u))
        reason = {"combine": "combine summation order",
                  "dispatch_backward": "dispatch backward summation order",
                  "combine_backward": "combine backward rounding"}[p]
        self.settle(p, r, output, None if msg else "bounded", bit, msg, reason)

    def fed(self, tag, dtype):
        """The rows fed to the reference: the same slot rows as the implementation got,
        placed in the reference's layout."""
        return [self.case.slot_rows(d, tag, self.res[d].row_src, dtype) for d in range(self.R)]

    # -- the steps ---------------------------------------------------------------------------
    def expected_error(self, expected) -> Verdict:
        """The reference raised: every rank must raise a ValueError from dispatch (returning
        nothing), epkit the same InputError, message included."""
        v, errs, R = self.v, self.errs, self.R
        bad = [r for r in range(R) if not (errs.get(r) or {}).get("input_error")
               or errs[r].get("stage") not in ("dispatch", "factory")]
        if bad:
            e = errs.get(bad[0])
            if e is None:
                what = "did not raise"
            elif not e.get("input_error"):
                first = (e["message"] or "").splitlines()[0] if e["message"] else ""
                what = f"raised {e['type']} in stage {e['stage']}: {first}"
            else:
                what = f"returned from dispatch and raised only in stage {e['stage']}"
            invalid = f" ({self.case.violation.replace('_', ' ')})" if self.case.violation else ""
            v.fail("dispatch", bad[0], "error",
                   f"invalid input{invalid}: the reference raises {type(expected).__name__}: "
                   f"{expected}; every rank must raise ValueError from dispatch, rank {bad[0]} "
                   f"{what}")
        else:
            wrong = [r for r in range(R) if errs[r]["message"].startswith("epkit: ")
                     and errs[r]["message"] != str(expected)]
            if wrong:
                v.fail("dispatch", wrong[0], "error", f"message {errs[wrong[0]]['message']!r}, "
                       f"expected {str(expected)!r}")
            else:
                v.status["dispatch"] = PASSED
                v.met["dispatch"] = "exact"
        for p in PROPERTIES[1:]:
            v.status.setdefault(p, NA)
        return v

    def raised(self):
        """Ranks that raised: the properties from the earliest such stage on are refused (every
        rank raised NotImplementedError at one stage) or failed."""
        v, errs = self.v, self.errs
        if not errs:
            return
        stage_idx = {r: (STAGES.index(e["stage"]) if e["stage"] in STAGES else -1)
                     for r, e in errs.items()}
        self.reached = min(stage_idx.values())
        uniform = (len(errs) == self.R and len(set(stage_idx.values())) == 1
                   and all(e["unsupported"] for e in errs.values()))
        e0 = errs[min(errs)]
        first_line = e0["message"].splitlines()[0] if e0["message"] else ""
        if uniform:
            v.refusal = f"{e0['stage']}: NotImplementedError: {first_line}".rstrip(": ")
        for p in PROPERTIES:
            if _STAGE[p] >= self.reached:
                if p == "weight_grad" and not self.case.weighted:
                    v.status[p] = NA
                elif uniform:
                    v.status[p] = REFUSED
                else:
                    v.fail(p, min(errs), f"stage {e0['stage']}",
                           f"raised {e0['type']}: {first_line}")
        if not uniform:
            for r in sorted(errs):
                e = errs[r]
                v.errors.append(f"rank {r}, stage {e['stage']}: {e['type']}: {e['message']}\n"
                                f"{e.get('traceback') or ''}")

    def dispatch(self):
        if not self.todo("dispatch"):
            return
        v, case = self.v, self.case
        v.status["dispatch"] = PASSED
        for r in range(self.R):
            got, want = self.results[r]["dispatch"], self.res[r]
            exact = _exact_dispatch(got, want, case, self.mode.static, self.ref)
            level, weak = "exact", []
            if exact:
                weak, _ = _reordered_dispatch(got, want, case, self.caps.padding)
                level = None if weak else "reordered"
            v.met["dispatch"] = weaker(v.met.get("dispatch", "exact"), level)
            if level == "reordered":
                v.not_exact.setdefault("dispatch", _not_exact_layout(got, want))
            if level is None or _RANK[level] > _RANK[self.contract]:
                for name, msg in (exact if self.contract == "exact" else weak):
                    v.fail("dispatch", r, name, msg)
                self.kept_dropped_slots(r, got, want)

    def kept_dropped_slots(self, r, got, want):
        """An implementation that keeps slots the case's capacity drops (it ignores
        ``capacity``) is told so, with the three ways forward."""
        if self.case.capacity is None:
            return
        src = sane_row_src(got.get("row_src"), int(np.shape(got.get("expert_x"))[0])
                           if got.get("expert_x") is not None else 0)
        kept, ref_kept = int((src[:, 0] >= 0).sum()), int((want.row_src[:, 0] >= 0).sum())
        if kept > ref_kept:
            self.v.mismatches.append(Mismatch(
                "dispatch", r, "capacity",
                f"holds {kept} slots where capacity {self.case.capacity} keeps {ref_kept}: "
                "it keeps slots the capacity drops. Implement capacity, refuse it (raise "
                "NotImplementedError when capacity is not None), or declare --supports "
                "capacity=no"))

    def dispatch_backward(self):
        if not self.todo("dispatch_backward"):
            return
        case, results, R = self.case, self.results, self.R
        if any(isinstance(results[r].get("grad_x"), str) for r in range(R)):
            self.v.status["dispatch_backward"] = REFUSED
            self.v.refusal = self.v.refusal or ("dispatch_backward: quantized dispatch "
                                                "without expert_x_hp")
            return
        # a quantized payload's gradient flows through expert_x_hp, float32
        hp = case.payload is not None and results and \
            (results[0].get("dispatch") or {}).get("expert_x_hp") is not None
        gs = self.fed(TAG_GRAD_X, "float32" if hp else case.dtype)
        want = self.ref.dispatch_backward(gs, self.res)
        ex64, ab, n, _ = _token_sums(gs, self.res, False, case.tokens, case.hidden)
        self.v.status["dispatch_backward"] = PASSED
        for r in range(R):
            self.value_check("dispatch_backward", r, "grad_x", results[r].get("grad_x"),
                             want[r], ex64[r], ab[r], n[r], case.dtype)

    def combine(self, ys):
        if not self.todo("combine"):
            return
        case = self.case
        want = self.ref.combine(ys, self.res, weighted=case.weighted)
        ex64, ab, n, fs = _token_sums(ys, self.res, case.weighted, case.tokens, case.hidden)
        self.v.status["combine"] = PASSED
        for r in range(self.R):
            self.value_check("combine", r, "out", self.results[r].get("out"), want[r], ex64[r],
                             ab[r], n[r], case.dtype, factors=fs[r])

    def combine_backward(self, gos, ys):
        """grad_expert_y on every rank: the reference's gradient rows, placed by slot in the
        implementation's layout, compared where the implementation has real rows."""
        case, res, R = self.case, self.res, self.R
        gys, _gws = self.ref.combine_backward(gos, ys, res, weighted=case.weighted)
        self.v.status["combine_backward"] = PASSED
        for r in range(R):
            rows = int(np.shape(self.results[r]["expert_y"])[0])
            src = sane_row_src(self.results[r]["dispatch"].get("row_src"), rows)
            want, ex64, nterm, fs = _placed_grad_y(case, res, gys, gos, src, rows, R)
            mask = None
            if self.caps.padding == "ignored" and self.contract != "exact":
                mask = np.broadcast_to((src[:, 0] >= 0)[:, None], want.shape)
            self.value_check("combine_backward", r, "grad_expert_y",
                             self.results[r].get("grad_y"), want, ex64, np.abs(ex64), nterm,
                             case.y_dtype, mask, factors=fs)

    def weight_grad(self, gos, ys):
        case, res, R, v = self.case, self.res, self.R, self.v
        if not case.weighted:
            v.status["weight_grad"] = NA
            return
        v.status["weight_grad"] = PASSED
        got_w = [self.results[r].get("grad_w") for r in range(R)]
        bad = weight_grad_tolerance(got_w, gos, ys, res, case.topk, case.hidden)
        ex64, ab, n, fs = _weight_grad_exact(gos, ys, res, case.topk)
        for r in range(R):
            msg, ratio, u = _bounded(got_w[r], ex64[r], ab[r], n[r], "float32",
                                     self.acc_for("weight_grad"), None,
                                     self.narrowed("weight_grad"), fs[r])
            if np.isfinite(ratio):
                v.worst["weight_grad"] = max(v.worst.get("weight_grad", (0.0, 0.0)), (ratio, u))
            level = "exact" if r not in bad else (None if msg else "bounded")
            self.settle("weight_grad", r, "grad_topk_weights", level, bad.get(r), msg,
                        "weight gradient precision")


def _placed_grad_y(case, res, gys, gos, src, rows, R):
    """The reference's grad_expert_y rows ``gys`` placed, slot by slot, at the rows ``src``
    (``[rows, 3]`` (s, t, k)) of an implementation's layout; with the float64 exact values and
    term counts the bound needs. Rows matching no reference slot stay zero."""
    want = np.zeros((rows, case.hidden), gys[0].dtype if gys else np.float32)
    ex64 = np.zeros((rows, case.hidden))
    nterm = np.zeros((rows, case.hidden))
    factors = np.zeros((rows, case.hidden))
    real = src[:, 0] >= 0
    keys = _slot_keys(src, case.topk, max(case.tokens))
    for d in range(R):
        wkeys = _slot_keys(np.asarray(res[d].row_src), case.topk, max(case.tokens))
        wreal = np.asarray(res[d].row_src)[:, 0] >= 0
        hit = real & np.isin(keys, wkeys[wreal])
        if not hit.any():
            continue
        rows_w = np.flatnonzero(wreal)
        order = np.argsort(wkeys[rows_w], kind="stable")
        ms = rows_w[order][np.searchsorted(wkeys[rows_w][order], keys[hit])]
        want[hit] = gys[d][ms]
        c = np.asarray(res[d].row_weight, np.float64)[ms] if case.weighted else 1.0
        g64 = np.zeros((int(hit.sum()), case.hidden))
        for s in np.unique(src[hit][:, 0]):
            on = src[hit][:, 0] == s
            g64[on] = np.asarray(gos[int(s)]).astype(np.float64)[src[hit][on, 1]]
        ex64[hit] = (g64 * (c[:, None] if case.weighted else 1.0))
        factors[hit] = np.abs(g64) + (np.abs(c)[:, None] if case.weighted else 1.0)
        nterm[hit] = 1
    return want, ex64, nterm, factors


def _finish(v: Verdict) -> Verdict:
    for p in PROPERTIES:
        if p not in v.status:
            v.status[p] = SKIPPED
        if v.status[p] in (REFUSED, SKIPPED, NA):
            v.met.pop(p, None)
        elif v.status[p] == FAILED and p not in v.met:
            v.met[p] = None  # it raised, or its outputs could not be read
    return v


# -- rank-major results --------------------------------------------------------------------------
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
            _rank_major_dispatch(case, results[d]["dispatch"], res[d], d, contract, v)
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
    """One rank's rank-major fields: exact (the reference's rows in its order) or reordered
    (the same rows matched by ``recv_src``, each token (s, t) once)."""
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
    fed = [case.token_rows(d, tag, res[d].recv_src, fed_dtype) for d in range(R)]
    acc = [np.zeros((case.tokens[s], H), np.float32) for s in range(R)]
    ex = [np.zeros((case.tokens[s], H)) for s in range(R)]
    ab = [np.zeros((case.tokens[s], H)) for s in range(R)]
    n = [np.zeros((case.tokens[s], H)) for s in range(R)]
    for d in range(R):
        src = np.asarray(res[d].recv_src)
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
