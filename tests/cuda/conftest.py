"""Tests that need a real GPU (streams, CUDA graphs, NCCL, device timing) and skip cleanly
without one. Everything else about the GPU path (the Triton kernels, bit for bit, the host reads)
runs on any machine: tests/triton.

The group fixture is this process at world size 1 on ``cpu:gloo,cuda:nccl``: CUDA tensors travel
over NCCL, CPU tensors (the same calls on CPU inputs, and the small host-side agreements such as
combine's validation) over gloo, so no host-side collective costs a device synchronisation.
"""

import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# sim.py (whole groups in one process) lives with the Triton tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "triton"))

@pytest.fixture(scope="session")
def cuda_ext():
    """The ops with their GPU kernels (Triton, registered for CUDA on import)."""
    import epkit.ops  # noqa: F401  (builds and loads)

    dump = torch._C._dispatch_dump("epkit::pack")
    assert "CUDA: registered" in dump, ("epkit registered no CUDA kernels: Triton (which "
                                        "torch's CUDA wheels bring) is needed")
    return torch.ops.epkit


@pytest.fixture(scope="session")
def group(cuda_ext):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="epkit-cuda-store-"), 1)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
