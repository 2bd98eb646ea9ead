"""The device path (``EPKIT_KERNELS=triton``: the GPU's Triton kernels, interpreted, and every
branch epkit's Python takes for device memory: the return path's places built by
``triton/places.py``, the kernels' own step and place finding) gives the C++ path's bits, for
every transport and kind of exchange, with capacity drops, lazy, weighted and not: one training
step each, every output and gradient compared bit for bit (the C++ path is held to the reference
by tests/production/test_against_reference.py and epkit verify)."""

from __future__ import annotations

import pytest
import torch

import device_path_fns as fns
from group import started_with_kernels


# One worker runs this module (--dist loadgroup, pyproject.toml): its module fixture is
# costly, and under xdist every worker that took one of its tests would build it again.
pytestmark = pytest.mark.xdist_group("device_path")


@pytest.fixture(scope="module")
def steps():
    out = {}
    for kernels in ("cpp", "triton"):
        pool = started_with_kernels(kernels, 3, 240)
        try:
            out[kernels] = pool.run(fns.step, 3)
        finally:
            pool.close()
    return out


def test_device_path_gives_the_cpp_bits(steps):
    for rank, (cpp, tri) in enumerate(zip(steps["cpp"], steps["triton"])):
        for (mode, a), (mode_b, b) in zip(cpp, tri):
            assert mode == mode_b
            assert a.keys() == b.keys(), (rank, mode)
            for name in a:
                x, y = a[name], b[name]
                assert x.shape == y.shape and x.dtype == y.dtype, (rank, mode, name)
                same = torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else
                                   x.view(torch.int32), y.view(torch.uint8) if y.dtype !=
                                   torch.float32 else y.view(torch.int32))
                assert same, (rank, mode, name)
