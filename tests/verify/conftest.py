"""Fixtures of the harness tests: one persistent 3-rank gloo pool for the whole session."""

from __future__ import annotations

import pytest
from verify_testlib import WORLD


@pytest.fixture(scope="session")
def pool():
    from epkit.verify import Pool

    p = Pool(WORLD, timeout=30.0)
    p.start()
    yield p
    p.close()
