"""epkit.dispatch / combine / backward on CUDA over a real process group (world size 1,
``cpu:gloo,cuda:nccl``): bit for bit the CPU run of the same call, every transport and exchange;
host synchronisations counted; the static mode captured in a CUDA graph and replayed.
"""

import warnings

import pytest
import torch

import epkit
import sim

pytestmark = [pytest.mark.cuda, sim.needs_cuda]

EXCHANGES = ["auto", "ragged", "padded", "equal", "lazy", "static"]


def _inputs(T=40, H=64, K=4, E=8, dtype=torch.bfloat16, seed=0, uniform=False):
    _, xs, idxs, ws = sim.make_case(1, E, K, H, [T], dtype, seed, unused=0.0 if uniform else 0.2)
    return xs[0], idxs[0], ws[0]


def _step(x, idx, w, group, y_scale=2.0, **opts):
    """dispatch -> y = 2 x -> combine -> backward; every output as a CPU tensor."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    d = epkit.dispatch(x, idx, w, group=group, **opts)
    if hasattr(d, "wait") and not hasattr(d, "expert_x"):
        d = d.wait()
    if d.expert_x_hp is not None:  # quantized: the experts see the dequantized rows
        y = (d.expert_x_hp * y_scale).to(x.dtype)
    else:
        y = (d.expert_x.float() * y_scale).to(d.expert_x.dtype)
    out = epkit.combine(y, d)
    if hasattr(out, "wait") and not hasattr(out, "shape"):
        out = out.wait()
    g = torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape).to(out.dtype)
    out.backward(g)
    extra = {} if d.expert_scale is None else {"expert_scale": d.expert_scale}
    return {**extra, "expert_x": d.expert_x, "row_src": d.row_src, "row_weight": d.row_weight,
            "tokens_per_expert": d.tokens_per_expert, "expert_offsets": d.expert_offsets,
            "out": out, "grad_x": x.grad, "grad_w": w.grad}


@pytest.mark.parametrize("payload", [None, "mxfp8", "fp8_block128"])
@pytest.mark.parametrize("transport", ["dedup", "pairs"])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_cuda_equals_cpu(group, transport, exchange, payload):
    x, idx, w = _inputs(uniform=exchange == "equal", H=128 if payload == "fp8_block128" else 64)
    opts = dict(num_experts=8, transport=transport, exchange=exchange, align=2, capacity=30,
                payload=payload)
    if exchange == "static":
        opts["max_tokens_per_rank"] = 48
    cpu = _step(x, idx, w, group, **opts)
    gpu = _step(x.cuda(), idx.cuda(), w.cuda(), group, **opts)
    for name in cpu:
        a, b = cpu[name], gpu[name].cpu()
        if name == "grad_w":  # <g, y>: a float32 sum in a free order (docs/design.md)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(sim.bits(a), sim.bits(b)), name


def _no_syncs(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _count_syncs(fn):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(c.message) for c in caught)


@pytest.mark.parametrize("transport", ["dedup", "pairs"])
def test_eager_host_waits(group, transport):
    """One host wait per eager dispatch (the plan, through pinned memory); none in combine,
    none in either backward pass (they reuse the dispatch's plan and maps)."""
    x, idx, w = _inputs()
    x, idx, w = x.cuda().requires_grad_(True), idx.cuda(), w.cuda().requires_grad_(True)
    opts = dict(num_experts=8, transport=transport, group=group)
    _step(x.detach(), idx, w.detach(), group, num_experts=8, transport=transport)  # warm up
    d, n_dispatch = _count_syncs(lambda: epkit.dispatch(x, idx, w, **opts))
    y = (d.expert_x.float() * 2).to(d.expert_x.dtype)
    assert n_dispatch == 1
    out = _no_syncs(lambda: epkit.combine(y, d))
    _no_syncs(lambda: out.backward(torch.ones_like(out)))  # both backward passes


@pytest.mark.parametrize("transport", ["dedup", "pairs"])
def test_static_no_host_sync(group, transport):
    """exchange='static': dispatch, combine and backward with no synchronisation at all."""
    x, idx, w = _inputs()
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    opts = dict(num_experts=8, transport=transport, exchange="static", max_tokens_per_rank=40)
    _step(x, idx, w, group, **opts)  # warm up (NCCL communicator, allocator)
    _no_syncs(lambda: _step(x, idx, w, group, **opts))


def graph_replays_like_eager(group, opts, seeds=(2, 3, 4)):
    """The static step captured once, replayed on new routing and tokens (seeds): bit-exact
    with eager each time."""
    x0, idx0, w0 = _inputs(seed=1)
    sx, sidx, sw = x0.cuda(), idx0.cuda(), w0.cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _step(sx, sidx, sw, group, **opts)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(sx, sidx, sw, group, **opts)
    for seed in seeds:
        x, idx, w = _inputs(seed=seed)
        sx.copy_(x.cuda()); sidx.copy_(idx.cuda()); sw.copy_(w.cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager = _step(x.cuda(), idx.cuda(), w.cuda(), group, **opts)
        for name in eager:
            assert torch.equal(sim.bits(static_out[name]), sim.bits(eager[name])), name


@pytest.mark.parametrize("transport", ["dedup", "pairs"])
def test_static_cuda_graph_replay(group, transport):
    """The static step captured once, replayed on new routing and tokens: bit-exact with eager."""
    graph_replays_like_eager(group, dict(num_experts=8, transport=transport, exchange="static",
                                         max_tokens_per_rank=40, align=4))


def test_static_error_is_deferred(group):
    """Static on CUDA never waits, so an input error stays on the device: nothing moves (the
    expert rows are all padding) and epkit.device.check_static raises it."""
    from epkit.device import check_static

    x, idx, w = _inputs()
    idx = idx.clone()
    idx[3] = torch.tensor([2, 2, -1, -1])  # one expert twice in a row
    d = epkit.dispatch(x.cuda(), idx.cuda(), w.cuda(), num_experts=8, group=group,
                       exchange="static", max_tokens_per_rank=40)
    assert not bool((d.row_src[:, 0] >= 0).any())
    assert not bool(d.expert_x.float().abs().sum())
    with pytest.raises(epkit.InputError):
        check_static(d)


def test_lazy_overlaps_on_a_side_stream(group):
    """The lazy form issues on the side stream and the result is right after wait()."""
    x, idx, w = _inputs(T=64)
    opts = dict(num_experts=8, transport="dedup")
    want = _step(x.cuda(), idx.cuda(), w.cuda(), group, exchange="auto", **opts)
    pending = epkit.dispatch(x.cuda(), idx.cuda(), w.cuda(), group=group, exchange="lazy", **opts)
    filler = torch.randn(2048, 2048, device="cuda")
    filler = filler @ filler  # independent work between issue and wait
    d = pending.wait()
    assert torch.equal(sim.bits(d.expert_x), sim.bits(want["expert_x"]))
    del filler
