"""epkit.triton.combine (gather_rows, gather_units, reduce_tokens) against the C++ kernels, bit
for bit (integer views: NaN payloads and -0 count), in Triton's interpreter.

Inputs are built by hand the way the pipeline makes them (tests/production/test_return_path.py):
recv_map rows with 0 .. K kept slots, send_map naming a token row per (token, rank) or a row
per slot, first with gaps, rows of random float32 bit patterns of every class with the edge
values planted (NaN payloads, infinities, subnormals, -0, bfloat16 rounding ties)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epkit.triton import combine as tc

PAIRS, DEDUP = 0, 1
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

EDGES = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001,
                  0x7FFFFFFF, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000,
                  0x3F807FFF, 0x3F808001, 0x40490FDB, 0x80000001, 0x00400000], np.uint32)


def special(rng, shape, dtype, finite=False) -> torch.Tensor:
    """Random float32 bit patterns of every class (finite=False) or normal values, with the
    edge values planted at random places, in dtype (bfloat16: by torch's cast, which is c10's
    rounding: ties and NaN included)."""
    n = int(np.prod(shape))
    if finite:
        v = rng.standard_normal(n).astype(np.float32)
    else:
        v = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
        if n:
            v[rng.integers(0, n, min(n, 3 * len(EDGES)))] = np.resize(EDGES, min(n, 3 * len(EDGES))).view(np.float32)
    return torch.from_numpy(v.reshape(shape)).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, for torch.equal of bit patterns."""
    return t.contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_sum(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``same`` for sums: a computed NaN matches any NaN (IEEE 754 leaves a computed NaN's sign
    and payload open, docs/verify.md: NaN + NaN is either operand's, and the C++ vector adds and
    the interpreter's may pick differently); every other bit, -0 included, must agree."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return same(torch.where(nan, torch.zeros_like(a), a), torch.where(nan, torch.zeros_like(b), b))


# ---- inputs ----------------------------------------------------------------------------------
def expert_side(rng, N, K, M, H, dtype, finite=False):
    """recv_map [N, K] (rows with 0 .. K kept slots, c ascending, distinct rows of M), y, w."""
    rmap = np.full((N, K), -1, np.int64)
    rows = rng.permutation(M)
    at = 0
    for n in range(N):
        for c in sorted(rng.choice(K, int(rng.integers(0, K + 1)), replace=False)):
            if at < M:
                rmap[n, c], at = rows[at], at + 1
    y = special(rng, (M, H), dtype, finite)
    w = torch.from_numpy(rng.random(M).astype(np.float32))
    return torch.from_numpy(rmap), y, w


def layout(u: np.ndarray, gaps: bool, rng):
    """first [N] (-1: no units) and the buffer's units: compact, or with random gaps."""
    first = np.full(len(u), -1, np.int64)
    at = 0
    for n, k in enumerate(u):
        at += int(rng.integers(0, 3)) if gaps else 0
        if k:
            first[n], at = at, at + int(k)
    return torch.from_numpy(first), at + (2 if gaps else 0)


def source_side(rng, T, R, L, K, H, dtype, transport, compact, gaps=True, finite=False):
    """The kept routing idx [T, K] (dropped / unused -1), send_map, back and first (dedup with
    compact: the units at first, else rows of 4H bytes)."""
    E = R * L
    idx = np.full((T, K), -1, np.int64)
    for t in range(T):
        k = int(rng.integers(0, K + 1))
        idx[t, :k] = rng.choice(E, k, replace=False)
        rng.shuffle(idx[t])
    if T and K >= 3:  # three slots on rank 0: a partial in either dtype
        idx[0] = -1
        idx[0, [K - 1, 1, 0]] = [2 % E, 0, 1 % E]
    per = 4 // torch.tensor([], dtype=dtype).element_size()
    if transport == PAIRS:
        send_map = np.full((T, K), -1, np.int64)
        used = np.argwhere(idx >= 0)
        keep = rng.random(len(used)) < 0.85  # some dropped: used slots without a row
        rows = rng.permutation(int(keep.sum()) + 3)
        for (t, k), r in zip(used[keep], rows):
            send_map[t, k] = r
        back = special(rng, (len(rows), H), dtype, finite)
        return torch.from_numpy(idx), torch.from_numpy(send_map), back, None, E
    send_map = np.full((T, R), -1, np.int64)
    n_of = []
    for t in range(T):
        for d in range(R):
            n = int(((idx[t] >= 0) & (idx[t] // L == d)).sum())
            if n:
                send_map[t, d] = len(n_of)
                n_of.append(n)
    u = np.minimum(np.array(n_of, np.int64), per)
    if compact:
        first, units = layout(u, gaps, rng)
        back = special(rng, (units, H), dtype, finite)
    else:
        first, back = None, special(rng, (len(n_of), per * H), dtype, finite)
    return torch.from_numpy(idx), torch.from_numpy(send_map), back, first, E


# ---- the expert side -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [1, 37, 300])
def test_gather_rows_and_units_dedup(cpp, dtype, H):
    rng = np.random.default_rng(H)
    rmap, y, w = expert_side(rng, 11, 5, 40, H, dtype)
    per = 4 // y.element_size()
    for weighted in (True, False):
        want = cpp.gather_rows(y, rmap, w, DEDUP, weighted)
        got = tc.gather_rows(y, rmap, w, DEDUP, weighted)
        assert same(got, want)
        u = np.minimum((rmap >= 0).sum(1).numpy(), per)
        for gaps in (False, True):
            first, units = layout(u, gaps, rng)
            want = torch.full((units, H), float("nan"), dtype=dtype)  # stale bytes
            got = want.clone()
            cpp.gather_units(y, rmap, w, DEDUP, weighted, first, want)
            tc.gather_units(y, rmap, w, DEDUP, weighted, first, got)
            assert same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_gather_rows_and_units_pairs(cpp, dtype):
    rng = np.random.default_rng(1)
    M, N, H = 30, 23, 45
    y = torch.from_numpy(rng.integers(0, 256, (M, H * torch.tensor([], dtype=dtype).element_size()),
                                      dtype=np.uint8)).view(dtype)
    rmap = torch.from_numpy(np.where(rng.random(N) < 0.3, -1, rng.permutation(M)[:N]))[:, None]
    big = torch.zeros(1)
    want = cpp.gather_rows(y, rmap, big, PAIRS, False)
    assert same(tc.gather_rows(y, rmap, big, PAIRS, False), want)
    out = torch.empty((N, H), dtype=dtype)
    out.view(torch.uint8).fill_(7)  # stale bytes: every one rewritten
    tc.gather_units(y, rmap, big, PAIRS, True, None, out)
    assert same(out, want)


def test_gather_zero_rows(cpp):
    y = torch.zeros((0, 8), dtype=torch.bfloat16)
    rmap = torch.full((3, 4), -1, dtype=torch.int64)
    w = torch.zeros(0)
    assert same(tc.gather_rows(y, rmap, w, DEDUP, True), cpp.gather_rows(y, rmap, w, DEDUP, True))
    empty = torch.zeros((0, 4), dtype=torch.int64)
    assert tc.gather_rows(y, empty, w, DEDUP, True).shape == (0, 8)
    for impl in (cpp, tc):  # no units at all
        impl.gather_units(y, rmap, w, DEDUP, True, torch.full((3,), -1),
                          torch.empty((0, 8), dtype=torch.bfloat16))


# ---- the source side -----------------------------------------------------------------------
CONFIGS = [(PAIRS, False, 1), (PAIRS, False, 2), (DEDUP, True, 1), (DEDUP, True, 2),
           (DEDUP, False, 1), (DEDUP, False, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport,compact,G", CONFIGS)
@pytest.mark.parametrize("H", [1, 37, 300])
def test_reduce_tokens(cpp, dtype, transport, compact, G, H):
    rng = np.random.default_rng(H * 13 + G * 3 + transport * 7 + compact)
    idx, smap, back, first, E = source_side(rng, 19, 4, 3, 6, H, dtype, transport, compact)
    w = special(rng, idx.shape, torch.float32, finite=True)
    for weighted in (True, False):
        for out_dtype in DTYPES:
            args = (back, smap, idx, w, E, 4, transport, weighted, out_dtype, G, first)
            assert same_sum(tc.reduce_tokens(*args), cpp.reduce_tokens(*args)), (weighted, out_dtype)


def test_reduce_tokens_zero_tokens_and_slots(cpp):
    back = torch.zeros((0, 6))
    for idx in (torch.zeros((0, 3), dtype=torch.int64), torch.full((4, 0), -1)):
        smap = torch.full((idx.shape[0], idx.shape[1]), -1, dtype=torch.int64)
        args = (back, smap, idx, torch.zeros(idx.shape), 4, 2, PAIRS, True, torch.bfloat16, 1, None)
        assert same_sum(tc.reduce_tokens(*args), cpp.reduce_tokens(*args))
    idx = torch.full((3, 2), -1, dtype=torch.int32)  # no kept slot: +0.0; int32 expert ids
    args = (torch.zeros((0, 5)), torch.full((3, 2), -1), idx, torch.zeros((3, 2)), 4, 2, DEDUP,
            False, torch.float32, 2, torch.zeros(0, dtype=torch.int64))
    assert same_sum(tc.reduce_tokens(*args), cpp.reduce_tokens(*args))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), T=st.integers(0, 12), R=st.sampled_from([1, 2, 4]),
       L=st.integers(1, 3), K=st.integers(1, 7), H=st.integers(1, 70),
       transport=st.sampled_from([PAIRS, DEDUP]), compact=st.booleans(),
       bf16=st.booleans(), weighted=st.booleans())
def test_reduce_tokens_property(cpp, seed, T, R, L, K, H, transport, compact, bf16, weighted):
    rng = np.random.default_rng(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    K = min(K, R * L)
    compact = compact and transport == DEDUP
    idx, smap, back, first, E = source_side(rng, T, R, L, K, H, dtype, transport, compact)
    w = special(rng, idx.shape, torch.float32, finite=True)
    for G in sorted({1, R}):
        args = (back, smap, idx, w, E, R, transport, weighted, dtype, G, first)
        assert same_sum(tc.reduce_tokens(*args), cpp.reduce_tokens(*args))


# ---- byte offsets past 2**31 -----------------------------------------------------------------
BIG_ROWS, BIG_H = (1 << 20) + 24, 1024  # bfloat16 rows of 2 KiB: 2**31 + 48 KiB


def test_offsets_past_2_31_bytes(cpp):
    """Sources of 2**31 bytes and more (torch.empty: pages never touched but the rows used):
    rows, units and partials read from past the int32 range land where the C++ kernel reads."""
    rng = np.random.default_rng(7)
    big = torch.empty((BIG_ROWS, BIG_H), dtype=torch.bfloat16)
    assert big.numel() * big.element_size() > 2**31
    top = BIG_ROWS - 8
    big[top:] = special(rng, (8, BIG_H), torch.bfloat16, finite=True)
    big[5:8] = special(rng, (3, BIG_H), torch.bfloat16, finite=True)
    w = torch.from_numpy(rng.random(BIG_ROWS).astype(np.float32))
    # the expert side: raw rows and a partial (3 kept slots) from the last rows
    rmap = torch.tensor([[top + 1, -1, top + 3], [top, top + 2, top + 5], [-1, -1, -1],
                         [6, -1, top + 7]])
    for weighted in (True, False):
        assert same(tc.gather_rows(big, rmap, w, DEDUP, weighted),
                    cpp.gather_rows(big, rmap, w, DEDUP, weighted))
    assert same(tc.gather_rows(big, rmap[:, 2:], w, PAIRS, False),
                cpp.gather_rows(big, rmap[:, 2:], w, PAIRS, False))
    # the source side: units and a partial (whose float32 halves start at odd elements of a
    # row when read from first) past 2**31 bytes
    idx = torch.tensor([[0, 1, 4, -1], [2, 3, 1, 0], [5, -1, -1, -1]])  # E = 8, R = 2: L = 4
    smap = torch.tensor([[0, 1], [2, -1], [-1, 3]])
    first = torch.tensor([top, top + 2, top + 4, 5])
    tw = torch.from_numpy(rng.random((3, 4)).astype(np.float32))
    for weighted in (True, False):
        args = (big, smap, idx, tw, 8, 2, DEDUP, weighted, torch.float32, 1, first)
        assert same_sum(tc.reduce_tokens(*args), cpp.reduce_tokens(*args))
    psmap = torch.tensor([[top, 5, top + 7, -1], [top + 1, 6, 7, top + 2], [top + 3, -1, -1, -1]])
    args = (big, psmap, idx, tw, 8, 2, PAIRS, True, torch.bfloat16, 2, None)
    assert same_sum(tc.reduce_tokens(*args), cpp.reduce_tokens(*args))


# ---- the device path: bad entries masked, nothing raised ----------------------------------------
@pytest.fixture
def device_path(monkeypatch):
    """As on a GPU (or under EPKIT_KERNELS=triton): no host read, so no data-dependent error."""
    from epkit.triton import rowchecks

    monkeypatch.setattr(rowchecks, "on_host", lambda t: False)


def test_bad_entries_are_masked_on_the_device_path(cpp, device_path):
    """What the C++ kernel raises for, the Triton kernel skips: a slot whose row or expert is out
    of range contributes nothing, as if it were unused; a token row whose units lie outside the
    buffer writes none. Equal to the C++ result of the input with those entries removed."""
    rng = np.random.default_rng(11)
    idx, smap, back, _, E = source_side(rng, 12, 4, 3, 6, 37, torch.float32, PAIRS, False)
    w = special(rng, idx.shape, torch.float32, finite=True)
    used = np.argwhere((idx >= 0).numpy() & (smap >= 0).numpy())
    bad_idx, bad_smap = idx.clone(), smap.clone()
    (t0, k0), (t1, k1) = used[0], used[-1]
    bad_smap[t0, k0] = 10**9       # a row past back
    bad_idx[t1, k1] = E + 3        # an expert past E
    clean_idx, clean_smap = idx.clone(), smap.clone()
    clean_idx[t0, k0] = clean_idx[t1, k1] = -1
    clean_smap[t0, k0] = clean_smap[t1, k1] = -1
    for G in (1, 2):
        got = tc.reduce_tokens(back, bad_smap, bad_idx, w, E, 4, PAIRS, True, torch.float32, G)
        want = cpp.reduce_tokens(back, clean_smap, clean_idx, w, E, 4, PAIRS, True, torch.float32,
                                 G)
        assert same(got, want)
    # dedup: a token row's first past the buffer; a kept slot whose token row is not named
    idx, smap, back, first, E = source_side(rng, 12, 4, 3, 6, 37, torch.bfloat16, DEDUP, True)
    L = 3
    t, d = np.argwhere(smap.numpy() >= 0)[2]
    t2, d2 = np.argwhere(smap.numpy() >= 0)[-1]
    bad_first, bad_smap = first.clone(), smap.clone()
    bad_first[smap[t, d]] = back.shape[0] - 1 + 10**6
    bad_smap[t2, d2] = -1
    clean_idx = idx.clone()
    clean_idx[t][(idx[t] >= 0) & (idx[t] // L == d)] = -1
    clean_idx[t2][(idx[t2] >= 0) & (idx[t2] // L == d2)] = -1
    for weighted in (True, False):
        got = tc.reduce_tokens(back, bad_smap, idx, w, E, 4, DEDUP, weighted, torch.float32, 1,
                               bad_first)
        want = cpp.reduce_tokens(back, smap, clean_idx, w, E, 4, DEDUP, weighted, torch.float32,
                                 1, first)
        assert same(got, want)
    # the expert side: a recv_map entry past expert_y; a token row's units past the buffer
    rmap, y, yw = expert_side(rng, 11, 5, 40, 37, torch.bfloat16)
    n_bad = int(np.argwhere((rmap >= 0).sum(1).numpy() > 0)[0, 0])
    bad_rmap, clean_rmap = rmap.clone(), rmap.clone()
    c_bad = int(np.argwhere(rmap[n_bad].numpy() >= 0)[0, 0])
    bad_rmap[n_bad, c_bad], clean_rmap[n_bad, c_bad] = 40, -1
    assert same(tc.gather_rows(y, bad_rmap, yw, DEDUP, True),
                cpp.gather_rows(y, clean_rmap, yw, DEDUP, True))
    u = np.minimum((clean_rmap >= 0).sum(1).numpy(), 2)
    first, units = layout(u, True, rng)
    n_far = int(np.argwhere(u > 0)[-1, 0])
    far = first.clone()
    far[n_far] = units  # its units would lie past the buffer: none written, the rest intact
    gone = clean_rmap.clone()
    gone[n_far] = -1
    got, want = torch.full((units, 37), 5.0, dtype=y.dtype), torch.empty((units, 37), dtype=y.dtype)
    tc.gather_units(y, bad_rmap, yw, DEDUP, True, far, got)
    cpp.gather_units(y, gone, yw, DEDUP, True, first, want)
    assert same(got, want)
