"""CUDA kernels bit for bit against the CPU kernels, over whole simulated groups (sim.py).

Group sizes 1..5 on one GPU, both transports, every exchange layout, capacity and align, odd
hidden sizes (unaligned rows: narrower vectors), more tokens than one index chunk (64) and more
slots per row than a warp (K > 32); the quantized payloads; the plan and the count words; layout.
"""

import itertools

import pytest
import torch

import sim
from epkit.device import unpack_status

pytestmark = [pytest.mark.cuda, sim.needs_cuda]

BF16, F32 = torch.bfloat16, torch.float32

# (R, L, K, H, tokens per rank, x dtype)
SHAPES = [
    (1, 4, 2, 8, [5], F32),
    (2, 3, 4, 16, [7, 0], BF16),
    (3, 2, 3, 7, [4, 9, 1], F32),         # H odd: element-wise rows
    (4, 8, 8, 96, [150, 70, 3, 0], BF16),  # several index chunks
    (5, 1, 5, 33, [6, 6, 6, 6, 6], BF16),  # L = 1; H odd
    (2, 24, 40, 64, [70, 3], F32),         # K = 40: two warp passes per row
]
OPTIONS = [  # (transport, exchange, align, capacity)
    ("dedup", "ragged", 1, None), ("pairs", "ragged", 1, None),
    ("dedup", "padded", 2, 3), ("pairs", "padded", 1, 0),
    ("dedup", "static", 4, None), ("pairs", "static", 1, 2),
    ("dedup", "equal", 1, None), ("pairs", "auto", 3, 5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"R{s[0]}L{s[1]}K{s[2]}H{s[3]}")
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: f"{o[0]}-{o[1]}-a{o[2]}-c{o[3]}")
def test_group_round_trip_bitwise(cuda_ext, shape, opts):
    R, L, K, H, Ts, dtype = shape
    transport, exchange, align, capacity = opts
    case = sim.make_case(R, L, K, H, Ts, dtype, seed=R * 100 + K, hot=capacity is not None)
    kw = dict(align=align, capacity=capacity, transport=transport, exchange=exchange,
              y_dtype=BF16 if H % 2 else F32)
    for weighted in (True, False):
        cpu = sim.run(case, weighted=weighted, device="cpu", **kw)
        gpu = sim.run(case, weighted=weighted, device="cuda", **kw)
        sim.assert_same(cpu, gpu)
        assert unpack_status() == 0  # no unpack saw a mismatch (no false positive)
        if weighted:
            sim.assert_weight_grad_close(gpu)
        else:
            assert all(not bool(g.any()) for g in gpu["grad_w_combine"])


@pytest.mark.parametrize("payload", ["mxfp8", "fp8_block128"])
@pytest.mark.parametrize("transport,exchange", [("dedup", "ragged"), ("pairs", "static"),
                                                ("dedup", "static"), ("pairs", "padded")])
def test_quantized_payload_bitwise(cuda_ext, payload, transport, exchange):
    case = sim.make_case(3, 2, 3, 256, [9, 0, 70], BF16, seed=7)
    kw = dict(transport=transport, exchange=exchange, align=2)
    cpu = sim.run_payload(case, payload, device="cpu", **kw)
    gpu = sim.run_payload(case, payload, device="cuda", **kw)
    sim.assert_same(cpu, gpu)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_quantize_mxfp8_edges(cuda_ext, dtype):
    """Zeros (code 0), signed zeros, subnormal blocks (scale 2^-127), saturation, ties."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-40, 30, 64).unsqueeze(1)
    x[0] = 0.0
    x[1] = -0.0
    x[2, :32] = 1e-45  # the smallest subnormal float32
    x[3, :32] = torch.tensor([448.0, 464.0, 480.0, -2**-9] * 8)
    x[4] = torch.finfo(torch.float32).max / 2
    x = x.to(dtype)
    q_cpu, c_cpu = cuda_ext.quantize_mxfp8(x)
    q_gpu, c_gpu = cuda_ext.quantize_mxfp8(x.cuda())
    assert torch.equal(sim.bits(q_cpu), sim.bits(q_gpu.cpu()))
    assert torch.equal(c_cpu, c_gpu.cpu())


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_quantize_fp8_block128_edges(cuda_ext, dtype):
    """Zero and -0 blocks, amax below the 1e-4 clamp, subnormals, saturation, the extremes,
    non-finite elements (the raw op takes them: E4M3 NaN with the element's sign)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-40, 30, 64).unsqueeze(1)
    x[0] = 0.0
    x[1] = -0.0
    x[2, :128] = 1e-45
    x[3, :128] = torch.tensor([8.294966, -8.294966, 3.997119, -2**-9] * 32)  # v / s > 448
    x[4] = torch.finfo(torch.float32).max
    x[5, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    x = x.to(dtype)
    q_cpu, s_cpu = cuda_ext.quantize_fp8_block128(x)
    q_gpu, s_gpu = cuda_ext.quantize_fp8_block128(x.cuda())
    assert torch.equal(sim.bits(q_cpu), sim.bits(q_gpu.cpu()))
    assert torch.equal(sim.bits(s_cpu), sim.bits(s_gpu.cpu()))


@pytest.mark.parametrize("R,L,capacity,align,transport,exchange,static", list(itertools.product(
    [1, 2, 7], [1, 5], [-1, 0, 3], [1, 4], [0, 1], [0, 1, 2, 3], [-1, 6])))
def test_plan_words_equal_cpu(cuda_ext, R, L, capacity, align, transport, exchange, static):
    """The device plan equals plan_cpu word for word, from the same gathered words."""
    E = R * L
    case = sim.make_case(R, L, min(E, 3), 16, [6] * R, F32, seed=R + L, hot=True)
    _, xs, idxs, ws = case
    words = torch.stack([cuda_ext.prepare(x, i, w, E, R, [0, 0, 0, 1, static], 0)
                         for x, i, w in zip(xs, idxs, ws)])
    words_gpu = torch.stack([cuda_ext.prepare(x.cuda(), i.cuda(), w.cuda(), E, R,
                                              [0, 0, 0, 1, static], 0)
                             for x, i, w in zip(xs, idxs, ws)])
    assert torch.equal(words, words_gpu.cpu())
    for r in range(R):
        args = (r, E, align, capacity, transport, exchange, static)
        assert torch.equal(cuda_ext.plan(words, *args), cuda_ext.plan(words_gpu, *args).cpu())


def test_plan_errors_equal_cpu(cuda_ext):
    """Error words (a bad rank, H / dtype / K mismatches) give the same plan on both."""
    R, E = 4, 8
    words = torch.zeros(R, 8 + E + R, dtype=torch.int64)
    words[:, 4], words[:, 5], words[:, 6] = 16, 2, 1
    variants = []
    w = words.clone(); w[2, :3] = torch.tensor([2, 5, 1]); variants.append(w)   # rank 2's error
    w = words.clone(); w[3, 4] = 32; variants.append(w)                       # H
    w = words.clone(); w[1, 6] = 2; variants.append(w)                        # dtype
    w = words.clone(); w[2, 5] = 3; variants.append(w)                        # K
    for w in variants:
        for r in range(R):
            a = cuda_ext.plan(w, r, E, 1, -1, 1, 0, -1)
            b = cuda_ext.plan(w.cuda(), r, E, 1, -1, 1, 0, -1).cpu()
            assert torch.equal(a, b)


def test_prepare_errors_equal_cpu(cuda_ext):
    """Value checks in prepare: index range, duplicates, weights, MXFP8 H and payload."""
    x = torch.randn(6, 64)
    idx = torch.tensor([[0, 1], [2, 3], [1, 1], [4, -1], [-1, -1], [5, 6]])
    w = torch.rand(6, 2)
    cases = []
    i = idx.clone(); i[3, 1] = 9; cases.append((x, i, w, 0))          # out of range (E = 8)
    i = idx.clone(); i[4, 0] = -3; cases.append((x, i, w, 0))         # below -1
    cases.append((x, idx, w, 0))                                      # duplicate (row 2)
    w2 = w.clone(); w2[5, 0] = float("inf"); cases.append((x, idx.clone().fill_(-1), w2, 0))
    x2 = x.clone(); x2[4, 3] = float("nan"); cases.append((x2, idx.clone().fill_(-1), w, 1))
    cases.append((torch.randn(6, 48), idx.clone().fill_(-1), w, 1))  # H % 32 != 0
    cases.append((x2, idx.clone().fill_(-1), w, 2))                  # fp8_block128: H % 128
    x3 = torch.randn(6, 128); x3[2, 7] = float("inf")
    cases.append((x3, idx.clone().fill_(-1), w, 2))                  # fp8_block128: non-finite
    for x_, i_, w_, payload in cases:
        for static in (-1, 3):
            pre = [0, 0, 0, 1, static]
            a = cuda_ext.prepare(x_, i_, w_, 8, 2, pre, payload)
            b = cuda_ext.prepare(x_.cuda(), i_.cuda(), w_.cuda(), 8, 2, pre, payload).cpu()
            assert torch.equal(a, b), (a[:8], b[:8])
    a = cuda_ext.prepare(x, idx, w, 8, 2, [4, 1, 2, 1, -1], 0)   # an error from Python's checks
    b = cuda_ext.prepare(x.cuda(), idx.cuda(), w.cuda(), 8, 2, [4, 1, 2, 1, -1], 0).cpu()
    assert torch.equal(a, b)


def test_layout_equal_cpu(cuda_ext):
    case = sim.make_case(1, 12, 5, 8, [300], F32, seed=11)
    idx = case[2][0].to(torch.int32)
    for R in (1, 2, 3, 4, 6, 12):
        a = cuda_ext.layout(idx, 12, R)
        b = cuda_ext.layout(idx.cuda(), 12, R)
        for u, v in zip(a, b):
            assert torch.equal(u, v.cpu())
    bad = idx.clone()
    bad[7, 2] = 12
    with pytest.raises(RuntimeError, match="outside"):
        cuda_ext.layout(bad.cuda(), 12, 3)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("H", [3, 37, 1024])
@pytest.mark.parametrize("gaps", [False, True])
def test_way_back_units_equal_cpu(cuda_ext, dtype, H, gaps):
    """dedup's way back as it travels: gather_units (units placed by first, the gaps zero; odd H
    in bfloat16 puts float32 partials at unaligned units) and reduce_tokens reading them in
    place, bit for bit the CPU kernels."""
    C = torch.ops.epkit
    g = torch.Generator().manual_seed(H + gaps)
    N, K, M = 40, 6, 150
    rmap = torch.full((N * K,), -1, dtype=torch.int64)
    pick = torch.randperm(N * K, generator=g)[:M]
    rmap[pick] = torch.randperm(M, generator=g)
    rmap = rmap.view(N, K)
    y = torch.randn((M, H), generator=g).to(dtype)
    w = torch.rand(M, generator=g)
    per = 4 // y.element_size()
    u = (rmap >= 0).sum(1).clamp(max=per)
    pad = torch.randint(0, 3, (N,), generator=g) if gaps else torch.zeros(N, dtype=torch.int64)
    base = torch.cumsum(u + pad, 0) - u
    first = torch.where(u > 0, base, -1)
    units = int((u + pad).sum()) + (2 if gaps else 0)
    for weighted in (True, False):
        cpu = torch.empty((units, H), dtype=dtype)
        gpu = torch.full((units, H), float("nan"), dtype=dtype, device="cuda")  # gaps: zeroed
        C.gather_units(y, rmap, w, 1, weighted, first, cpu)
        C.gather_units(y.cuda(), rmap.cuda(), w.cuda(), 1, weighted, first.cuda(), gpu)
        assert torch.equal(cpu.view(torch.uint8), gpu.cpu().view(torch.uint8))
    # the source side: R = 2 ranks of L = K experts, token rows (t, d) in order
    T, R = 30, 2
    idx = torch.stack([torch.randperm(R * K, generator=g)[:K] for _ in range(T)])
    idx[torch.rand((T, K), generator=g) < 0.3] = -1
    n = torch.stack([((idx >= 0) & (idx // K == d)).sum(1) for d in range(R)], 1)  # [T, R]
    send_map = torch.where(n > 0, torch.cumsum((n > 0).view(-1), 0).view(T, R) - 1, -1)
    un = n[n > 0].clamp(max=per)
    sfirst = torch.cumsum(un, 0) - un
    back = torch.randn((int(un.sum()), H), generator=g).to(dtype)
    tw = torch.rand((T, K), generator=g)
    for G in (1, 2):
        for weighted in (True, False):
            a = C.reduce_tokens(back, send_map, idx, tw, R * K, R, 1, weighted, dtype, G, sfirst)
            b = C.reduce_tokens(back.cuda(), send_map.cuda(), idx.cuda(), tw.cuda(), R * K, R, 1,
                                weighted, dtype, G, sfirst.cuda())
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
