"""The regimes real bugs live in (issue 34): each planted bug in regime_adapters.py fails a
default-sized bounded run (the corner cases plus 30 examples at world size 3) on every seed
tried, named the way its report must name it; the valid variants keep passing."""

from __future__ import annotations

import pytest

from epkit.verify.runner import Suite
from regime_adapters import BUGS
from verify_testlib import HERE

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
    assert text in report, report
