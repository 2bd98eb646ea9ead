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
A failure names the property, the rank, the output, the worst differing element (then the
first, where another) with both values (and their bits, or the error in units of the bound and
in ulps), and the case with a
snippet that replays it.

This module runs the check (:func:`check_case`, step by step in :class:`_Check`); the parts it
uses live apart, one job each: :mod:`~epkit.verify.verdict` (statuses, contracts, the report),
:mod:`~epkit.verify.compare` (bitwise comparison), :mod:`~epkit.verify.bounds` (the error bound
and the weight gradient's tolerance), :mod:`~epkit.verify.layout` (dispatch's layout, exact or
reordered) and :mod:`~epkit.verify.rankmajor` (rank-major results). Their public names are
importable from here too.
"""

from __future__ import annotations

import numpy as np

from .accumulate import accumulation_dtype, parse_accumulate
from .bounds import (_bounded, _token_sums, _weight_grad_exact, sum_bound, ulps,  # noqa: F401
                     unit_roundoff, weight_grad_tolerance)
from .capabilities import Capabilities
from .cases import (CALLS, ORDERS, PRODUCES, STAGES, TAG_GRAD_X, TAG_Y, Case, ModeSpec,
                    sane_row_src)
from .compare import compare_bitwise
from .half import reference_for
from .layout import _exact_dispatch, _not_exact_layout, _reordered_dispatch, _slot_keys
from .rankmajor import _rank_major_checks
from .verdict import (_RANK, CONTRACTS, FAILED, NA, PASSED, PROPERTIES, REFUSED,
                      SKIPPED, Mismatch, Verdict, weaker)

__all__ = ["CONTRACTS", "PROPERTIES", "Mismatch", "Verdict", "check_case", "compare_bitwise",
           "sum_bound", "ulps", "unit_roundoff", "weight_grad_tolerance"]


FAST_SLOTS = 4096  # slots in a case from which the reference's vectorized tier checks it


def _reference(case: Case | None = None):
    """The reference module: its vectorized tier (``epkit.reference.fast``, the same bits)
    for a case of many slots whose sums run rank by rank (``ranks_per_node`` 1), so the
    count-overflow corner costs milliseconds; else the clear tier."""
    import epkit.reference as ref

    if case is not None and case.ranks_per_node == 1 and case.violation is None and \
            sum(case.tokens) * case.topk >= FAST_SLOTS:
        return _Fast(ref.fast)
    return ref


class _Fast:
    """``epkit.reference.fast`` with the clear tier's dispatch signature (rank by rank only:
    ``ranks_per_node`` 1)."""

    def __init__(self, fast):
        self._fast = fast

    def __getattr__(self, name):
        return getattr(self._fast, name)

    def dispatch(self, *args, ranks_per_node=1, **kwargs):
        assert ranks_per_node == 1, "the vectorized tier sums rank by rank"
        return self._fast.dispatch(*args, **kwargs)


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
        v = _check_case(case, mode, results, impl, reference, contract, capabilities,
                        accumulate)
        if case.sequence == "single":
            return v
        # the twin ran on the same adapter: its results are checked as its own case's
        twin = [r.get("twin") or {"rank": n, "error": r.get("error") or {
                    "stage": None, "type": "Missing", "unsupported": False,
                    "input_error": False, "message": "no result for the twin batch"}}
                for n, r in enumerate(results)]
        return _merged(v, _check_case(case.twin(), mode, twin, impl, reference, contract,
                                      capabilities, accumulate))


_WORST = (FAILED, REFUSED, SKIPPED, PASSED, NA)  # a sequence's status: its batches' worst


def _merged(v: Verdict, w: Verdict) -> Verdict:
    """The verdict of a sequence: the case's ``v`` and its twin's ``w``, each property at the
    worse status (a batch's property not run, since the other raised first, leaves the
    other's) and the weaker contract of the two; the twin's mismatches and errors say that
    they are the second batch's."""
    for p in PROPERTIES:
        a, b = v.status.get(p, SKIPPED), w.status.get(p, SKIPPED)
        # a batch that did not run (the other raised first) leaves the other's status
        v.status[p] = a if b == SKIPPED else b if a == SKIPPED else min((a, b),
                                                                          key=_WORST.index)
        if p in v.met or p in w.met:
            v.met[p] = weaker(v.met.get(p, "exact"), w.met.get(p, "exact"))
        if p in w.not_exact:
            v.not_exact.setdefault(p, w.not_exact[p])
        if p in w.worst:
            v.worst[p] = max(v.worst.get(p, (0.0, 0.0)), w.worst[p])
    v.mismatches += [Mismatch(m.prop, m.rank, m.output, "second batch (the twin): " + m.message)
                     for m in w.mismatches]
    v.errors += ["second batch (the twin): " + e for e in w.errors]
    v.refusal = v.refusal or w.refusal
    return v


def _check_case(case, mode, results, impl, reference, contract, capabilities, accumulate):
    caps = capabilities or Capabilities()
    ref = reference_for(case, reference or _reference(case))
    c = _Check(case, mode, results, impl, ref, contract, caps,
               parse_accumulate(accumulate or caps.accumulate or "float32"))
    xs, idxs, ws = case.all_inputs()
    try:
        c.res = c.ref.dispatch(xs, idxs, ws, num_experts=case.num_experts, align=case.align,
                               capacity=case.capacity, payload=case.payload,
                               ranks_per_node=case.ranks_per_node)
    except ValueError as exc:  # the reference's InputError: every rank must raise it
        return _untouched(c.expected_error(exc), results)
    c.raised()
    rank_major = any((r or {}).get("layout") == "rank_major" for r in results)
    if rank_major:
        _rank_major_checks(case, results, c.ref, contract, c.v, c.todo, c.settle,
                           c.value_check)
        return _finish(_untouched(c.v, results))
    c.dispatch()
    c.dispatch_backward()
    ys = c.fed(TAG_Y, case.y_dtype) if "combine" not in c.skip else None
    c.combine(ys)
    if c.todo("combine_backward") or c.todo("weight_grad"):
        gos = [np.asarray(results[r]["grad_out"]) for r in range(case.world_size)]
        c.combine_backward(gos, ys)
        c.weight_grad(gos, ys)
    return _finish(_untouched(c.v, results))


class _Check:
    """One case's comparison: the verdict so far and what every step needs (the case, the
    ranks' results, the reference's dispatch ``res``, the contract, the capabilities)."""

    def __init__(self, case, mode, results, impl, ref, contract, caps, acc):
        self.case, self.mode, self.results, self.ref = case, mode, results, ref
        self.contract, self.caps, self.acc = contract, caps, acc
        self.v = Verdict(case=case, mode=mode, impl=impl, contract=contract)
        self.R = case.world_size
        self.errs = {r: res["error"] for r, res in enumerate(results) if res.get("error")}
        self.skip = set()  # the properties whose stage did not run: it or one before raised
        self.res = None

    # -- bookkeeping shared by the steps ---------------------------------------------------
    def todo(self, p):
        return p not in self.skip and p not in self.v.status

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
        """Does ``p``'s sum multiply float32 factors converted to bfloat16 or float16 (the
        declared accumulation)? Then an infinite exact value may come out NaN (special_ok)."""
        case = self.case
        factors = {"combine": (case.y_dtype, "float32" if case.weighted else case.y_dtype),
                   "combine_backward": (case.dtype, "float32" if case.weighted else case.dtype),
                   "weight_grad": (case.dtype, case.y_dtype)}.get(p, ())
        return self.acc_for(p) in ("bfloat16", "float16") and "float32" in factors

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
            v.accepted_invalid = self.case.violation or "invalid input"
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
        self.skip = set().union(*(_from_stage(e["stage"], self.case.order)
                                  for e in errs.values()))
        uniform = (len(errs) == self.R and len({e["stage"] for e in errs.values()}) == 1
                   and all(e["unsupported"] for e in errs.values()))
        # a batch of a sequence stopped because the other one raised: not run, not failed
        copied = all(e.get("copied") for e in errs.values())
        e0 = errs[min(errs)]
        first_line = e0["message"].splitlines()[0] if e0["message"] else ""
        if uniform:
            v.refusal = f"{e0['stage']}: NotImplementedError: {first_line}".rstrip(": ")
        for p in PROPERTIES:
            if p in self.skip:
                if p == "weight_grad" and not self.case.weighted:
                    v.status[p] = NA
                elif uniform:
                    v.status[p] = REFUSED
                elif copied:
                    v.status[p] = SKIPPED
                else:
                    v.fail(p, min(errs), f"stage {e0['stage']}",
                           f"raised {e0['type']}: {first_line}")
        if not uniform and not copied:
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


def _from_stage(stage, order) -> set:
    """The properties a raise in ``stage`` leaves unmade: those of that stage and of every
    later one in the case's ``order`` (a rank-major result runs ``stages``); all of them for
    a raise outside the stages (the factory, the inputs, a dead worker)."""
    for stages in (ORDERS[order], STAGES):
        if stage in stages:
            return {p for s in stages[stages.index(stage):] for p in PRODUCES[s]}
    return set(PROPERTIES)


def _untouched(v: Verdict, results) -> Verdict:
    """An input the adapter wrote into (the worker's ``tampered``: the stage after which
    x, topk_idx, topk_weights, a fed gradient or expert_y no longer held the harness's bytes)
    fails the property of that stage, whatever its values: ``dispatch wrote into topk_idx``."""
    for r, res in enumerate(results):
        for stage, name in (res or {}).get("tampered") or ():
            p = "combine_backward" if stage == "backward" else stage
            v.fail(p, r, name, f"{CALLS[stage]} wrote into {name} (the caller's input, "
                   "which it must leave unchanged)")
            v.met[p] = None
    return v


def _finish(v: Verdict) -> Verdict:
    for p in PROPERTIES:
        if p not in v.status:
            v.status[p] = SKIPPED
        if v.status[p] in (REFUSED, SKIPPED, NA):
            v.met.pop(p, None)
        elif v.status[p] == FAILED and p not in v.met:
            v.met[p] = None  # it raised, or its outputs could not be read
    return v
