"""The regimes real bugs live in (issue 34): each planted bug in regime_adapters.py fails a
default-sized bounded run (the corner cases plus 30 examples at world size 3) on every seed
tried, named the way its report must name it; the valid variants keep passing."""

from __future__ import annotations

import numpy as np
import pytest

from epkit.verify.runner import Suite
from regime_adapters import BUGS
from verify_testlib import HERE, PLAIN

REGIMES = str(HERE / "regime_adapters.py")
EXAMPLES = 30
SEEDS = (1, 2)


def _run(pool, name, seed, **kw):
    kw.setdefault("contract", "bounded")
    kw.setdefault("examples", EXAMPLES)
    return Suite(pool, impl=f"{REGIMES}:{name}", seed=seed, shrink_seconds=0, **kw).run()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(BUGS))
def test_every_planted_regime_bug_is_caught_and_named(pool, name, seed):
    prop, text = BUGS[name]
    res = _run(pool, name, seed)
    failed = {p for p, t in res.tallies["default"].items() if t.failed}
    assert not res.ok and prop in failed, (name, seed, res.table())
    report = "\n".join(v.report() for v in res.failures)
    assert any(t in report for t in ((text,) if isinstance(text, str) else text)), report


class _Tracing:
    """The pool, recording every case it hands the adapter."""

    def __init__(self, pool):
        self.pool, self.cases = pool, []
        self.world_size, self.timeout = pool.world_size, pool.timeout

    def run(self, case, impl, mode):
        self.cases.append(case)
        return self.pool.run(case, impl, mode)


def _regimes(cases) -> set:
    """The regimes of issue 34 that ``cases`` reach (from the inputs the adapter got)."""
    seen = set()
    for c in cases:
        if c.violation is not None:
            continue
        _, idx, _ = c.all_inputs()
        used = [i[i >= 0] for i in idx]
        if not sum(u.size for u in used):
            continue
        seen.update({f"order {c.order}", f"sequence {c.sequence}"})
        if "float16" in (c.dtype, c.y_dtype):
            seen.add("float16")
        if c.dtype == "bfloat16" and c.hidden >= 7168:
            seen.add("wide rows bfloat16")
        if c.dtype == "float32" and c.hidden >= 4096:
            seen.add("wide rows float32")
        seen.update(f"tokens {t}" for t in c.tokens if t in BOUNDARY_TOKENS)
        if c.num_experts > 256 and any(u.size and int(u.max()) > 255 for u in used):
            seen.add(f"ids past 255 at world size {c.world_size}")
        per_expert = np.bincount(np.concatenate(used), minlength=c.num_experts)
        if per_expert.max() > 2**16 and max(u.size for u in used) > 2**16:
            seen.add("count overflow")
    return seen


BOUNDARY_TOKENS = {m + d for m in (64, 128, 256) for d in (-1, 0, 1)}
REGIMES_ALL = ({"float16", "wide rows bfloat16", "wide rows float32", "count overflow",
                "order training", "order stages", "sequence repeat", "sequence overlap",
                "sequence overlap_reversed"}
               | {f"tokens {t}" for t in BOUNDARY_TOKENS}
               | {f"ids past 255 at world size {n}" for n in (1, 2, 3)})


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_a_default_bounded_run_reaches_every_regime_whatever_the_seed(pool, seed):
    tracing = _Tracing(pool)
    res = Suite(tracing, impl=PLAIN, examples=EXAMPLES, seed=seed, shrink_seconds=0,
                contract="bounded").run()
    assert res.ok, res.table()
    assert REGIMES_ALL - _regimes(tracing.cases) == set()


def test_without_the_corners_the_trace_misses_regimes(pool):
    tracing = _Tracing(pool)
    Suite(tracing, impl=PLAIN, examples=3, seed=1, shrink_seconds=0, corners=False).run()
    missing = REGIMES_ALL - _regimes(tracing.cases)
    assert {"count overflow", "wide rows bfloat16", "tokens 64"} <= missing, missing


def test_a_failure_that_needs_earlier_cases_says_so_and_replays_with_them(pool):
    from epkit.verify import Case, replay

    first = Case(world_size=2, num_experts=4, topk=2, hidden=4, tokens=(3, 2), seed=1,
                 unused_pct=0)
    second = first.replace(seed=2)  # the same shapes, another routing
    impl = f"{REGIMES}:caches_plan_by_shape"
    res = Suite(pool, impl=impl, examples=0, seed=1, shrink_seconds=0,
                corners=[first, second]).run()
    (v,) = res.failures
    assert v.case == second and v.after == (first,), v.report()
    assert "needs earlier cases: alone, on a fresh group, this case passes" in v.report()
    assert "after=[Case(" in v.report()
    assert not replay(second, impl=impl, quiet=True).failed  # alone: passes
    assert replay(second, impl=impl, quiet=True, after=[first]).failed

def test_check_errors_reports_accepted_invalid_inputs_apart_from_wrong_answers(pool):
    from verify_testlib import BROKEN

    # no validation at all, and right answers: one line, and no FAILED cell
    clean = Suite(pool, impl=PLAIN, modes=None, examples=5, seed=1, shrink_seconds=0,
                  check_errors=True).run()
    r = clean.results["ragged"]
    assert not clean.ok and sum(r.accepted_invalid.values()) >= 5, clean.table()
    assert r.tallies["dispatch"].failed == 0 and r.tallies["dispatch"].accepted > 0
    table = clean.table()
    assert "ragged: FAILED: accepts invalid inputs (no input validation)" in table, table
    assert "no failure on valid inputs" in table and "+" in clean.cell("ragged", "dispatch")
    assert r.failure is not None and r.failure.accepted_invalid  # its report: the invalid one
    # no validation and a wrong answer: the wrong answer is the failure reported, apart
    bad = Suite(pool, impl=f"{BROKEN}:weight_twice", examples=5, seed=1, shrink_seconds=0,
                check_errors=True).run()
    r = bad.results["default"]
    assert r.accepted_invalid and r.failure is not None and not r.failure.accepted_invalid
    assert "combine" in r.failure.failed_properties, r.failure.report()
    assert "failed checks on valid inputs" in bad.table(), bad.table()
