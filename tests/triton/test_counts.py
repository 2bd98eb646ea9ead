"""epkit.triton.counts (a Dispatch's counts out of the plan, one launch) against the plan's
sections copied and differenced as the host path does (ops.dispatch_counts off the device):
each output its own tensor, none sharing storage with the plan or another output."""

import numpy as np
import pytest
import torch

from epkit.reference import abi
from epkit.triton import counts


@pytest.mark.parametrize("R,E", [(1, 1), (2, 8), (3, 9), (5, 40), (64, 64)])
def test_counts_are_the_plan_sections(R, E):
    rng = np.random.default_rng(R * 100 + E)
    plan = torch.from_numpy(rng.integers(-2**40, 2**40, abi.plan_size(R, E), dtype=np.int64))
    sl = abi.plan_slices(R, E)
    got = counts.dispatch_counts(plan, sl)
    offsets = plan[sl["offsets"]]
    want = (plan[sl["tokens_per_expert"]], offsets, plan[sl["dropped"]], plan[sl["send_bytes"]],
            offsets.diff())
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and torch.equal(g, w)
    ptrs = [t.data_ptr() for t in got]
    assert len(set(ptrs)) == len(ptrs)
    assert all(t.untyped_storage().data_ptr() != plan.untyped_storage().data_ptr() for t in got)
