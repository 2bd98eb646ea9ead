"""The static mode on an NCCL-only group, the usual torchrun set-up: during
CUDA-graph capture no host read anywhere in dispatch, combine or backward (the call headers
are checked on the device), so the step is captured and replayed bit-exact with eager; header
errors stay pending for epkit.device.check_static. test_group.py does the same on ``cpu:gloo,cuda:nccl``, where the
small agreements ride gloo; here every collective is NCCL's.
"""

import pytest

import sim
from test_group import _count_syncs, _inputs, _step, graph_replays_like_eager

pytestmark = [pytest.mark.cuda, sim.needs_cuda]


@pytest.fixture(scope="module")
def nccl_group(group):
    import torch.distributed as dist

    g = dist.new_group(ranks=list(range(dist.get_world_size())), backend="nccl")
    assert "gloo" not in str(dist.get_backend(g))
    return g


OPTS = dict(num_experts=8, exchange="static", max_tokens_per_rank=40, align=4)


@pytest.mark.parametrize("transport", ["dedup", "pairs"])
def test_static_host_waits_nccl_only(nccl_group, transport):
    """Eager on an NCCL-only group: the only host reads are the call headers (one each for
    dispatch, combine and the two backward passes; docs/reliability.md 1b): no plan read, no
    count read. (On cpu:gloo,cuda:nccl the headers ride gloo: none, test_group.py.)"""
    x, idx, w = (t.cuda() for t in _inputs())
    _step(x, idx, w, nccl_group, transport=transport, **OPTS)  # warm up
    _, syncs = _count_syncs(lambda: _step(x, idx, w, nccl_group, transport=transport, **OPTS))
    assert syncs <= 4, syncs


@pytest.mark.parametrize("transport", ["dedup", "pairs"])
def test_static_graph_replay_nccl_only(nccl_group, transport):
    import epkit
    from epkit.device import check_static

    opts = dict(transport=transport, **OPTS)
    graph_replays_like_eager(nccl_group, opts, seeds=(2, 3))
    x, idx, w = (t.cuda() for t in _inputs(seed=4))
    check_static(epkit.dispatch(x, idx, w, group=nccl_group, **opts))  # nothing pending
