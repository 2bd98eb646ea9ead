"""The harness as a CI gate for dispatchers epkit did not write: no false green, declared
capabilities, the exact / reordered / bounded contracts, broken dispatchers caught."""

from __future__ import annotations

import pytest

import epkit.verify
from epkit.verify.runner import Suite
from gate_adapters import BROKEN_BOUNDED
from verify_testlib import GATE, MISBEHAVING, TITAN

EXAMPLES = 30


def _run(pool, name, **kw):
    kw.setdefault("examples", EXAMPLES)
    kw.setdefault("seed", 11)
    kw.setdefault("shrink_seconds", 0)
    return Suite(pool, impl=name if ":" in name else f"{GATE}:{name}", **kw).run()


@pytest.mark.parametrize("supports,shrink", [(None, 0), (["capacity=no"], 5)])
def test_false_green_refuses_capacity_and_halves_combine_fails(pool, supports, shrink):
    res = _run(pool, "false_green", supports=supports, shrink_seconds=shrink)
    assert not res.ok and res.failed > 0
    t = res.tallies["default"]["combine"]
    assert t.requested == EXAMPLES + res.results["default"].corners and t.failed > 0, res.table()
    assert res.failures[0].failed_properties[0] == "combine"  # shrinking kept the property


def test_refused_draws_are_redrawn_counted_and_every_example_is_checked(pool):
    res = _run(pool, "refuses_capacity")
    assert res.ok, res.table()
    r = res.results["default"]
    assert r.redrawn["capacity"] > 0
    for p, t in r.tallies.items():
        assert t.checked == t.requested and (p == "weight_grad"
                                             or t.requested == EXAMPLES + r.corners)
    assert "refused draws redrawn without the feature" in res.table()
    assert "(capacity)" in res.table()


def test_declared_capacity_makes_a_refusal_a_failure(pool):
    res = _run(pool, "refuses_capacity", supports=["capacity=yes"])
    assert not res.ok
    assert "refused although declared supported" in res.failures[0].report()


def test_declared_no_capacity_never_draws_it(pool):
    res = _run(pool, "refuses_capacity", supports=["capacity=no"], examples=10)
    assert res.ok and not res.results["default"].redrawn, res.table()


def test_a_stage_always_refused_fails_with_a_reason(pool):
    res = _run(pool, f"{MISBEHAVING}:combine_not_implemented", examples=8, corners=False)
    assert not res.ok and res.failed >= 8
    problem = res.results["default"].problem
    assert problem.startswith("only 0 of 8 examples checked for combine: 8 refused"), problem
    assert "combine: not yet" in problem
    assert res.tallies["default"]["dispatch"].checked == 8
    assert "SHORT" in res.table() and "FAILED: only 0 of 8" in res.table()


def test_docs_dispatcher_meets_bounded_and_fails_exact_with_one_line(pool):
    ok = _run(pool, "docs_dispatcher", contract="bounded")
    assert ok.ok, ok.table() + "\n".join(v.report() for v in ok.failures)
    assert ok.met("default") == "bounded"
    for p, t in ok.tallies["default"].items():
        assert t.checked == t.requested > 0, (p, ok.table())
    exact = _run(pool, "docs_dispatcher", contract="exact")
    assert not exact.ok
    lines = [ln for ln in exact.table().splitlines() if "meets bounded; not exact:" in ln]
    assert len(lines) == 1 and "combine summation order" in lines[0], exact.table()
    assert "row order inside experts" in lines[0]
    # under exact every property is still checked on every example
    assert all(t.checked == t.requested for t in exact.tallies["default"].values())


@pytest.mark.parametrize("name", sorted(BROKEN_BOUNDED))
def test_broken_docs_dispatchers_fail_bounded(pool, name):
    res = _run(pool, name, contract="bounded", examples=40)
    failed = {p for p, t in res.tallies["default"].items() if t.failed}
    assert BROKEN_BOUNDED[name] in failed, (name, res.table())
    assert not res.ok


def test_check_entry_point_passes_and_fails(pool):
    epkit.verify.check("epkit.verify.example_adapter:make", examples=5, contract="bounded",
                       pool=pool, seed=3)
    with pytest.raises(AssertionError, match="fails contract exact"):
        epkit.verify.check(f"{GATE}:false_green", examples=5, pool=pool, seed=3)


def test_a_rank_major_adapter_passes_against_the_reference_rank_major_output(pool):
    res = _run(pool, "rank_major", examples=20)
    assert res.ok and res.met("default") == "exact", res.table()
    assert res.tallies["default"]["combine"].checked == 20 + res.results["default"].corners
    assert res.tallies["default"]["weight_grad"].requested == 0  # combine takes no weights
    reordered = _run(pool, "rank_major_reordered", examples=20, contract="reordered")
    assert reordered.ok and reordered.met("default") == "reordered", reordered.table()
    assert not _run(pool, "rank_major_reordered", examples=20).ok


@pytest.mark.parametrize("name,prop", [("rank_major_global_ids", "dispatch"),
                                       ("rank_major_last_rank_lost", "combine")])
def test_broken_rank_major_adapters_fail(pool, name, prop):
    res = _run(pool, name, examples=20, contract="bounded")
    assert prop in {p for p, t in res.tallies["default"].items() if t.failed}, res.table()


def test_a_torchtitan_style_port_meets_bounded_with_its_declared_accumulation(pool):
    impl = f"{TITAN}:make"
    res = _run(pool, impl, contract="bounded")
    assert res.ok and res.met("default") == "bounded", res.table()
    assert "padding rows" in res.results["default"].not_exact
    strict = _run(pool, impl, contract="bounded", accumulate="float32", examples=40)
    assert not strict.ok  # it sums bfloat16 rows in bfloat16: outside the float32 bound
