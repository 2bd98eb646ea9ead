"""The CUDA kernels' index passes, transcribed to Python step for step (warp lanes as a loop).

csrc/cuda/pack.cu and unpack.cu find every row by chunked counting sorts (a warp walks a chunk
in order, lanes over k ranked like __match_any_sync, a column scan over chunks), closed forms
and prefix sums, not by the CPU kernels' serial cursors. These transcriptions let a machine
without a GPU check that arithmetic against the CPU kernels' send_map / recv_map
(test_index_emulation.py); the GPU tests check the kernels themselves. Keep them in step with
the .cu files: same chunk sizes, same formulas.
"""

from __future__ import annotations

import numpy as np

from epkit import ops
from epkit.reference import abi

PACK_CHUNK, UNPACK_CHUNK, WARP = 32, 64, 32  # pack.cu kChunk, unpack.cu kChunk, kWarp


def _warp_ranks(keys, counters, valid):
    """One warp step: each valid lane's rank = counter[key] + earlier lanes with its key;
    then every key's counter grows by its lane count (pack/unpack rank_kernel)."""
    ranks = [None] * len(keys)
    for lane, key in enumerate(keys):
        if valid[lane]:
            ranks[lane] = counters[key] + sum(
                1 for l2 in range(lane) if valid[l2] and keys[l2] == key)
    for key in {k for k, v in zip(keys, valid) if v}:
        counters[key] += sum(1 for k, v in zip(keys, valid) if v and k == key)
    return ranks


def _exclusive(a, axis=0):
    return np.cumsum(a, axis) - a


def local_experts_bound(n: int) -> int:
    """unpack.cu local_experts_bound: the host's bound on L from the plan's length n alone,
    n - (PLAN_HEADER - 8) = (2R + 3)(L + 3); the largest L of any R >= 1 (smallest odd divisor
    d >= 5)."""
    m = n - (abi.PLAN_HEADER - 8)
    d = 5
    while d * 4 <= m:
        if m % d == 0:
            return m // d - 3
        d += 2
    return 1


def pack_send_map(idx: np.ndarray, plan: np.ndarray, R: int, E: int, pairs: bool) -> np.ndarray:
    """pack.cu's send_map: rank_kernel, scan_columns, (dedup_index_kernel, scans), then
    pairs_kernel / dedup_kernel's row formulas."""
    T, K = idx.shape
    L, sl = E // R, ops.plan_slices(R, E)
    own = plan[sl["own_kept"]]
    chunks = -(-T // PACK_CHUNK)
    lrank = np.full((T, K), -1)
    ccount = np.zeros((chunks, E), np.int64)
    for c in range(chunks):
        cnt = np.zeros(E, np.int64)
        for t in range(c * PACK_CHUNK, min(T, (c + 1) * PACK_CHUNK)):
            for kb in range(0, K, WARP):
                ks = [kb + lane for lane in range(WARP)]
                es = [int(idx[t, k]) if k < K else -1 for k in ks]
                for k, r in zip(ks, _warp_ranks(es, cnt, [0 <= e < E for e in es])):
                    if r is not None:
                        lrank[t, k] = r
        ccount[c] = cnt
    ebase = _exclusive(ccount)
    start = np.concatenate([[0], np.cumsum(own)])
    row_start = np.concatenate([[0], np.cumsum(plan[sl["send_counts"]])])
    cap = int(plan[ops.STATIC_CAP])

    def row_of(d, i):
        return d * (1 + cap) + 1 + i if cap >= 0 else row_start[d] + i

    def kept(t, k, e):
        return ebase[t // PACK_CHUNK, e] + lrank[t, k] < own[e]

    if pairs:
        sm = np.full((T, K), -1)
        for t in range(T):
            for k in range(K):
                e = int(idx[t, k])
                if 0 <= e < E and kept(t, k, e):
                    d = e // L
                    sm[t, k] = row_of(d, start[e] - start[d * L] + ebase[t // PACK_CHUNK, e]
                                      + lrank[t, k])
        return sm
    tok_local = np.full((T, R), -1)
    ctok = np.zeros((chunks, R), np.int64)
    for c in range(chunks):
        tokc, stamp = np.zeros(R, np.int64), np.full(R, -1)
        for t in range(c * PACK_CHUNK, min(T, (c + 1) * PACK_CHUNK)):
            for kb in range(0, K, WARP):
                ks = [kb + lane for lane in range(WARP) if kb + lane < K]
                # one leader lane per d with a kept slot in this pass: t's first kept slot on d
                # opens its token row
                kept_ds = {int(idx[t, k]) // L for k in ks
                           if 0 <= idx[t, k] < E and kept(t, k, int(idx[t, k]))}
                for d in sorted(kept_ds):
                    if stamp[d] != t:
                        tok_local[t, d], stamp[d] = tokc[d], t
                        tokc[d] += 1
        ctok[c] = tokc
    tok_base = _exclusive(ctok)
    sm = np.full((T, R), -1)
    for t, d in zip(*np.nonzero(tok_local >= 0)):
        sm[t, d] = row_of(d, tok_base[t // PACK_CHUNK, d] + tok_local[t, d])
    return sm


def unpack_recv_map(recv: np.ndarray, plan: np.ndarray, K: int, P: int, pairs: bool
                    ) -> np.ndarray:
    """unpack.cu's recv_map: row_info, pairs_kernel's closed form; dedup: nrow_kernel, the
    exclusive prefix G, rank_kernel over chunks of rows, scan_columns, dedup_kernel's m."""
    R, E, L = (int(plan[i]) for i in (ops.RANKS, ops.EXPERTS, ops.LOCAL_EXPERTS))
    sl = ops.plan_slices(R, E)
    B = P + (16 if pairs else 8)
    N = int(plan[ops.RECV_ROWS])
    counts = plan[sl["recv_counts"]]
    rchunk = np.concatenate([[0], np.cumsum(plan[sl["recv_bytes"]])])
    rrow = np.concatenate([[0], np.cumsum(counts)])
    cap, tokcap = int(plan[ops.STATIC_CAP]), int(plan[ops.TOK_CAP])
    offsets = plan[sl["offsets"]]

    def i32(at):
        return int(recv[at: at + 4].view(np.int32)[0])

    def row_info(r):
        if cap >= 0:
            s, i = r // (1 + cap), r % (1 + cap) - 1
            return s < R and 0 <= i < counts[s], s, i
        s = int(np.searchsorted(rrow, r, side="right")) - 1
        return 0 <= s < R, s, r - rrow[s]

    def row_bytes(s, i):
        return rchunk[s] + (i + (1 if cap >= 0 else 0)) * B

    rm = np.full((N, 1 if pairs else K), -1)
    if pairs:
        kept = plan[sl["recv_kept"]].reshape(R, L)
        blk = np.concatenate([np.zeros((R, 1), np.int64), np.cumsum(kept, 1)], 1)
        exp_base = offsets[:L][None, :] + _exclusive(kept)
        for r in range(N):
            ok, s, i = row_info(r)
            if ok and i < blk[s, L]:
                j = int(np.searchsorted(blk[s], i, side="right")) - 1
                rm[r, 0] = exp_base[s, j] + i - blk[s, j]
        return rm
    nrow = np.zeros(N, np.int64)
    for r in range(N):
        ok, s, i = row_info(r)
        if ok:
            nrow[r] = min(max(i32(row_bytes(s, i) + P + 4), 0), K)
    G = _exclusive(nrow)
    Gi = np.cumsum(nrow)
    for s in range(R):  # slot_count_kernel: in-band slots per source (else: status 2)
        first = s * (1 + cap) + 1 if cap >= 0 else rrow[s]
        got = Gi[first + counts[s] - 1] - G[first] if counts[s] > 0 else 0
        assert got == plan[sl["recv_slots"]][s], ("slot count", s)

    def slot_rows(s, r):
        tok_rows = tokcap if tokcap >= 0 else counts[s]
        first = s * (1 + cap) if cap >= 0 else rrow[s]
        return rchunk[s] + tok_rows * B + (8 if cap >= 0 else 0) + (G[r] - G[first]) * 8

    chunks = -(-N // UNPACK_CHUNK)
    Lb = local_experts_bound(len(plan))
    assert 1 <= L <= Lb, (L, Lb)
    # jbase: flat, stride L (the device word), rows 0..chunks; block `chunks` walks no row, so
    # row `chunks` of the scan holds each expert's total. Scratch: (chunks + 1) * Lb words.
    jflat = np.zeros((chunks + 1) * Lb, np.int64)
    lrank = {}
    for c in range(chunks):
        cnt = np.zeros(L, np.int64)
        for r in range(c * UNPACK_CHUNK, min(N, (c + 1) * UNPACK_CHUNK)):
            ok, s, _ = row_info(r)
            if not ok:
                continue
            base = slot_rows(s, r)
            for qb in range(0, nrow[r], WARP):
                qs = [qb + lane for lane in range(WARP)]
                js = [i32(base + q * 8) & 0xFFFFFF if q < nrow[r] else -1 for q in qs]
                for q, rank in zip(qs, _warp_ranks(js, cnt, [j >= 0 for j in js])):
                    if rank is not None:
                        lrank[G[r] + q] = rank
        jflat[c * L: (c + 1) * L] = cnt
    # scan_columns over chunks + 1 rows, L columns of stride L
    col = jflat[: (chunks + 1) * L].reshape(chunks + 1, L)
    jflat[: (chunks + 1) * L] = _exclusive(col).reshape(-1)

    def jbase(c, j):
        return jflat[c * L + j]

    # expert_total_kernel: the slots received for j against the plan (else: status 64)
    tpe = plan[sl["tokens_per_expert"]]
    assert all(jbase(chunks, j) == tpe[j] for j in range(L)), "expert totals != plan"
    for r in range(N):
        ok, s, _ = row_info(r)
        if not ok:
            continue
        base = slot_rows(s, r)
        for q in range(nrow[r]):
            packed = i32(base + q * 8)
            k, j = (packed & 0xFFFFFFFF) >> 24, packed & 0xFFFFFF  # k: unsigned top byte
            rank = jbase(r // UNPACK_CHUNK, j) + lrank[G[r] + q]
            assert 0 <= rank < tpe[j]  # dedup_kernel's bound (else: status 16)
            rm[r, k] = offsets[j] + rank
    return rm
