import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from group import GroupPool  # noqa: E402


@pytest.fixture(scope="session")
def group_pool():
    pool = GroupPool(world=4)
    yield pool
    pool.close()
