"""Rank functions of test_device_path.py: one training step per mode, everything it yields."""

from __future__ import annotations

import torch

MODES = [  # (transport, exchange, dtype, weighted, capacity)
    ("dedup", "ragged", torch.bfloat16, True, None),
    ("dedup", "ragged", torch.float32, False, None),
    ("dedup", "padded", torch.bfloat16, True, None),
    ("dedup", "static", torch.bfloat16, True, None),
    ("dedup", "static", torch.float32, True, 3),
    ("dedup", "lazy", torch.bfloat16, True, None),
    ("dedup", "auto", torch.bfloat16, True, 2),
    ("pairs", "ragged", torch.bfloat16, True, None),
    ("pairs", "equal", torch.float32, True, None),
    ("pairs", "static", torch.bfloat16, False, None),
    ("pairs", "padded", torch.float32, True, 3),
]


def step(group, rank, T: int = 24, H: int = 40, E: int = 9, K: int = 3):
    """``[(mode, {name: tensor})]``: expert_x, the combine output and the gradients of x,
    expert_y and topk_weights of one step per mode (uniform routing for ``equal``)."""
    import epkit

    out = []
    for transport, exchange, dtype, weighted, capacity in MODES:
        g = torch.Generator().manual_seed(100 + rank)
        x = (torch.randn(T, H, generator=g) * 4).to(dtype).requires_grad_()
        w, idx = torch.rand(T, E, generator=g).softmax(1).topk(K)
        if exchange == "equal":
            idx = (torch.arange(T * K).view(T, K) % E).to(torch.int64)
        else:
            idx[1, 0] = -1  # an unused slot
        w = w.requires_grad_()
        opts = dict(transport=transport, exchange=exchange, capacity=capacity)
        if exchange == "static":
            opts["max_tokens_per_rank"] = T
        d = epkit.Dispatcher(group, num_experts=E, **opts).dispatch(x, idx, w)
        if exchange == "lazy":
            d = d.wait()
        y = (d.expert_x.float() * 1.5 + 0.25).to(dtype).detach().requires_grad_()
        o = epkit.combine(y, d, weighted=weighted)
        if exchange == "lazy":
            o = o.wait()
        go = torch.randn(o.shape, generator=g).to(o.dtype)
        gx, gy, gw = torch.autograd.grad([o, d.expert_x], [x, y, w],
                                         [go, torch.randn(d.expert_x.shape, generator=g)
                                          .to(dtype)], allow_unused=True)
        got = dict(expert_x=d.expert_x, out=o, grad_x=gx, grad_y=gy, grad_w=gw)
        out.append(((transport, exchange, str(dtype), weighted, capacity),
                    {k: v.detach().clone() for k, v in got.items() if v is not None}))
    return out
