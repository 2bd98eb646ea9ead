"""The CPU row kernels against plain NumPy statements of their arithmetic, bit for bit.

The kernels walk their large outputs front to back through an inverse of the row map, convert
bfloat16 without a branch and are built for AVX2 and the baseline: none of that may change a
bit. Here ``combine_backward_dest`` is checked on rows the group tests rarely produce (every
float32 bit class: NaN payloads, infinities, subnormals, rounding ties), its weight gradient's
16-lane float32 order exactly, and the row maps' new checks (a row named twice).
"""

import numpy as np
import pytest
import torch

import epkit.ops  # noqa: F401  (loads the extension)

C = torch.ops.epkit
F32 = np.float32


def bf16_bits(v: np.ndarray) -> np.ndarray:
    """c10's float32 -> bfloat16 rule on the bits: NaN -> 0x7FC0, else round to nearest even."""
    u = np.ascontiguousarray(v, F32).view(np.uint32).astype(np.uint64)
    rounded = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, np.uint16(0x7FC0), rounded)


def special_floats(rng, n: int) -> np.ndarray:
    """n float32 values: random bit patterns (every class) with the edge cases planted."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001,
                      0x7FFFFFFF, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000,
                      0x3F807FFF, 0x3F808001, 0x4049_0FDB], np.uint32)
    bits[: len(edges)] = edges[:n]
    return bits.view(F32)


def lanes_dot(g: np.ndarray, y: np.ndarray) -> F32:
    """<g, y> as the kernel sums it: lane i holds h = i (mod 16), the tail in lane 0."""
    H = g.shape[0]
    lane = np.zeros(16, F32)
    full = H - H % 16
    for h in range(0, full, 16):
        lane = (lane + g[h:h + 16] * y[h:h + 16]).astype(F32)
    for h in range(full, H):
        lane[0] = F32(lane[0] + F32(g[h] * y[h]))
    dot = F32(0)
    for v in lane:
        dot = F32(dot + v)
    return dot


def random_map(rng, N: int, Cw: int, M: int, used: int) -> np.ndarray:
    """recv_map [N, Cw]: `used` distinct rows of M named once each, the rest -1."""
    rmap = np.full(N * Cw, -1, np.int64)
    rmap[rng.choice(N * Cw, used, replace=False)] = rng.choice(M, used, replace=False)
    return rmap.reshape(N, Cw)


@pytest.mark.parametrize("H", [1, 16, 37, 64, 1024])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_backward_dest_bits(H, weighted):
    rng = np.random.default_rng(H)
    N, Cw, M, used = 6, 3, 13, 11  # 2 padding rows
    g = special_floats(rng, N * H).reshape(N, H)
    if weighted:  # finite gradients, so the dot is a number
        g = rng.standard_normal((N, H)).astype(F32)
    y = torch.from_numpy(rng.standard_normal((M, H)).astype(F32)).to(torch.bfloat16)
    w = rng.random(M).astype(F32)
    w[:3] = [-0.0, 0.0, 1.0]  # exact weights: -0 * g keeps its sign in every lane
    rmap = random_map(rng, N, Cw, M, used)
    gy, gw = C.combine_backward_dest(torch.from_numpy(g), torch.from_numpy(rmap),
                                     torch.from_numpy(w), y, weighted)
    assert gy.dtype == torch.bfloat16 and gy.shape == (M, H) and gw.shape == (M,)
    got = gy.view(torch.int16).numpy().view(np.uint16)
    yf = y.float().numpy()
    want = np.zeros((M, H), np.uint16)
    want_w = np.zeros(M, F32)
    for i, m in enumerate(rmap.reshape(-1)):
        if m < 0:
            continue
        row = g[i // Cw]
        want[m] = bf16_bits(F32(w[m]) * row if weighted else row)
        if weighted:
            want_w[m] = lanes_dot(row, yf[m])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gw.numpy().view(np.uint32), want_w.view(np.uint32))


def test_bf16_rounding_agrees_with_the_reference_cast():
    """Every non-NaN float32 class rounds as ml_dtypes (the reference's cast) does."""
    import ml_dtypes

    v = special_floats(np.random.default_rng(1), 4096)
    v = v[~np.isnan(v)]
    np.testing.assert_array_equal(bf16_bits(v), v.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_backward_dest_float32_rows(dtype):
    """float32 expert rows (no rounding) and bfloat16 gradient rows widen exactly."""
    rng = np.random.default_rng(3)
    N, Cw, M, H = 5, 2, 8, 40
    g = torch.from_numpy(rng.standard_normal((N, H)).astype(F32)).to(dtype)
    y = torch.from_numpy(rng.standard_normal((M, H)).astype(F32))
    w = torch.from_numpy(rng.random(M).astype(F32))
    rmap = random_map(rng, N, Cw, M, 7)
    gy, gw = C.combine_backward_dest(g, torch.from_numpy(rmap), w, y, True)
    gf = g.float().numpy()
    for i, m in enumerate(rmap.reshape(-1)):
        if m >= 0:
            np.testing.assert_array_equal(gy[m].numpy(), F32(w[m].item()) * gf[i // Cw])
            assert gw[m].numpy().view(np.uint32) == lanes_dot(gf[i // Cw], y[m].numpy()).view(
                np.uint32)
    pad = sorted(set(range(M)) - set(rmap[rmap >= 0].tolist()))
    assert torch.all(gy[pad] == 0) and torch.all(gw[pad] == 0)


def test_combine_backward_dest_refuses_a_row_named_twice():
    rmap = torch.tensor([[0, 1], [1, -1]])
    with pytest.raises(RuntimeError, match="both name row 1"):
        C.combine_backward_dest(torch.ones(2, 4), rmap, torch.ones(3), torch.ones(3, 4), True)


def test_scatter_rows_order_and_zero_rows():
    rng = np.random.default_rng(5)
    T, Cw, S, H = 7, 3, 12, 9
    src = torch.from_numpy(rng.standard_normal((T, H)).astype(F32))
    smap = random_map(rng, T, Cw, S, 10)
    out = C.scatter_rows(src, torch.from_numpy(smap), S)
    want = np.zeros((S, H), F32)
    for i, r in enumerate(smap.reshape(-1)):
        if r >= 0:
            want[r] = src[i // Cw].numpy()
    np.testing.assert_array_equal(out.numpy(), want)
    with pytest.raises(RuntimeError, match="named already by token 0"):
        C.scatter_rows(src[:2], torch.tensor([[0, 1], [2, 0]]), 3)


def test_large_blocks_are_kept_and_released():
    """csrc/cpu/alloc.cpp: a large output's block is kept when its tensor dies and given to the
    next output of about its size (no page to fault in); release_cache returns it. The bytes a
    kernel writes into a reused block are the kernel's, never the last tensor's."""
    C.release_cache()
    big = torch.zeros(1)
    rmap = torch.arange(4096, dtype=torch.int64).view(-1, 1)
    y = torch.randn(4096, 1024).to(torch.bfloat16)  # rows of 2 KiB: an 8 MiB output
    a = C.gather_rows(y, rmap, big, 0, False)
    ptr = a.data_ptr()
    a.fill_(7)
    del a
    b = C.gather_rows(y, rmap, big, 0, False)  # the same size: the kept block
    assert b.data_ptr() == ptr
    assert torch.equal(b, y)  # every byte rewritten
    del b
    assert C.cached_bytes() >= 4096 * 2048
    assert C.release_cache() >= 4096 * 2048
    assert C.release_cache() == 0 and C.cached_bytes() == 0
    c = C.gather_rows(y, rmap, big, 0, False)
    assert torch.equal(c, y)
