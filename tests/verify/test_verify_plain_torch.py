"""The plain-torch baseline passes the harness: property run plus hand-picked edges."""

from __future__ import annotations

import pytest
import torch

from epkit.verify.adapters import plain_torch
from epkit.verify.cases import Case
from epkit.verify.checks import check_case
from epkit.verify.runner import Suite
from verify_testlib import PLAIN


def test_plain_torch_passes_a_property_run(pool):
    res = Suite(pool, impl=PLAIN, examples=50, seed=1234, shrink_seconds=5).run()
    assert res.failed == 0, "\n".join(v.report() for v in res.failures)
    assert [m.name for m in res.modes] == ["ragged", "padded"]
    for mode in ("ragged", "padded"):
        assert res.tallies[mode]["combine"].passed == 50 + res.results[mode].corners


EDGES = {
    "no tokens anywhere": dict(tokens=(0, 0, 0)),
    "every slot unused": dict(tokens=(3, 2, 4), unused_pct=100),
    "capacity 0 drops all": dict(tokens=(4, 4, 4), capacity=0, routing="hot"),
    "capacity 1, one hot expert": dict(tokens=(6, 5, 7), capacity=1, routing="hot", align=4),
    "H = 1, bfloat16, odd rows": dict(hidden=1, dtype="bfloat16", y_dtype="bfloat16",
                                      tokens=(5, 3, 1), align=3, nan_padding=True),
    "every slot on one rank": dict(routing="grouped", topk=6, unused_pct=0, tokens=(9, 9, 9)),
    "uniform plan": dict(routing="uniform", tokens=(6, 6, 6), topk=3),
    "signed zeros": dict(zero_rows=True, tokens=(8, 8, 8), y_dtype="bfloat16"),
    "one rank": dict(world_size=1, num_experts=4, tokens=(7,), topk=4, align=8),
}


@pytest.mark.parametrize("mode", plain_torch.modes, ids=lambda m: m.name)
@pytest.mark.parametrize("name", list(EDGES))
def test_plain_torch_edges(pool, name, mode):
    kw = dict(world_size=3, num_experts=6, topk=4, hidden=12, tokens=(5, 0, 4), seed=3,
              weighted=True)
    kw.update(EDGES[name])
    case = Case(**kw)
    v = check_case(case, mode, pool.run(case, PLAIN, mode), PLAIN)
    assert not v.failed, v.report()
    assert v.status["combine"] == "passed"


def test_plain_torch_single_process_group(tmp_path):
    """The adapter on a one-rank group in this very process (no pool): shapes and grads."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        a = plain_torch(None)
        x = torch.randn(5, 8, requires_grad=True)
        idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [0, 1], [1, 0]])
        w = torch.rand(5, 2, requires_grad=True)
        d = a.dispatch(x, idx, w, num_experts=2, align=4, capacity=None)
        assert d.expert_offsets.tolist() == [0, 4, 8]
        assert d.row_src[:3].tolist() == [[0, 0, 0], [0, 3, 0], [0, 4, 1]]
        out = a.combine(d.expert_x.float() * 2, d, weighted=True)
        out.sum().backward()
        assert x.grad is not None and w.grad is not None
        assert torch.equal(out[2], torch.zeros(8))
    finally:
        dist.destroy_process_group()
