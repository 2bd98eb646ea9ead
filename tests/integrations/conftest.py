import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "production"))

from group import GroupPool  # noqa: E402  (tests/production/group.py: the persistent gloo group)


@pytest.fixture(scope="session")
def pair():
    """Two gloo ranks joined once (expert-parallel size 2); ``pair.run(fn, 2, args)``."""
    pool = GroupPool(world=2, timeout=120)
    yield pool
    pool.close()
