"""CUDA tests: every test here needs a GPU and skips cleanly without one, except
test_index_emulation.py (the CUDA index arithmetic, transcribed, against the CPU kernels) and
test_source_rules.py (rules of the .cu sources that no run shows reliably).

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

@pytest.fixture(scope="session")
def cuda_ext():
    """The extension with its CUDA kernels (a GPU machine builds them on import)."""
    import epkit.ops  # noqa: F401  (builds and loads)

    dump = torch._C._dispatch_dump("epkit::pack")
    assert "CUDA: registered" in dump, ("epkit was built without its CUDA kernels: "
                                        "torch.version.cuda, nvcc and CUDA_HOME are needed")
    return torch.ops.epkit


@pytest.fixture(scope="session")
def group(cuda_ext):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="epkit-cuda-store-"), 1)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
