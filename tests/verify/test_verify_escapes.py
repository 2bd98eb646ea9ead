"""The bugs that escaped the earlier strategies are caught, and valid variants still pass.

Each bug is a dispatcher in escape_adapters.py (one class of escape each: tokens past 31, a
128-row per-peer buffer, slots k >= 16, nan_to_num, subnormals flushed, a routing map from
probs != 0, duplicate ids merged, a float32 case judged by a bfloat16 declaration, a rank
without tokens with bfloat16, a group of three). Every one must fail a default-sized bounded
run (the corner cases plus ``--examples`` 20) on every seed tried; the valid variants (rows
reversed inside experts, another float32 summation order, float64 sums, padding rows inside
segments, int32 metadata, garbage in ignorable padding, a bfloat16-summing port declaring
``accumulate=native``) must pass on every seed.
"""

from __future__ import annotations

import pytest

import epkit.verify
from epkit.verify.runner import Suite
from escape_adapters import BUGS, VALID
from verify_testlib import ESCAPES

EXAMPLES = 20  # the CLI's default --examples
SEEDS = (1, 2)


def _run(pool, name, seed, **kw):
    kw.setdefault("contract", "bounded")
    if name == "merges_duplicates":
        kw.setdefault("supports", ["check_errors=yes"])
    return Suite(pool, impl=f"{ESCAPES}:{name}", examples=EXAMPLES, seed=seed,
                 shrink_seconds=0, **kw).run()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(BUGS))
def test_every_escaped_bug_is_caught_by_a_default_run(pool, name, seed):
    res = _run(pool, name, seed)
    # an invalid input accepted (merges_duplicates) is tallied apart from wrong answers
    failed = {p for p, t in res.tallies["default"].items() if t.failed or t.accepted}
    assert not res.ok and BUGS[name] in failed, (name, seed, res.table())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", VALID)
def test_valid_variants_still_pass(pool, name, seed):
    res = _run(pool, name, seed)
    assert res.ok and res.met("default") in ("exact", "reordered", "bounded"), (
        res.table() + "\n".join(v.report() for v in res.failures))


def test_a_float32_case_is_not_loosened_by_a_bfloat16_declaration(pool):
    res = _run(pool, "titan_one_token_off", 1, accumulate="bfloat16")
    assert not res.ok and res.accumulate == "native"
    # the declaration loosens bfloat16 cases only: what fails is a case of another dtype
    # (float32 or float16, whichever the draw reached first), judged natively
    failing = res.failures[0]
    assert failing.case.dtype != "bfloat16", failing.report()
    assert failing.case.dtype in failing.report(), failing.report()


def test_a_bug_at_three_ranks_is_caught_by_check_with_its_defaults():
    with pytest.raises(AssertionError, match="fails contract bounded"):
        epkit.verify.check(f"{ESCAPES}:odd_group_size", examples=2, contract="bounded")


def test_an_ignored_capacity_is_told_the_three_ways_forward(pool):
    res = _run(pool, "ignores_capacity", 1)
    assert not res.ok
    text = res.failures[0].report()
    assert "keeps slots the capacity drops" in text, text
    assert "refuse it (raise NotImplementedError" in text and "--supports capacity=no" in text


def test_refusals_by_name_are_redrawn_one_feature_at_a_time(pool):
    res = _run(pool, "refuses_many", 1, contract="exact")
    r = res.results["default"]
    assert res.ok and not r.problem, res.table()
    assert all(t.checked == t.requested for t in r.tallies.values()), res.table()
    hint = next(ln for ln in res.table().splitlines() if "to draw only inside" in ln)
    decls = set(hint.split("declare ", 1)[1].split(" --supports ")) if "declare" in hint else set()
    decls = {d.replace("--supports ", "") for d in decls}
    assert decls <= {"capacity=no", "unused_slots=no", "index_dtypes=int64", "unweighted=no"}, hint
    assert "weighted=no" not in decls and "index_dtypes=int32" not in decls, hint
