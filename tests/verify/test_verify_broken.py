"""The harness can fail: every deliberately broken dispatcher is caught within a CI budget."""

from __future__ import annotations

import pytest

from broken_adapters import EXPECTED
from epkit.verify import replay
from epkit.verify.runner import Suite
from verify_testlib import BROKEN

BUDGET = 100  # examples; over 12 seeds each broken adapter was caught within 70


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_adapter_is_caught(pool, name):
    res = Suite(pool, impl=f"{BROKEN}:{name}", examples=BUDGET, seed=2024,
                shrink_seconds=0).run()
    assert res.failed > 0, f"{name} passed {res.passed} checks"
    failed = {p for p, t in res.tallies["default"].items() if t.failed}
    assert EXPECTED[name] in failed, (name, failed)
    (verdict,) = res.failures
    assert "reproduce:" in verdict.report()


def test_a_failure_shrinks_to_a_small_case_that_replays(pool):
    res = Suite(pool, impl=f"{BROKEN}:weight_twice", examples=BUDGET, seed=7,
                shrink_seconds=30).run()
    (verdict,) = res.failures
    case = verdict.case
    assert case.weighted and sum(case.tokens) <= 2 and case.world_size == 1, case
    again = replay(case, impl=f"{BROKEN}:weight_twice", pool=pool, quiet=True)
    assert again.failed_properties == verdict.failed_properties
