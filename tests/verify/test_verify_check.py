"""The checker on its own (no processes): results made by the reference pass; each kind of
damage is reported with property, rank, output, first differing element and both values."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import epkit.reference as ref
from epkit.reference import payloads
from epkit.verify.cases import TAG_GRAD_X, TAG_Y, Case, ModeSpec
from epkit.verify.checks import (PROPERTIES, check_case, compare_bitwise,
                                weight_grad_tolerance)

CASE = Case(world_size=3, num_experts=6, topk=3, hidden=5, tokens=(4, 0, 6), dtype="bfloat16",
            y_dtype="float32", routing="grouped", unused_pct=0, align=2, capacity=3,
            weighted=True, nan_padding=True, seed=11)


def perfect_results(case: Case, static_tail: int = 0):
    """What a correct implementation returns, computed with the reference."""
    xs, idx, ws = case.all_inputs()
    res = ref.dispatch(xs, idx, ws, num_experts=case.num_experts, align=case.align,
                       capacity=case.capacity, payload=case.payload)
    out = []
    for r, d in enumerate(res):
        fields = {k: getattr(d, k) for k in ("expert_x", "tokens_per_expert", "expert_offsets",
                                             "row_src", "row_weight", "dropped_per_expert",
                                             "expert_scale")}
        if static_tail:
            fields["expert_x"] = np.concatenate(
                [d.expert_x, np.zeros((static_tail, case.hidden), d.expert_x.dtype)])
            fields["row_src"] = np.concatenate([d.row_src, np.full((static_tail, 3), -1)])
            fields["row_weight"] = np.concatenate([d.row_weight, np.zeros(static_tail, "f4")])
        g_dtype = case.dtype
        if case.payload:
            fields["expert_x_hp"] = payloads.decode(case.payload, d.expert_x, d.expert_scale)
            g_dtype = "float32"
        src = fields["row_src"]
        out.append({"rank": r, "error": None, "dispatch": fields,
                    "grad_expert_x": case.slot_rows(r, TAG_GRAD_X, src, g_dtype),
                    "expert_y": case.slot_rows(r, TAG_Y, src, case.y_dtype),
                    "grad_out": case.grad_out(r)})
    m = [len(d.row_src) for d in res]
    gx = ref.dispatch_backward([o["grad_expert_x"][:n] for o, n in zip(out, m)], res)
    ys = [o["expert_y"][:n] for o, n in zip(out, m)]
    outs = ref.combine(ys, res, weighted=case.weighted)
    gys, gws = ref.combine_backward([o["grad_out"] for o in out], ys, res,
                                    weighted=case.weighted)
    for r, o in enumerate(out):
        gy = gys[r]
        if static_tail:
            gy = np.concatenate([gy, np.zeros((static_tail, case.hidden), gy.dtype)])
        o.update(grad_x=gx[r], out=outs[r], grad_y=gy, grad_w=gws[r] if case.weighted else None)
    return out


def test_reference_results_pass_every_property():
    v = check_case(CASE, ModeSpec(), perfect_results(CASE))
    assert v.status == {p: "passed" for p in PROPERTIES}, v.report()


@pytest.mark.parametrize("payload,hidden", [("mxfp8", 64), ("fp8_block128", 256)])
def test_quantized_payload_checks_scales_and_the_dequantized_rows(payload, hidden):
    case = CASE.replace(hidden=hidden, payload=payload)
    mode = ModeSpec(f"x/{payload}", payload=payload)
    assert not check_case(case, mode, perfect_results(case)).failed
    for field in ("expert_scale", "expert_x_hp", "expert_x"):
        results = perfect_results(case)
        a = results[2]["dispatch"][field]
        a.view(np.uint8)[0, 0] ^= 1
        v = check_case(case, mode, results)
        assert v.failed_properties == ["dispatch"] and f"rank 2, {field}:" in v.report()


def test_a_flipped_bit_names_property_rank_output_row_col_and_values():
    results = perfect_results(CASE)
    out = results[2]["out"]
    out.view(np.uint16)[1, 3] ^= 1  # one ulp of one bfloat16
    v = check_case(CASE, ModeSpec(), results, impl="mine:factory")
    assert v.failed_properties == ["combine"]
    text = v.report()
    assert "combine: rank 2, out: bfloat16 [6, 5]: worst difference at row 1, col 3" in text
    assert "got " in text and "expected " in text and "1 of 30 elements differ" in text
    assert "replay(Case(" in text and "impl='mine:factory'" in text
    ns = {}
    exec("from epkit.verify import Case\ncase = " + repr(v.case), ns)  # noqa: S102
    assert ns["case"] == CASE


@pytest.mark.parametrize("where,prop", [
    (("dispatch", "row_src"), "dispatch"),
    (("dispatch", "dropped_per_expert"), "dispatch"),
    (("grad_x",), "dispatch_backward"),
    (("grad_y",), "combine_backward"),
])
def test_damage_anywhere_is_caught(where, prop):
    results = perfect_results(CASE)
    target = results[0]
    for key in where[:-1]:
        target = target[key]
    a = np.array(target[where[-1]], copy=True)
    a.reshape(-1).view(np.uint8)[0] ^= 0x80
    target[where[-1]] = a
    v = check_case(CASE, ModeSpec(), results)
    assert prop in v.failed_properties, v.report()


def test_signed_zero_is_a_difference_and_nan_bits_are_compared():
    assert compare_bitwise(np.float32([0.0]), np.float32([-0.0])) is not None
    assert compare_bitwise(np.float32([np.nan]), np.float32([np.nan])) is None
    assert "shape [2], expected [3]" in compare_bitwise(np.zeros(2), np.zeros(3))
    assert "dtype int32, expected int64" in compare_bitwise(np.zeros(2, "i4"), np.zeros(2, "i8"))
    assert compare_bitwise(None, np.zeros(2)).startswith("missing")


def test_weight_grad_within_tolerance_passes_and_outside_fails():
    results = perfect_results(CASE)
    good = check_case(CASE, ModeSpec(), results)
    assert good.status["weight_grad"] == "passed"
    bad = copy.deepcopy(results)
    gw = bad[0]["grad_w"]
    used = np.argwhere(gw != 0)
    t, k = used[0]
    gw[t, k] = np.nextafter(gw[t, k], np.float32(np.inf), dtype=np.float32)  # 1 ulp: fine
    assert check_case(CASE, ModeSpec(), bad).status["weight_grad"] == "passed"
    gw[t, k] *= np.float32(1.001)
    v = check_case(CASE, ModeSpec(), bad)
    assert v.failed_properties == ["weight_grad"]
    assert f"token {t}, slot {k}" in v.report() and "tolerance" in v.report()


def test_weight_grad_tolerance_formula():
    # H = 1: exact 2 * 3 = 6, tolerance 1 * 2**-23 * 6 + 2**-126
    class R:
        row_src = np.array([[0, 0, 0]])

    y = [np.float32([[3.0]])]
    g = [np.float32([[2.0]])]
    assert weight_grad_tolerance([np.float32([[6.0]])], g, y, [R], 1, 1) == {}
    assert weight_grad_tolerance([np.float32([[6.0 + 6 * 2**-22]])], g, y, [R], 1, 1)
    assert weight_grad_tolerance([None], g, y, [R], 1, 1)[0].startswith("missing")


def test_static_tail_is_allowed_only_in_static_modes():
    tail = perfect_results(CASE, static_tail=3)
    static = ModeSpec("x/static", static=True)
    assert not check_case(CASE, static, tail).failed
    assert "dispatch" in check_case(CASE, ModeSpec(), tail).failed_properties
    dirty = perfect_results(CASE, static_tail=3)
    dirty[1]["dispatch"]["row_weight"][-1] = 1.0
    v = check_case(CASE, static, dirty)
    assert v.failed_properties == ["dispatch"] and "trailing static rows" in v.report()


def _err(stage, kind="NotImplementedError", unsupported=True):
    return {"stage": stage, "type": kind, "unsupported": unsupported, "input_error": False,
            "message": "not yet", "traceback": "Traceback: ..."}


def test_uniform_not_implemented_is_refused_from_that_stage_on():
    stages = CASE.replace(order="stages")
    results = perfect_results(stages)
    for r in results:
        r["error"] = _err("combine")
    v = check_case(stages, ModeSpec(), results)
    assert v.status["dispatch"] == v.status["dispatch_backward"] == "passed"
    assert v.status["combine"] == v.status["combine_backward"] == "refused"
    assert not v.failed and v.refused and "combine: NotImplementedError: not yet" in v.refusal
    # in training order both backward passes come after combine: neither ran
    v = check_case(CASE, ModeSpec(), results)
    assert CASE.order == "training" and v.status["dispatch"] == "passed"
    assert v.status["dispatch_backward"] == v.status["combine"] == "refused"
    # a raise in training's one backward: the forward properties stand
    for r in results:
        r["error"] = _err("backward", "RuntimeError", unsupported=False)
    v = check_case(CASE, ModeSpec(), results)
    assert v.status["dispatch"] == v.status["combine"] == "passed"
    assert v.failed_properties == ["dispatch_backward", "combine_backward", "weight_grad"]


def test_an_error_on_some_ranks_fails_and_shows_the_traceback():
    results = perfect_results(CASE)
    results[1]["error"] = _err("dispatch", "RuntimeError", unsupported=False)
    v = check_case(CASE, ModeSpec(), results)
    assert v.failed_properties == list(PROPERTIES)
    assert "rank 1, stage dispatch: raised RuntimeError" in v.report()
    assert "Traceback: ..." in v.report()


def test_expected_input_error_must_be_raised_everywhere_with_the_same_text():
    bad = CASE.replace(hidden=5, payload="mxfp8")  # H % 32 != 0: every rank must refuse
    results = [{"rank": r, "error": None} for r in range(3)]
    v = check_case(bad, ModeSpec(payload="mxfp8"), results)
    assert v.failed_properties == ["dispatch"] and "every rank must raise ValueError" in v.report()
    assert "rank 0 did not raise" in v.report()
    try:
        xs, idx, ws = bad.all_inputs()
        ref.dispatch(xs, idx, ws, num_experts=6, align=2, capacity=3, payload="mxfp8")
    except ValueError as exc:
        text = str(exc)
    errs = [dict(_err("dispatch", "InputError", False), input_error=True, message=text)
            for _ in range(3)]
    v = check_case(bad, ModeSpec(payload="mxfp8"), [{"error": e} for e in errs])
    assert v.status["dispatch"] == "passed" and not v.failed
    assert v.status["combine"] == "n/a"
    errs[2]["message"] = "epkit: rank 9: something else"
    v = check_case(bad, ModeSpec(payload="mxfp8"), [{"error": e} for e in errs])
    assert v.failed_properties == ["dispatch"]


# -- contracts ----------------------------------------------------------------------------------
from epkit.verify.capabilities import Capabilities  # noqa: E402
from epkit.verify.checks import sum_bound, ulps  # noqa: E402

PLAIN_CASE = CASE.replace(capacity=None, align=1, nan_padding=False)


def _reorder(results, case, rank=0):
    """Reverse the rows of the first expert with two rows on ``rank`` (a valid reordering):
    the dispatch fields move, the rows fed back follow their slots."""
    r = results[rank]
    d = r["dispatch"]
    off, tpe = d["expert_offsets"], d["tokens_per_expert"]
    j = int(np.flatnonzero(tpe >= 2)[0])
    perm = np.arange(len(d["row_src"]))
    lo = int(off[j])
    perm[lo:lo + int(tpe[j])] = perm[lo:lo + int(tpe[j])][::-1]
    for k in ("expert_x", "row_src", "row_weight"):
        d[k] = d[k][perm]
    for k in ("grad_expert_x", "expert_y", "grad_y"):
        r[k] = r[k][perm]
    return results


def test_a_reordered_layout_passes_reordered_and_fails_exact_with_the_reason():
    results = _reorder(perfect_results(PLAIN_CASE), PLAIN_CASE)
    exact = check_case(PLAIN_CASE, ModeSpec(), results, contract="exact")
    assert exact.failed_properties == ["dispatch"], exact.report()
    assert exact.met["dispatch"] == "reordered"
    assert exact.not_exact["dispatch"] == "row order inside experts"
    for contract in ("reordered", "bounded"):
        v = check_case(PLAIN_CASE, ModeSpec(), results, contract=contract)
        assert not v.failed, v.report()


def test_reordered_catches_a_mislabelled_row_src_and_a_row_in_the_wrong_expert():
    results = perfect_results(PLAIN_CASE)
    src = results[0]["dispatch"]["row_src"]
    i, j = [m for m in range(len(src)) if src[m, 0] >= 0][:2]
    src[[i, j]] = src[[j, i]]  # labels swapped, rows not
    v = check_case(PLAIN_CASE, ModeSpec(), results, contract="bounded")
    assert "dispatch" in v.failed_properties, v.report()
    results = perfect_results(PLAIN_CASE)
    d = results[0]["dispatch"]
    d["tokens_per_expert"] = d["tokens_per_expert"].copy()
    d["expert_offsets"] = d["expert_offsets"].copy()
    d["expert_offsets"][1] += 1  # the first row of expert 1 now sits in expert 0
    v = check_case(PLAIN_CASE, ModeSpec(), results, contract="reordered")
    assert "dispatch" in v.failed_properties


def test_padding_rows_must_be_zero_unless_declared_ignored():
    case = PLAIN_CASE.replace(align=4)
    results = perfect_results(case)
    d = results[0]["dispatch"]
    pad = np.flatnonzero(d["row_src"][:, 0] < 0)
    assert len(pad)
    d["expert_x"] = d["expert_x"].copy()
    d["expert_x"][pad[0]] = 1.0
    assert "dispatch" in check_case(case, ModeSpec(), results, contract="reordered").failed_properties
    ignored = Capabilities(padding="ignored")
    v = check_case(case, ModeSpec(), results, contract="reordered", capabilities=ignored)
    assert not v.failed, v.report()
    assert "dispatch" in check_case(case, ModeSpec(), results, contract="exact",
                                    capabilities=ignored).failed_properties


def test_bounded_accepts_rounding_and_rejects_a_relative_two_to_minus_nine():
    case = PLAIN_CASE.replace(dtype="float32", y_dtype="float32")
    results = perfect_results(case)
    out = results[0]["out"]
    t = int(np.flatnonzero(np.abs(out).sum(1) > 0)[0])
    out[t, 0] = np.nextafter(out[t, 0], np.float32(np.inf))  # one ulp: another order could
    v = check_case(case, ModeSpec(), results, contract="bounded")
    assert not v.failed and v.met["combine"] == "bounded" and v.worst["combine"][0] <= 1
    assert v.not_exact["combine"] == "combine summation order"
    assert check_case(case, ModeSpec(), results, contract="reordered").failed_properties == [
        "combine"]
    out[t, 0] *= np.float32(1 + 2.0**-9)
    v = check_case(case, ModeSpec(), results, contract="bounded")
    assert v.failed_properties == ["combine"] and "bounds (" in v.report()


def test_the_bound_formula():
    # one float32 term of magnitude 1: gamma(3, 2**-24) * 1 * (1 + 2**-24) + 2**-24 + tiny
    b = float(sum_bound(1.0, 1.0, np.array(1.0), "float32"))
    g = 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    assert abs(b - (g * (1 + 2.0**-24) + 2.0**-24 + 3 * 2.0**-133 + 2.0**-53)) < 1e-20
    assert sum_bound(1.0, 1.0, np.array(4.0), "bfloat16", "bfloat16") > 6 * 2.0**-8
    assert float(ulps(2.0**-23, 1.0, "float32")) == 1.0
    assert float(ulps(2.0**-7, 1.0, "bfloat16")) == 1.0


# -- the bound: special values, exact zeros, per-dtype accumulation --------------------------
def test_the_bound_wants_nan_where_the_exact_value_is_nan_and_the_same_infinity():
    from epkit.verify.bounds import _bounded

    exact = np.array([[np.nan, np.inf, -np.inf, 1.0]])
    ab = np.abs(np.nan_to_num(exact, nan=0.0, posinf=1.0, neginf=1.0))
    n = np.ones_like(exact)
    ok = np.float32([[np.nan, np.inf, -np.inf, 1.0]])
    assert _bounded(ok, exact, ab, n, "float32", "float32")[0] is None
    for bad in ([[0.0, np.inf, -np.inf, 1.0]], [[np.nan, 3.4e38, -np.inf, 1.0]],
                [[np.nan, np.inf, np.inf, 1.0]], [[np.nan, np.inf, -np.inf, np.nan]]):
        msg = _bounded(np.float32(bad), exact, ab, n, "float32", "float32")[0]
        assert msg is not None and "1 of 4 elements outside" in msg, (bad, msg)
    # an infinity may come out NaN only where float32 factors were narrowed to bfloat16
    nan_for_inf = np.float32([[np.nan, np.nan, -np.inf, 1.0]])
    assert _bounded(nan_for_inf, exact, ab, n, "float32", "bfloat16")[0] is not None
    assert _bounded(nan_for_inf, exact, ab, n, "float32", "bfloat16", None, True)[0] is None


def test_an_error_against_an_exact_zero_is_reported_in_absolute_terms():
    from epkit.verify.bounds import _bounded

    msg = _bounded(np.float32([[0.5]]), np.zeros((1, 1)), np.zeros((1, 1)), np.ones((1, 1)),
                   "float32", "float32")[0]
    assert "|error| 0.5 against an exact zero" in msg and "bounds" not in msg.split("zero")[0]


def test_accumulation_is_declared_per_dtype_and_never_loosens_float32():
    from epkit.verify.accumulate import accumulation_dtype, describe_accumulate, parse_accumulate

    native = parse_accumulate("bfloat16")
    assert native == parse_accumulate("native") == parse_accumulate("float16") == \
        parse_accumulate("bfloat16:bfloat16,float32:float32,float16:float16")
    # float16 data left out of a per-dtype declaration sums in float32
    assert parse_accumulate("bfloat16:bfloat16,float32:float32")["float16"] == "float32"
    assert accumulation_dtype(native, "float16", "float32") == "float16"
    assert accumulation_dtype(native, "float16", "bfloat16") == "bfloat16"
    assert accumulation_dtype(native, "float32", "float32") == "float32"
    assert accumulation_dtype(native, "float32", "bfloat16") == "bfloat16"
    assert accumulation_dtype(parse_accumulate("float32"), "bfloat16") == "float32"
    assert describe_accumulate(native) == "native"
    assert describe_accumulate(parse_accumulate("bfloat16:float64")) == "bfloat16:float64,float32:float32"
    for bad in ("float8", "bfloat16:half", "int8:float32", "bfloat16=bfloat16"):
        with pytest.raises(ValueError):
            parse_accumulate(bad)


def test_a_one_ulp_error_in_a_float32_case_fails_under_native_but_not_bfloat16_data():
    """The gate of the issue: a float32 case off by a relative 2**-9 is many bounds wide under
    native accumulation, whatever a bfloat16 declaration says; its bfloat16 twin is inside."""
    case32 = CASE.replace(dtype="float32", y_dtype="float32", nan_padding=False)
    for case, fails in ((case32, True), (case32.replace(dtype="bfloat16", y_dtype="bfloat16"),
                                         False)):
        results = perfect_results(case)
        out = results[0]["out"]
        out[0] = (out[0].astype(np.float32) * np.float32(1 + 2.0**-9)).astype(out.dtype)
        v = check_case(case, ModeSpec(), results, contract="bounded", accumulate="bfloat16")
        assert ("combine" in v.failed_properties) == fails, v.report()


def test_int32_bookkeeping_is_not_exact_for_its_integer_dtypes_only():
    results = perfect_results(CASE)
    for r in results:
        for name in ("tokens_per_expert", "expert_offsets", "row_src"):
            r["dispatch"][name] = r["dispatch"][name].astype(np.int32)
    v = check_case(CASE, ModeSpec(), results, contract="reordered")
    assert not v.failed, v.report()
    assert v.not_exact["dispatch"].startswith("integer dtypes (int32 tokens_per_expert"), v.not_exact
    assert "padding rows" not in v.not_exact["dispatch"]


def test_a_sequence_stopped_by_its_other_batch_is_not_run_not_failed():
    from epkit.verify.checks import _merged
    from epkit.verify.verdict import Verdict

    seq = CASE.replace(sequence="repeat")
    results = perfect_results(seq)
    for r in results:  # the case's backward raised; the twin never ran
        r["error"] = _err("backward", "RuntimeError", unsupported=False)
        r["twin"] = {"rank": r["rank"], "error": dict(_err("dispatch", "RuntimeError", False),
                                                      copied=True)}
    v = check_case(seq, ModeSpec(), results)
    assert v.status["dispatch"] == v.status["combine"] == "passed", v.report()
    assert v.failed_properties == ["dispatch_backward", "combine_backward", "weight_grad"]
    assert "second batch" not in v.report() and "sequence repeat" in v.report()
    a = Verdict(case=seq, mode=ModeSpec(), impl="?", status={"combine": "passed"})
    b = Verdict(case=seq, mode=ModeSpec(), impl="?", status={"combine": "failed"})
    assert _merged(a, b).status["combine"] == "failed"


def test_the_report_leads_with_the_worst_difference():
    """Issue 36: a dropped weight's signed zero came first (got 0.0, expected -0.0) while the
    same array held an error of 9.1; the headline must be the 9.1, the zero after it."""
    from epkit.verify.compare import compare_bitwise

    want = np.array([[-0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], dtype=np.float32)
    got = want.copy()
    got[0, 0] = 0.0
    got[1, 2] = 5.0 + 9.1
    text = compare_bitwise(got, want)
    assert text.startswith("float32 [2, 3]: worst difference at row 1, col 2: got 14.1"), text
    assert "; first difference at row 0, col 0: got 0.0 (0x00000000), expected -0.0 (0x80000000)" in text
    assert text.endswith("2 of 6 elements differ")
    got[1, 2] = np.nan  # a NaN against a number is the worst
    got[0, 1] = 100.0
    assert "worst difference at row 1, col 2: got nan" in compare_bitwise(got, want)
    assert "first" not in compare_bitwise(got[1:], want[1:])  # worst and first the same: once
