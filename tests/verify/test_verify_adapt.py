"""The adapter helpers, on a one-rank group in this process, against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import epkit.reference as ref
from epkit.verify.adapt import FullTopK, exchange_row_src, offsets_of, row_src_from_slots
from epkit.verify.example_adapter import Adapter


@pytest.fixture()
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                            world_size=1)
    yield None
    dist.destroy_process_group()


def test_row_src_from_slots_and_offsets():
    src, w = row_src_from_slots(torch.tensor([1, 0, 2]), torch.tensor([5, -1, 0]), 2,
                                torch.tensor([0.5, 9.0, 0.25]))
    assert src.tolist() == [[1, 2, 1], [-1, -1, -1], [2, 0, 0]]
    assert w.tolist() == [0.5, 0.0, 0.25]
    assert offsets_of(torch.tensor([3, 0, 1]), align=2).tolist() == [0, 4, 4, 6]


def test_exchange_row_src_with_padding_rows_and_nothing_received(group):
    w = torch.tensor([[0.5, 0.25], [2.0, 4.0]])
    src, rw = exchange_row_src(torch.tensor([3, 0]), 2, w, [2], [2], None,
                               order=torch.tensor([1, -1, 0]))
    assert src.tolist() == [[0, 0, 0], [-1, -1, -1], [0, 1, 1]]
    assert rw.tolist() == [0.5, 0.0, 4.0]
    src, rw = exchange_row_src(torch.zeros(0, dtype=torch.long), 2, w, [0], [0], None,
                               order=torch.tensor([-1, -1]))
    assert src.tolist() == [[-1, -1, -1]] * 2 and rw.tolist() == [0.0, 0.0]


def test_full_topk_turns_filled_slots_into_padding(group):
    x = torch.randn(3, 4, requires_grad=True)
    idx = torch.tensor([[0, -1], [1, 2], [-1, -1]])
    w = torch.rand(3, 2, requires_grad=True)
    d = FullTopK(Adapter(None), None).dispatch(x, idx, w, num_experts=3, align=1,
                                               capacity=None)
    want = ref.dispatch([x.detach().numpy()], [idx.numpy()], [w.detach().numpy()],
                        num_experts=3)[0]
    real = d.row_src[:, 0] >= 0
    assert sorted(map(tuple, d.row_src[real].tolist())) == sorted(
        map(tuple, want.row_src.tolist()))
    assert d.tokens_per_expert.tolist() == want.tokens_per_expert.tolist()
    assert torch.equal(d.expert_x[~real], torch.zeros_like(d.expert_x[~real]))
    y = torch.randn(d.expert_x.shape, requires_grad=True)
    out = FullTopK(Adapter(None), None).combine(y, d, weighted=True)
    assert out.shape == (3, 4) and torch.equal(out[2], torch.zeros(4))
    rows = {tuple(r): m for m, r in enumerate(d.row_src.tolist())}
    m = rows[(0, 0, 0)]
    assert torch.allclose(out[0], w[0, 0] * y[m])
    out.sum().backward()
    assert torch.equal(y.grad[~real], torch.zeros_like(y.grad[~real]))
    assert w.grad[0, 1] == 0 and w.grad[2].tolist() == [0.0, 0.0]
    (gx,) = torch.autograd.grad(d.expert_x, x, torch.ones_like(d.expert_x))
    assert gx.tolist() == [[1.0] * 4, [2.0] * 4, [0.0] * 4]  # filled slots pass nothing back
    assert np.isfinite(gx.numpy()).all()
