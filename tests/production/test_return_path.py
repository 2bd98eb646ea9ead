"""dedup's return path as it travels (gather_units / reduce_tokens with ``first``), bit for bit.

The expert side writes each token row's ``u = min(n, per)`` units (its n rows of y, or its
float32 partial's bytes) straight into the exchange's send buffer at ``first[n]``; the source
reads the received buffer in place. Checked here against NumPy statements of the spec's
arithmetic (docs/semantics.md, "Combine") on every float32 bit class, for hidden sizes whose
partials start unaligned (odd H in bfloat16), gapped layouts (the fixed-chunk variants: gaps
zero), both node groupings, and against the 4H-byte form the kernels also keep (hier's).
"""

import numpy as np
import pytest
import torch

from test_row_kernels import bf16_bits, special_floats

import epkit.ops  # noqa: F401  (loads the extension)

C = torch.ops.epkit
F32 = np.float32
DEDUP = 1
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and inf rows, on purpose


def as_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


def expert_side(rng, H, dtype, N=9, K=5, M=23):
    """recv_map [N, K] (rows with 0 .. K kept slots), y [M, H], row_weight [M]."""
    rmap = np.full((N, K), -1, np.int64)
    rows = rng.permutation(M)
    at = 0
    for n in range(N):
        for c in sorted(rng.choice(K, int(rng.integers(0, K + 1)), replace=False)):
            if at < M:
                rmap[n, c], at = rows[at], at + 1
    y = torch.from_numpy(special_floats(rng, M * H).reshape(M, H)).to(dtype)
    w = rng.random(M).astype(F32)
    return rmap, y, w


def units_of(rmap: np.ndarray, per: int) -> np.ndarray:
    return np.minimum((rmap >= 0).sum(1), per)


def layout(u: np.ndarray, gaps: bool, rng) -> tuple[np.ndarray, int]:
    """first [N] (-1: no units) and the buffer's units: compact, or with random gaps."""
    first = np.full(len(u), -1, np.int64)
    at = 0
    for n, k in enumerate(u):
        at += int(rng.integers(0, 3)) if gaps else 0
        if k:
            first[n], at = at, at + k
    return first, at + (2 if gaps else 0)


def want_units(rmap, y, w, weighted, first, units) -> np.ndarray:
    """The expert side's buffer [units, H] as bytes, by the spec: raw rows, else the partial."""
    yb = as_bits(y).reshape(y.shape[0], -1)
    rb = yb.shape[1]
    per = 4 // y.element_size()
    yf = y.float().numpy()
    out = np.zeros((units, rb), np.uint8)
    for n, row in enumerate(rmap):
        kept = [m for m in row if m >= 0]
        if not kept:
            continue
        at = first[n]
        if len(kept) <= per:
            for i, m in enumerate(kept):
                out[at + i] = yb[m]
            continue
        acc = np.zeros(y.shape[1], F32)
        for m in kept:
            acc = (acc + (w[m] * yf[m] if weighted else yf[m])).astype(F32)
        out[at:at + per] = acc.view(np.uint8).reshape(per, rb)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [1, 3, 16, 37, 85, 1024])
@pytest.mark.parametrize("gaps", [False, True])
def test_gather_units_writes_the_units_in_place(dtype, H, gaps):
    rng = np.random.default_rng(H * 7 + gaps)
    rmap, y, w = expert_side(rng, H, dtype)
    per = 4 // y.element_size()
    for weighted in (True, False):
        first, units = layout(units_of(rmap, per), gaps, rng)
        got = torch.full((units, H), float("nan"), dtype=dtype)  # stale bytes: gaps get zeroed
        C.gather_units(y, torch.from_numpy(rmap), torch.from_numpy(w), DEDUP, weighted,
                       torch.from_numpy(first), got)
        np.testing.assert_array_equal(as_bits(got).reshape(units, -1),
                                      want_units(rmap, y, w, weighted, first, units))
        # the 4H-byte form holds the same units at n * per
        old = as_bits(C.gather_rows(y, torch.from_numpy(rmap), torch.from_numpy(w), DEDUP,
                                    weighted)).reshape(len(rmap) * per, -1)
        new = as_bits(got).reshape(units, -1)
        for n, k in enumerate(units_of(rmap, per)):
            np.testing.assert_array_equal(old[n * per:n * per + k], new[first[n]:first[n] + k])


def source_side(rng, H, dtype, T=9, R=4, L=3, K=6):
    """The kept routing [T, K], send_map [T, R] and the received units with first, built by
    the spec's rule from random rows (raw rows in y's dtype, partials as float32 bits)."""
    E = R * L
    idx = np.full((T, K), -1, np.int64)
    for t in range(T):
        k = int(rng.integers(1, K + 1))
        idx[t, :k] = rng.choice(E, k, replace=False)
        rng.shuffle(idx[t])
    idx[0] = -1
    idx[0, [1, 3, 4]] = [2, 0, 1]  # three slots on rank 0: a partial in either dtype
    per = 4 // torch.tensor([], dtype=dtype).element_size()
    send_map = np.full((T, R), -1, np.int64)
    n_of = []
    for t in range(T):
        for d in range(R):
            n = int(((idx[t] >= 0) & (idx[t] // L == d)).sum())
            if n:
                send_map[t, d] = len(n_of)
                n_of.append(n)
    assert max(n_of) > per  # some token rows come back as partials
    u = np.minimum(np.array(n_of), per)
    first, units = layout(u, True, rng)
    back = torch.from_numpy(special_floats(rng, units * H).reshape(units, H)).to(dtype)
    return idx, send_map, back, first, E, R, L


def want_reduce(idx, send_map, back, first, w, weighted, L, G, out_dtype) -> np.ndarray:
    per = 4 // back.element_size()
    bf = back.float().numpy()
    raw = as_bits(back).reshape(back.shape[0], -1)
    T, H = idx.shape[0], back.shape[1]
    out = np.zeros((T, H), F32)
    for t in range(T):
        total, node, open_node = np.zeros(H, F32), np.zeros(H, F32), -1
        for d in range(send_map.shape[1]):
            ks = [k for k in range(idx.shape[1]) if idx[t, k] >= 0 and idx[t, k] // L == d]
            if not ks:
                continue
            at = first[send_map[t, d]]
            if len(ks) > per:
                part = raw[at:at + per].reshape(-1).view(F32).copy()
            else:
                part = np.zeros(H, F32)
                for i, k in enumerate(ks):
                    part = (part + (w[t, k] * bf[at + i] if weighted else bf[at + i])).astype(F32)
            if G == 1:
                total = (total + part).astype(F32)
                continue
            if d // G != open_node:
                if open_node >= 0:
                    total = (total + node).astype(F32)
                node, open_node = np.zeros(H, F32), d // G
            node = (node + part).astype(F32)
        if open_node >= 0:
            total = (total + node).astype(F32)
        out[t] = total
    return bf16_bits(out) if out_dtype == torch.bfloat16 else out.view(np.uint32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [1, 3, 16, 37, 85, 1024])
@pytest.mark.parametrize("G", [1, 2])
def test_reduce_tokens_reads_the_units_in_place(dtype, H, G):
    rng = np.random.default_rng(H * 3 + G)
    idx, send_map, back, first, E, R, L = source_side(rng, H, dtype)
    w = rng.random(idx.shape).astype(F32)
    for weighted in (True, False):
        got = C.reduce_tokens(back, torch.from_numpy(send_map), torch.from_numpy(idx),
                              torch.from_numpy(w), E, R, DEDUP, weighted, dtype, G,
                              torch.from_numpy(first))
        bits = got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy()
        want = want_reduce(idx, send_map, back, first, w, weighted, L, G, dtype)
        np.testing.assert_array_equal(bits.view(want.dtype), want)


def test_bad_unit_places_are_refused():
    rng = np.random.default_rng(0)
    rmap, y, w = expert_side(rng, 8, torch.bfloat16)
    first, units = layout(units_of(rmap, 2), False, rng)
    rm, wt = torch.from_numpy(rmap), torch.from_numpy(w)
    out = torch.empty((units - 1, 8), dtype=y.dtype)
    with pytest.raises(RuntimeError, match="first"):  # a unit past the buffer
        C.gather_units(y, rm, wt, DEDUP, True, torch.from_numpy(first), out)
    with pytest.raises(RuntimeError, match="pairs"):  # pairs places a row per row
        C.gather_units(y, rm[:, :1], wt, 0, True, torch.from_numpy(first), out)
    with pytest.raises(RuntimeError, match="out must be torch.bfloat16"):  # out in another dtype
        C.gather_units(y, rm, wt, DEDUP, True, torch.from_numpy(first),
                       torch.empty((units, 8)))
    with pytest.raises(RuntimeError, match="first"):  # dedup needs its places
        C.gather_units(y, rm, wt, DEDUP, True, None, torch.empty((units, 8), dtype=y.dtype))
    idx, send_map, back, first, E, R, L = source_side(rng, 8, torch.bfloat16)
    bad = first.copy()
    bad[bad >= 0] = back.shape[0]  # past the buffer
    with pytest.raises(RuntimeError, match="first"):
        C.reduce_tokens(back, torch.from_numpy(send_map), torch.from_numpy(idx),
                        torch.zeros(idx.shape), E, R, DEDUP, False, torch.bfloat16, 1,
                        torch.from_numpy(bad))
