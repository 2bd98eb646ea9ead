"""epkit.triton.places (the return path's places, one program per chunk and side, both sides in
one launch) against a NumPy statement of the rule, and its written maps against the ops they
stand in for: the units map against dedup's torch form, the weight gradients' values against
the C++ gather_slot_values.

The rule: chunk p's rows (static: 1 + cap rows each; else the plan's row counts) are walked in
order; a row's first unit is the chunk's start (FIXED: p * chunk + hdr; BOUNDED: the earlier
chunks' min(slots, ucap * rows) summed; COMPACT: the earlier chunks' plan sizes summed) plus the
units of the chunk's earlier rows; a row without units has -1."""

import numpy as np
import pytest
import torch

from epkit.reference import abi
from epkit.triton import dedup, places

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def make_plan(R, E, rows, slots, cap=-1):
    """A plan with the words the places read: row counts and slot counts on both sides."""
    p = torch.zeros(abi.plan_size(R, E), dtype=torch.int64)
    sl = abi.plan_slices(R, E)
    for side in ("send", "recv"):
        p[sl[f"{side}_counts"]] = torch.tensor(rows)
        p[sl[f"{side}_slots"]] = torch.tensor(slots)
    p[abi.PLAN_FIELDS.index("static_cap")] = cap
    return p, sl


def sides(rm, plan, sl, R, S, **kw):
    """places.sides over the test plan's words (make_plan: the same counts on both sides)."""
    return places.sides(rm, plan, R, recv_counts_off=sl["recv_counts"].start,
                        recv_sizes_off=sl["recv_slots"].start,
                        send_counts_off=sl["send_counts"].start,
                        send_sizes_off=sl["send_slots"].start, S=S, **kw)


def oracle(u, R, row_lo, row_hi, start):
    """first [N] by the rule: start[p] plus the units of chunk p's earlier rows."""
    first = np.full(len(u), -1, np.int64)
    for p in range(R):
        at = start[p]
        for n in range(row_lo[p], row_hi[p]):
            if u[n] > 0:
                first[n] = at
            at += u[n]
    return first


def recv_map_of(rng, N, C, M):
    """Rows with 0 .. C kept entries (>= 0), -1 elsewhere, each entry a distinct row of M."""
    rm = np.full((N, C), -1, np.int64)
    rows = rng.permutation(M)
    used = 0
    for n in range(N):
        k = int(rng.integers(0, C + 1))
        k = min(k, M - used)
        rm[n, rng.choice(C, k, replace=False)] = rows[used:used + k]
        used += k
    return torch.from_numpy(rm)


@pytest.mark.parametrize("mode", ["fixed-static", "fixed", "bounded", "compact"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_places_follow_the_rule(mode, seed):
    rng = np.random.default_rng(seed)
    R, E, C, per = 3, 6, 4, 2
    static = mode == "fixed-static"
    cap = 5 if static else -1
    rows = [int(rng.integers(0, 6)) for _ in range(R)]
    N = R * (1 + cap) if static else sum(rows)
    rm = recv_map_of(rng, N, C, 64)
    if static:  # a static chunk's header row names nothing
        rm[torch.arange(R) * (1 + cap)] = -1
    u = np.minimum((rm.numpy() >= 0).sum(1), per)
    lo = [p * (1 + cap) for p in range(R)] if static else list(np.cumsum([0] + rows[:-1]))
    hi = [lo[p] + (1 + cap) for p in range(R)] if static else [lo[p] + rows[p] for p in range(R)]
    tot = [int(u[lo[p]:hi[p]].sum()) for p in range(R)]
    slots = [t + int(rng.integers(0, 3)) for t in tot]  # a bound at least the exact units
    plan, sl = make_plan(R, E, rows, slots, cap)
    kw = dict(ucap=per, static_cap=cap)
    if mode.startswith("fixed"):
        chunk, hdr = 2 + max(tot) + 1, 1
        kw.update(mode=places.FIXED, chunk=chunk, hdr=hdr)
        start = [p * chunk + hdr for p in range(R)]
    elif mode == "bounded":
        kw.update(mode=places.BOUNDED)
        b = [min(s, per * r) for s, r in zip(slots, rows)]
        start = list(np.cumsum([0] + b[:-1]))
    else:
        kw.update(mode=places.COMPACT)
        start = list(np.cumsum([0] + slots[:-1]))
    first, _, first_src = sides(rm, plan, sl, R, N, **kw)
    assert first.tolist() == oracle(u, R, lo, hi, start).tolist()
    # the source side (pairs): one unit a data row, a static chunk's header row and unused
    # tail none
    dense = np.zeros(N, np.int64)
    for p in range(R):
        data = lo[p] + (1 if static else 0)
        dense[data:data + rows[p]] = 1
    assert first_src.tolist() == oracle(dense, R, lo, hi, start).tolist()


def test_units_map_is_dedups(cpp):
    """With the units map, the whole buffer is dedup's map for those places (its torch form),
    header and tails -1; gather_units from it equals the C++ op's."""
    rng = np.random.default_rng(5)
    R, E, C, per, M = 3, 6, 4, 2, 40
    rows = [3, 0, 4]
    rm = recv_map_of(rng, sum(rows), C, M)
    plan, sl = make_plan(R, E, rows, [8, 0, 8])
    chunk, hdr = 9, 1
    U = R * chunk
    first, umap, _ = sides(rm, plan, sl, R, sum(rows), ucap=per, mode=places.FIXED,
                           chunk=chunk, hdr=hdr, umap_units=U, per=per, M=M)
    want, _, _ = dedup._unit_map(rm, M, per, first, U)
    assert umap.tolist() == want.tolist()
    y = torch.randn(M, 16).to(torch.bfloat16)
    w = torch.rand(M)
    got = torch.empty((U, 16), dtype=torch.bfloat16)
    from epkit.triton import combine

    combine.units(y, umap, rm, w, True, True, got)
    ref = torch.empty_like(got)
    cpp.gather_units(y, rm, w, abi.TRANSPORT_CODES["dedup"], True, first, ref)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_slot_values_are_gather_slot_values(cpp):
    rng = np.random.default_rng(7)
    R, E, C, M = 2, 4, 3, 30
    rows = [5, 4]
    rm = recv_map_of(rng, sum(rows), C, M)
    n = (rm.numpy() >= 0).sum(1)
    slots = [int(n[:5].sum()), int(n[5:].sum())]
    plan, sl = make_plan(R, E, rows, slots)
    values = torch.randn(M)
    B = sum(slots)
    first, got, _ = sides(rm, plan, sl, R, sum(rows), ucap=1 << 40, mode=places.COMPACT,
                          umap_units=B, slot_values=values)
    want = cpp.gather_slot_values(values, rm, first, B)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("static", [False, True])
def test_token_places_follow_the_rule(static):
    """dedup's source side: a token row's units its kept slots on the chunk's rank (at most
    ucap), rows in token order within each chunk; a static chunk's unnamed rows -1."""
    rng = np.random.default_rng(3)
    T, K, R, E = 10, 3, 3, 9
    L = E // R
    idx = torch.from_numpy(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]))
    idx[2, 1] = -1
    cap = T if static else -1
    d = np.where(idx.numpy() >= 0, idx.numpy() // L, -1)
    has = np.stack([(d == p).any(1) for p in range(R)], 1)  # [T, R]: a row to rank p
    rows = has.sum(0).tolist()
    smap = torch.full((T, R), -1, dtype=torch.int64)
    lo = [p * (1 + cap) + 1 for p in range(R)] if static else list(np.cumsum([0] + rows[:-1]))
    for p in range(R):
        ts = np.flatnonzero(has[:, p])
        smap[ts, p] = torch.from_numpy(lo[p] + np.arange(len(ts)))
    S = R * (1 + cap) if static else sum(rows)
    n = np.stack([(d == p).sum(1) for p in range(R)], 1)
    ucap = 2
    chunk = 1 + 2 * T
    plan, sl = make_plan(R, E, rows, [0] * R, cap)
    none = torch.full((S, 1), -1, dtype=torch.int64)  # the expert side: rows without units
    _, _, first = sides(none, plan, sl, R, S, ucap=ucap, mode=places.FIXED, static_cap=cap,
                        chunk=chunk, hdr=1, send_map=smap, idx=idx, E=E)
    want = np.full(S, -1, np.int64)
    for p in range(R):
        at = p * chunk + 1
        for t in range(T):
            if has[t, p]:
                want[int(smap[t, p])] = at
                at += min(int(n[t, p]), ucap)
    assert first.tolist() == want.tolist()
