"""epkit.nn.grouped_mm: torch._grouped_mm and the segment loop give the same rows and gradients."""

from __future__ import annotations

import pytest
import torch

from epkit.nn import grouped_mm, grouped_mm_backend
from epkit.nn.grouped import segment_mm, segment_mm_wgrad

HAS_GMM = hasattr(torch, "_grouped_mm")


def _case(dtype, M=12, K=16, N=32, offsets=(0, 3, 3, 9)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(offsets) - 1, N, K, generator=g).to(dtype).requires_grad_()
    return x, w, torch.tensor(offsets), torch.randn(M, N, generator=g).to(dtype)


def _run(impl, x, w, offs, g):
    y = grouped_mm(x, w.transpose(1, 2), offs, impl)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    end = int(offs[-1])
    return y[:end], gx[:end], gw, y[end:], gx[end:]


@pytest.mark.skipif(not HAS_GMM, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_and_loop_agree_bitwise(dtype):
    x, w, offs, g = _case(dtype)
    assert grouped_mm_backend(x, w.transpose(1, 2)) == "torch"
    a, b = _run("torch", x, w, offs, g), _run("loop", x, w, offs, g)
    for name, u, v in zip(("y", "grad_x", "grad_w"), a[:3], b[:3]):
        assert torch.equal(u, v), name
    assert b[2][1].abs().max() == 0  # an empty segment's weight gets no gradient
    assert b[3].abs().max() == 0 and b[4].abs().max() == 0  # the loop zeroes rows past the end


def test_loop_matches_per_segment_matmul():
    x, w, offs, g = _case(torch.float32, M=7, K=6, N=5, offsets=(0, 2, 7))
    assert grouped_mm_backend(x, w.transpose(1, 2)) == "loop"  # 24-byte rows: not 16-aligned
    y = grouped_mm(x, w.transpose(1, 2), offs)
    want = torch.cat([x[:2] @ w[0].T, x[2:] @ w[1].T])
    assert torch.equal(y, want)


def test_segment_ops_opcheck():
    x, w, offs, g = _case(torch.float32)
    torch.library.opcheck(segment_mm, (x, w.transpose(1, 2), offs))
    torch.library.opcheck(segment_mm_wgrad, (x.detach(), g, offs))


def test_empty_input():
    x, w, _, _ = _case(torch.float32, M=0)
    y = grouped_mm(x, w.transpose(1, 2), torch.zeros(4, dtype=torch.int64))
    assert y.shape == (0, 32)


def test_bad_impl():
    x, w, offs, _ = _case(torch.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_mm(x, w.transpose(1, 2), offs, "fast")
