"""torch.compile(fullgraph=True) of dispatch -> expert -> combine -> backward.

- exchange="static" compiles with no configuration at all: every size is static.
- exchange="auto" needs ``torch._dynamo.config.capture_scalar_outputs = True`` (the one host
  read of three sizes becomes unbacked SymInts the ops take as arguments).
The compiled step equals eager bit for bit.
"""

import pytest

import rank_fns


@pytest.mark.parametrize("exchange,capture", [("static", False), ("auto", True)])
def test_compiled_step_equals_eager_aot_eager(group_pool, exchange, capture):
    got = group_pool.run(rank_fns.compile_step, 2, ["aot_eager"] * 2, [exchange] * 2, [capture] * 2)
    assert got == [(True, True)] * 2


def test_compiled_step_equals_eager_inductor(group_pool):
    got = group_pool.run(rank_fns.compile_step, 1, ["inductor"], ["static"], [False])
    assert got == [(True, True)]


def test_fake_process_group_traces_world_size_8():
    """Trace (no execution) the step at world size 8 on torch's fake process group."""
    import subprocess
    import sys

    code = r'''
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
import epkit
E, T, H = 16, 6, 8
def step(x, idx, w, W):
    d = epkit.dispatch(x, idx, w, num_experts=E, exchange="static", max_tokens_per_rank=T)
    return epkit.combine(d.expert_x @ W, d)
x, W = torch.randn(T, H), torch.randn(H, H)
idx = torch.randint(0, E, (T, 2)); idx[:, 1] = (idx[:, 0] + 1) % E
gm, _ = torch._dynamo.export(step)(x, idx, torch.rand(T, 2), W)
ops = sorted({str(n.target) for n in gm.graph.nodes if "epkit" in str(n.target)})
print(ops)
assert any("dispatch_tokens" in o for o in ops) and any("combine_tokens" in o for o in ops), ops
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
