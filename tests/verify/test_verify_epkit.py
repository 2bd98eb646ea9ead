"""epkit itself through the harness (the default --impl): every mode, a small budget."""

from __future__ import annotations

import pytest

from epkit.verify.adapters import epkit_modes
from epkit.verify.runner import DEFAULT_IMPL, Suite


def _epkit_available() -> bool:
    try:
        import epkit

        epkit.dispatch  # noqa: B018 - resolves the lazy attribute (imports the extension)
        return True
    except Exception:  # noqa: BLE001 - any failure to load means: skip
        return False


pytestmark = pytest.mark.skipif(not _epkit_available(), reason="epkit production not importable")


def test_every_epkit_mode_conforms_or_says_unsupported(pool):
    res = Suite(pool, impl=DEFAULT_IMPL, modes=epkit_modes(), examples=8, seed=77,
                shrink_seconds=10).run()
    assert res.failed == 0, "\n\n".join(v.report() for v in res.failures)
    core = ["dedup/ragged", "pairs/ragged", "dedup/padded", "pairs/padded"]
    for mode in core:
        # every combine requested ran and passed: the 8 examples and the valid corner cases
        # (the invalid-input corners stop at dispatch: combine is n/a there)
        t = res.tallies[mode]["combine"]
        assert t.passed == t.checked == t.requested > 8 and res.results[mode].corners > 0, (
            mode, res.table())
