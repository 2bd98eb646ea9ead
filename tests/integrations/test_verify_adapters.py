"""The frameworks' own dispatchers (the installed classes) through ``epkit verify``'s harness
with the shipped adapters, under the bounded contract: what
``epkit verify --impl epkit.verify.<framework>:verify_adapter --contract bounded`` runs,
on a few drawn cases (the CLI draws corner cases and more examples)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def verify_pool():
    from epkit.verify import Pool

    p = Pool(2, timeout=60.0)
    p.start()
    yield p
    p.close()


@pytest.mark.parametrize("framework,module", [("torchtitan", "torchtitan"),
                                              ("megatron.core", "megatron")])
def test_framework_dispatcher_meets_bounded(verify_pool, framework, module):
    pytest.importorskip(framework, reason="a test dependency (epkit[frameworks])")
    from epkit.verify.runner import Suite

    impl = f"epkit.verify.{module}:verify_adapter"
    res = Suite(verify_pool, impl=impl, examples=4, seed=11, shrink_seconds=1,
                contract="bounded", corners=False).run()
    assert res.failed == 0, "\n".join(v.report() for v in res.failures)
    assert res.tallies["default"]["combine"].passed == 4
