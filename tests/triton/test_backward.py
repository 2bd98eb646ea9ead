"""epkit.triton.backward (combine_backward_dest, gather_slot_values, scatter_slot_values)
against the C++ kernels, bit for bit (integer views), in Triton's interpreter: the weight
gradient in the C++ kernel's 16-lane order included."""

import numpy as np
import pytest
import torch

from test_combine import DTYPES, same, source_side, special

from epkit.triton import backward as tb

PAIRS, DEDUP = 0, 1
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def random_map(rng, N, C, M, used):
    """recv_map [N, C]: `used` distinct rows of M named once each, the rest -1."""
    rmap = np.full(N * C, -1, np.int64)
    rmap[rng.choice(N * C, used, replace=False)] = rng.choice(M, used, replace=False)
    return torch.from_numpy(rmap.reshape(N, C))


# ---- combine_backward_dest --------------------------------------------------------------------
@pytest.mark.parametrize("gdtype", DTYPES)
@pytest.mark.parametrize("ydtype", DTYPES)
@pytest.mark.parametrize("H", [1, 16, 37, 300])
def test_combine_backward_dest(cpp, gdtype, ydtype, H):
    rng = np.random.default_rng(H)
    N, C, M = 9, 3, 70  # 70 rows: two programs of the interpreter's 64; 50 used, 20 padding
    rmap = random_map(rng, N, C, M, 20)
    y = special(rng, (M, H), ydtype, finite=True)
    w = torch.from_numpy(rng.random(M).astype(np.float32))
    for finite in (True, False):  # every bit class (NaN payloads, inf, subnormal, ties) too
        g = special(rng, (N, H), gdtype, finite)
        for weighted in (True, False):
            got = tb.combine_backward_dest(g, rmap, w, y, weighted)
            want = cpp.combine_backward_dest(g, rmap, w, y, weighted)
            assert same(got[0], want[0]) and same(got[1], want[1]), (finite, weighted)


def test_combine_backward_dest_zero_rows(cpp):
    for M, N, H in [(0, 0, 8), (0, 3, 8), (5, 0, 3), (4, 2, 0)]:
        rmap = torch.full((N, 2), -1, dtype=torch.int64)
        args = (torch.ones(N, H), rmap, torch.ones(M), torch.ones(M, H), True)
        got, want = tb.combine_backward_dest(*args), cpp.combine_backward_dest(*args)
        assert same(got[0], want[0]) and same(got[1], want[1])


def test_combine_backward_dest_past_2_31_bytes(cpp):
    """recv of 2**31 bytes and more (torch.empty, only the used rows written): the gradient rows
    read from past the int32 range are the ones the C++ kernel reads."""
    rng = np.random.default_rng(3)
    N, H = (1 << 19) + 8, 1030  # float32 rows of 4120 bytes
    recv = torch.empty((N, H))
    assert recv.numel() * 4 > 2**31
    recv[N - 4:] = special(rng, (4, H), torch.float32, finite=True)
    rmap = torch.full((N, 2), -1, dtype=torch.int64)
    rmap[N - 4:] = torch.tensor([[0, 3], [-1, 1], [4, -1], [2, 6]])
    y = special(rng, (8, H), torch.bfloat16, finite=True)
    w = torch.from_numpy(rng.random(8).astype(np.float32))
    got, want = tb.combine_backward_dest(recv, rmap, w, y, True), \
        cpp.combine_backward_dest(recv, rmap, w, y, True)
    assert same(got[0], want[0]) and same(got[1], want[1])


# ---- the weight gradients' return path -----------------------------------------------------------
def slot_layout(rng, counts, gaps):
    """first [len(counts)] (-1 where nothing is placed) and the buffer's length."""
    first = np.full(len(counts), -1, np.int64)
    at = 0
    for n, k in enumerate(counts):
        at += int(rng.integers(0, 3)) if gaps else 0
        if k:
            first[n], at = at, at + int(k)
    return torch.from_numpy(first), at + (1 if gaps else 0)


@pytest.mark.parametrize("N,C,M", [(0, 3, 4), (13, 1, 20), (17, 5, 60)])
def test_gather_slot_values(cpp, N, C, M):
    rng = np.random.default_rng(N + C)
    rmap = random_map(rng, N, C, M, min(N * C, M) // 2 + (N > 0))
    values = special(rng, (M,), torch.float32)  # NaN payloads travel as they are
    for gaps in (False, True):
        first, B = slot_layout(rng, (rmap >= 0).sum(1).tolist(), gaps)
        got = tb.gather_slot_values(values, rmap, first, B)
        assert same(got, cpp.gather_slot_values(values, rmap, first, B))


@pytest.mark.parametrize("transport", [PAIRS, DEDUP])
@pytest.mark.parametrize("T,K", [(0, 4), (21, 6), (9, 1)])
def test_scatter_slot_values(cpp, transport, T, K):
    rng = np.random.default_rng(T * 10 + K + transport)
    R, L = 4, 3
    idx, smap, _, _, E = source_side(rng, T, R, L, K, 1, torch.float32, transport, False)
    if transport == PAIRS:  # a value per send row
        counts = [1] * (int(smap.max()) + 1 if smap.numel() else 0)
    else:  # a value per kept slot of the token row
        counts = [0] * (int(smap.max()) + 1 if smap.numel() else 0)
        for t in range(T):
            for d in range(R):
                if smap[t, d] >= 0:
                    counts[smap[t, d]] = int(((idx[t] >= 0) & (idx[t] // L == d)).sum())
    for gaps in (False, True):
        first, B = slot_layout(rng, counts, gaps)
        back = special(rng, (B,), torch.float32)
        for ids in (idx, idx.to(torch.int32)):
            args = (back, smap, ids, first, E, R, transport)
            assert same(tb.scatter_slot_values(*args), cpp.scatter_slot_values(*args))


@pytest.fixture
def device_path(monkeypatch):
    """As on a GPU (or under EPKIT_KERNELS=triton): no host read, so no data-dependent error."""
    from epkit.triton import rowchecks

    monkeypatch.setattr(rowchecks, "on_host", lambda t: False)


def test_bad_entries_are_masked_on_the_device_path(cpp, device_path):
    """What the C++ kernels raise for, the Triton kernels skip (read and write nothing there):
    equal to the C++ result of the input with those entries removed."""
    rng = np.random.default_rng(4)
    N, C, M, H = 9, 3, 30, 37
    rmap = random_map(rng, N, C, M, 20)
    bad, clean = rmap.clone(), rmap.clone()
    free = np.argwhere(rmap.numpy() < 0)
    bad[tuple(free[0])] = M + 5
    bad[tuple(free[1])] = -7
    g, y = special(rng, (N, H), torch.float32, True), special(rng, (M, H), torch.bfloat16, True)
    w = torch.from_numpy(rng.random(M).astype(np.float32))
    got, want = tb.combine_backward_dest(g, bad, w, y, True), cpp.combine_backward_dest(g, clean, w, y, True)
    assert same(got[0], want[0]) and same(got[1], want[1])
    # gather_slot_values: an entry past values keeps its place (as the C++ kernel counts it)
    # and writes nothing; a place past out_rows is skipped
    values = special(rng, (M,), torch.float32)
    first, B = slot_layout(rng, (bad != -1).sum(1).tolist(), False)
    n_last = int(np.argwhere((bad != -1).sum(1).numpy() > 0)[-1, 0])
    first[n_last] += 1  # its last value now lands at B: past the buffer
    got = tb.gather_slot_values(values, bad, first, B)
    want = torch.zeros(B)
    for n in range(N):
        at = int(first[n])
        for m in bad[n].tolist():
            if m == -1:
                continue
            if 0 <= m < M and 0 <= at < B:
                want[at] = values[m]
            at += 1
    assert same(got, want)
    # scatter_slot_values: an expert past E, a send row past first, a place past back
    idx = torch.tensor([[0, 5, -1], [3, 1, 2], [4, 2, 0]])  # E = 6, R = 2: L = 3
    smap = torch.tensor([[0, 1], [2, 3], [4, 5]])
    sfirst = torch.tensor([0, 1, 2, 4, 5, 7])
    back = special(rng, (9,), torch.float32)
    bad_idx, bad_smap, bad_first = idx.clone(), smap.clone(), sfirst.clone()
    bad_idx[0, 1] = 2**40          # expert past E
    bad_smap[1, 1] = 99            # rank 1's row of token 1 past first
    bad_first[4] = 8               # token 2's 2 values on rank 0: at 8 and 9, past back
    bad_first[5] = 9               # its value on rank 1: past back
    got = tb.scatter_slot_values(back, bad_smap, bad_idx, bad_first, 6, 2, DEDUP)
    want = cpp.scatter_slot_values(back, smap, idx, sfirst, 6, 2, DEDUP)
    want[0, 1] = want[1, 0] = 0.0  # the skipped slots
    want[2, 0] = want[2, 2] = 0.0  # row 5's value, row 4's second: past back
    want[2, 1] = back[8]           # row 4's first, now at 8
    assert same(got, want)
