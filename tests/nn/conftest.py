import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "production"))

from group import GroupPool  # noqa: E402  (tests/production/group.py: the persistent gloo group)


@pytest.fixture(scope="session")
def nn_group():
    """Four gloo ranks joined once; ``nn_group.run(fn, R, args)`` runs on ranks 0..R-1."""
    pool = GroupPool(world=4, timeout=150)  # inductor (opt-in) compiles slowly
    yield pool
    pool.close()
