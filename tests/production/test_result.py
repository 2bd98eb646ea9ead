"""The Dispatch record and the Dispatcher's required arguments, without a process group."""

from __future__ import annotations

import pytest
import torch

import epkit
from epkit.result import Dispatch


def _dispatch() -> Dispatch:
    z = torch.zeros(2, dtype=torch.int64)
    return Dispatch(expert_x=torch.zeros(3, 4), tokens_per_expert=z, expert_offsets=z,
                    row_src=torch.full((3, 3), -1), row_weight=torch.zeros(3),
                    dropped_per_expert=z, bytes_sent=z)


def test_dispatch_compares_by_identity():
    """Two dispatches of equal tensors are not "equal" (a dataclass ``==`` of tensors would
    compare elementwise and raise on ``bool``), and a Dispatch can be a dict key."""
    a, b = _dispatch(), _dispatch()
    assert a == a and a != b
    assert {a: 1, b: 2}[a] == 1


def test_num_experts_is_required():
    with pytest.raises(TypeError, match="num_experts"):
        epkit.Dispatcher(None)  # noqa: the missing argument is the point
