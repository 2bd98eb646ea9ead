"""Compare what the ranks returned with the reference.

Bitwise wherever the spec says so (every output but one); ``grad_topk_weights`` within the
stated tolerance of docs/design.md item 6:
``|got - exact| <= H * 2**-23 * sum_h |g_h * y_h| + 2**-126``, ``exact`` the float64 dot product.
A failure names the property, the rank, the output, the first differing element with both values
(and their bits), and the case with a snippet that replays it.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import numpy as np

from epkit.verify.cases import STAGES, Case, ModeSpec

__all__ = ["PROPERTIES", "Mismatch", "Verdict", "check_case", "compare_bitwise",
           "weight_grad_tolerance"]

# Properties (rows of the closing table) and the stage that produces each.
PROPERTIES = ("dispatch", "dispatch_backward", "combine", "combine_backward", "weight_grad")
_STAGE = {"dispatch": 0, "dispatch_backward": 1, "combine": 2, "combine_backward": 3,
          "weight_grad": 3}
PASSED, FAILED, UNSUPPORTED, SKIPPED = "passed", "failed", "unsupported", "skipped"


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
    """The outcome of one case: a status per property, and what went wrong."""

    case: Case
    mode: ModeSpec
    impl: str
    status: dict = field(default_factory=dict)
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # worker exceptions, with tracebacks

    @property
    def failed(self) -> bool:
        return any(s == FAILED for s in self.status.values())

    @property
    def failed_properties(self) -> list[str]:
        return [p for p in PROPERTIES if self.status.get(p) == FAILED]

    def fail(self, prop, rank, output, message):
        self.status[prop] = FAILED
        self.mismatches.append(Mismatch(prop, rank, output, message))

    def report(self) -> str:
        c = self.case
        lines = [f"FAILED {', '.join(self.failed_properties)} [mode {self.mode.name}, "
                 f"impl {self.impl}]"]
        lines += ["  " + str(m) for m in self.mismatches]
        for e in self.errors:
            lines.append(textwrap.indent(e.rstrip(), "    "))
        lines.append(
            f"  case: world {c.world_size}, experts {c.num_experts}, top-k {c.topk}, hidden "
            f"{c.hidden}, tokens {list(c.tokens)}, x {c.dtype}, expert_y {c.y_dtype}, "
            f"idx {c.idx_dtype}, routing {c.routing}, align {c.align}, capacity {c.capacity}, "
            f"{'weighted' if c.weighted else 'unweighted'}, payload {c.payload}, "
            f"NaN padding {c.nan_padding}, seed {c.seed}")
        lines.append("  reproduce:")
        lines.append(textwrap.indent(c.snippet(self.impl, self.mode.name), "    "))
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


def compare_bitwise(got, want) -> str | None:
    """None when ``got`` has ``want``'s shape, dtype and bytes; else what differs."""
    want = np.asarray(want)
    if got is None:
        return f"missing (expected {want.dtype} {list(want.shape)})"
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if want.size == 0:
        return None
    u = np.dtype(f"u{want.dtype.itemsize}")
    diff = np.ascontiguousarray(got).view(u) != np.ascontiguousarray(want).view(u)
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


def weight_grad_tolerance(got, grad_outs, expert_ys, res, topk, hidden):
    """Check ``grad_topk_weights`` of every rank within the stated tolerance.

    Returns ``{rank: message}`` for the ranks that fail. ``exact`` is computed here in float64
    from the gradient and expert rows actually fed, placed by the reference's ``row_src``."""
    R = len(grad_outs)
    exact = [np.zeros((len(grad_outs[s]), topk), dtype=np.float64) for s in range(R)]
    bound = [np.zeros_like(e) for e in exact]
    for d in range(R):
        src = np.asarray(res[d].row_src)
        y = np.asarray(expert_ys[d][: len(src)]).astype(np.float64)
        for i in np.flatnonzero(src[:, 0] >= 0):
            s, t, k = (int(v) for v in src[i])
            g = np.asarray(grad_outs[s][t]).astype(np.float64)
            exact[s][t, k] = float(np.dot(g, y[i]))
            bound[s][t, k] = float(np.abs(g * y[i]).sum())
    bad = {}
    for s in range(R):
        want_shape = exact[s].shape
        if got[s] is None:
            bad[s] = f"missing (expected float32 {list(want_shape)})"
            continue
        g = np.asarray(got[s])
        if g.shape != want_shape or g.dtype != np.float32:
            bad[s] = f"{g.dtype} {list(g.shape)}, expected float32 {list(want_shape)}"
            continue
        tol = hidden * 2.0**-23 * bound[s] + 2.0**-126
        err = np.abs(g.astype(np.float64) - exact[s])
        over = ~(err <= tol)  # NaN counts as over
        if over.any():
            first = int(np.flatnonzero(over)[0])
            t, k = np.unravel_index(first, want_shape)
            bad[s] = (f"[{want_shape[0]}, {want_shape[1]}] float32: token {t}, slot {k}: got "
                      f"{float(g[t, k])!r}, exact {float(exact[s][t, k])!r}, |error| "
                      f"{err[t, k]:.3g} > tolerance {tol[t, k]:.3g}; {int(over.sum())} of "
                      f"{g.size} outside")
    return bad


# -- the check ----------------------------------------------------------------------------------
def _reference():
    import epkit.reference as ref

    return ref


def check_case(case: Case, mode: ModeSpec, results: list[dict], impl: str = "?",
               reference=None) -> Verdict:
    """Compare per-rank ``results`` (from :func:`epkit.verify.worker.run_rank`) with the
    reference (the ``epkit.reference`` module unless another is given)."""
    ref = reference or _reference()
    v = Verdict(case=case, mode=mode, impl=impl)
    R = case.world_size
    xs, idxs, ws = case.all_inputs()

    # Errors raised on the ranks: which stage did each rank fail in?
    errs = {r: res["error"] for r, res in enumerate(results) if res.get("error")}
    reached = len(STAGES)
    expected_error = None
    try:
        res = ref.dispatch(xs, idxs, ws, num_experts=case.num_experts, align=case.align,
                           capacity=case.capacity, payload=case.payload)
    except ValueError as exc:  # the reference's InputError: every rank must raise it
        expected_error, res = exc, None

    if expected_error is not None:
        bad = [r for r in range(R) if not (errs.get(r) or {}).get("input_error")]
        if bad:
            v.fail("dispatch", bad[0], "error",
                   f"expected an input error on every rank ({expected_error}), rank {bad[0]} "
                   + ("raised " + errs[bad[0]]["type"] if bad[0] in errs else "did not raise"))
        else:
            wrong = [r for r in range(R) if errs[r]["message"].startswith("epkit: ")
                     and errs[r]["message"] != str(expected_error)]
            if wrong:
                v.fail("dispatch", wrong[0], "error", f"message {errs[wrong[0]]['message']!r}, "
                       f"expected {str(expected_error)!r}")
            else:
                v.status["dispatch"] = PASSED
        for p in PROPERTIES[1:]:
            v.status.setdefault(p, SKIPPED)
        return v

    if errs:
        stage_idx = {r: (STAGES.index(e["stage"]) if e["stage"] in STAGES else -1)
                     for r, e in errs.items()}
        reached = min(stage_idx.values())
        uniform = (len(errs) == R and len(set(stage_idx.values())) == 1
                   and all(e["unsupported"] for e in errs.values()))
        for p in PROPERTIES:
            if _STAGE[p] >= reached:
                if uniform:
                    v.status[p] = UNSUPPORTED
                else:
                    r0 = min(errs)
                    e = errs[r0]
                    v.fail(p, r0, f"stage {e['stage']}", f"raised {e['type']}: "
                           f"{e['message'].splitlines()[0] if e['message'] else ''}")
        if not uniform:
            for r in sorted(errs):
                e = errs[r]
                v.errors.append(f"rank {r}, stage {e['stage']}: {e['type']}: {e['message']}\n"
                                f"{e.get('traceback') or ''}")

    def todo(p):
        return _STAGE[p] < reached and p not in v.status

    static = mode.static
    layout_ok = True
    if todo("dispatch"):
        v.status["dispatch"] = PASSED
        for r in range(R):
            got, want = results[r]["dispatch"], res[r]
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
                    checks.append(("expert_x_hp",
                                   ref.dequantize_mxfp8(want.expert_x, want.expert_scale), 0))
            if got.get("dropped_per_expert") is not None:
                checks.append(("dropped_per_expert", want.dropped_per_expert, None))
            for name, w, fill in checks:
                msg = _compare_with_tail(got.get(name), w, fill, static and fill is not None)
                if msg:
                    v.fail("dispatch", r, name, msg)
                    if name in ("tokens_per_expert", "expert_offsets", "row_src"):
                        layout_ok = False
    elif "dispatch" in v.status and v.status["dispatch"] != PASSED:
        layout_ok = False

    if not layout_ok:  # the rows do not mean what the reference's rows mean: nothing to compare
        for p in PROPERTIES[1:]:
            if todo(p):
                v.status[p] = SKIPPED
        return v

    rows = [len(res[r].row_src) for r in range(R)]
    if todo("dispatch_backward"):
        if any(isinstance(results[r].get("grad_x"), str) for r in range(R)):
            v.status["dispatch_backward"] = UNSUPPORTED
        else:
            gxs = [np.asarray(results[r]["grad_expert_x"])[: rows[r]] for r in range(R)]
            want = ref.dispatch_backward(gxs, res)
            v.status["dispatch_backward"] = PASSED
            for r in range(R):
                msg = compare_bitwise(results[r].get("grad_x"), want[r])
                if msg:
                    v.fail("dispatch_backward", r, "grad_x", msg)

    ys = [np.asarray(results[r].get("expert_y"))[: rows[r]] for r in range(R)] \
        if _STAGE["combine"] < reached else None
    if todo("combine"):
        want = ref.combine(ys, res, weighted=case.weighted)
        v.status["combine"] = PASSED
        for r in range(R):
            msg = compare_bitwise(results[r].get("out"), want[r])
            if msg:
                v.fail("combine", r, "out", msg)

    if todo("combine_backward") or todo("weight_grad"):
        gos = [np.asarray(results[r]["grad_out"]) for r in range(R)]
        gys, _gws = ref.combine_backward(gos, ys, res, weighted=case.weighted)
        v.status["combine_backward"] = PASSED
        for r in range(R):
            msg = _compare_with_tail(results[r].get("grad_y"), gys[r], 0, static)
            if msg:
                v.fail("combine_backward", r, "grad_expert_y", msg)
        if not case.weighted:
            v.status["weight_grad"] = SKIPPED
        else:
            v.status["weight_grad"] = PASSED
            bad = weight_grad_tolerance([results[r].get("grad_w") for r in range(R)], gos, ys,
                                        res, case.topk, case.hidden)
            for r, msg in sorted(bad.items()):
                v.fail("weight_grad", r, "grad_topk_weights", msg)
    return v
