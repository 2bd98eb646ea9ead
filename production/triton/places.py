"""The return path's places in one launch: where each row's units go in a chunked buffer.

combine, the dispatch backward and the weight gradients' return path send, for each row of the
dispatch's row space (the received rows on the expert side, the sent rows on the source side),
``u`` units (dedup: ``min(n, per)`` of a token row's n kept slots; the weight gradients: one
float32 per kept slot) along the exchange's chunks, one chunk per peer. A row's first unit lies
at its chunk's start (after the chunk's header rows) plus the units of the chunk's rows before
it, in row order; a row without units has place -1. As torch ops that is a dozen launches (an
index_add, two cumsums, gathers; production/moves.py ``_unit_positions`` is the torch form,
which the C++ path runs); here it is one program per chunk and side, both sides in one launch
(grid ``(2 R,)``: the expert side's chunks, then the source side's): the chunk's rows and its
start come from the plan (the row counts, and the chunk sizes: fixed, or each peer's bounded or
exact count), and the program scans its rows in blocks (integer ``tl.cumsum``, order-free).
Programs write disjoint places, and read nothing another writes.

With ``UMAP`` (dedup's expert side of combine) the same launch writes the units kernel's map
(``combine._units_kernel``: unit -> y's row, or a float32 partial's part, or -1 for zeros) for
every unit of the chunk, the header rows and the unused tail included, so no fill runs first.
"""

from __future__ import annotations

import torch

from ._runtime import INTERPRETED, launch, tl, triton

__all__ = ["FIXED", "BOUNDED", "COMPACT", "MAP", "VALUES", "DENSE", "sides"]

FIXED, BOUNDED, COMPACT = 0, 1, 2  # how chunk p's start is found (the module docstring)
MAP, VALUES, DENSE = 0, 1, 2  # what gives a row's units: a map's entries, counts, one a row
VALUES_C, DENSE_C = tl.constexpr(VALUES), tl.constexpr(DENSE)
# rows a program scans at a time (on a GPU 64: at 128 and up the units map's variant spilled
# registers on sm_90 and scalar registers on gfx942, epkit kernels --compile)
BLOCK = 256 if INTERPRETED else 64


@triton.jit
def _chunk(plan, p, N, R, rows_off, sizes_off, cap, chunk, hdr, UCAP, MODE: tl.constexpr,
           STATIC: tl.constexpr, RP: tl.constexpr):
    """Chunk p's rows [lo, hi) in the row space (STATIC: 1 + cap rows each; else the plan's row
    counts at rows_off, prefix-summed) and its units [start, start + size) after its hdr
    header units (FIXED: chunk units each; BOUNDED: min(plan[sizes_off + q], UCAP * rows of
    q); COMPACT: plan[sizes_off + q])."""
    q = tl.arange(0, RP)
    qm = q < R
    rows_q = tl.load(plan + rows_off + q, mask=qm, other=0)
    if STATIC:
        lo = p * (1 + cap)
        hi = tl.minimum(lo + 1 + cap, N)
    else:
        lo = tl.sum(tl.where(q < p, rows_q, 0), axis=0)
        hi = lo + tl.sum(tl.where(q == p, rows_q, 0), axis=0)
    if MODE == 0:
        start = p * chunk + hdr
        size = chunk - hdr
    else:
        sz = tl.load(plan + sizes_off + q, mask=qm, other=0)
        if MODE == 1:
            sz = tl.minimum(sz, UCAP * rows_q)
        start = tl.sum(tl.where(q < p, sz, 0), axis=0)
        size = tl.sum(tl.where(q == p, sz, 0), axis=0)
    # row and unit indices fit 32 bits (element indices, never byte offsets): half the scalar
    # registers, which gfx942 spilled at 64 bits
    return lo.to(tl.int32), hi.to(tl.int32), start.to(tl.int32), size.to(tl.int32)


@triton.jit
def _row_units(p, src, first, umap, vals, plan, N, C, M, UCAP, R, rows_off, sizes_off, cap, chunk,
               hdr, U, MODE: tl.constexpr, STATIC: tl.constexpr, VALUES: tl.constexpr,
               UMAP: tl.constexpr, SLOTS: tl.constexpr, PER: tl.constexpr, CP: tl.constexpr,
               RP: tl.constexpr, BLOCK: tl.constexpr):
    """first [N] int64: row n's first unit (-1: none), for chunk p's rows: [p (1 + cap),
    (p + 1)(1 + cap)) (STATIC) or the plan's row counts at rows_off, prefix-summed.
    Units of row n: VALUES 1, src[n] (a count); VALUES 2 (DENSE), one for each of the chunk's
    data rows (a static chunk's first row is its header, and its rows past the plan's count
    unused); else the entries >= 0 of src [N, C]; at most UCAP. Chunk p starts at p * chunk +
    hdr (FIXED), at the sum of the earlier chunks' sizes (BOUNDED: min(plan[sizes_off + q],
    UCAP * rows of q); COMPACT: plan[sizes_off + q]). With UMAP or SLOTS, umap [U] (int64, or
    int32 bits of float32) is written whole over the chunk: the units kernel's map, or the
    weight gradients' values vals [M] (gather_slot_values: row n's entries that are not -1, c
    ascending, at first[n], first[n] + 1, ...; those naming no row of vals 0), the chunk's
    other units -1 or 0."""
    lo, hi, start, size = _chunk(plan, p, N, R, rows_off, sizes_off, cap, chunk, hdr, UCAP,
                                 MODE, STATIC, RP)
    cs = tl.arange(0, CP)
    js = tl.arange(0, PER)
    carry = start * 0
    for b in range(lo, hi, BLOCK):
        n = b + tl.arange(0, BLOCK)
        m = n < hi
        if VALUES == VALUES_C:
            u = tl.load(src + n, mask=m, other=0)
        elif VALUES == DENSE_C:  # one unit a data row one unit a data row (past a static chunk's header row)
            if STATIC:
                used = tl.load(plan + rows_off + p)
                u = ((n > lo) & (n <= lo + used) & m).to(tl.int64)
            else:
                u = m.to(tl.int64)
        else:
            tile = tl.load(src + n[:, None] * C + cs[None, :], mask=m[:, None] & (cs < C)[None, :],
                           other=-1)
            u = tl.sum((tile >= 0).to(tl.int64), axis=1)
        u = tl.minimum(u, UCAP)
        pos = tl.where(u > 0, start + carry + tl.cumsum(u, axis=0) - u, -1)
        tl.store(first + n, pos, mask=m)
        carry += tl.sum(u, axis=0).to(tl.int32)
        if UMAP:  # the units kernel's map for these rows' units (combine._units_kernel)
            kept = (tile >= 0) & (tile < M)
            cnt = tl.sum(kept.to(tl.int64), axis=1)
            un = tl.minimum(cnt, PER)
            fits = (un == 0) | ((pos >= 0) & (pos + un <= U))
            raw = kept & ((cnt <= PER) & fits & m)[:, None]
            at = pos[:, None] + tl.cumsum(kept.to(tl.int64), axis=1) - 1
            tl.store(umap + at, tile, mask=raw)
            part = (cnt > PER) & fits & m
            code = -2 - (n[:, None] * PER + js[None, :])
            tl.store(umap + pos[:, None] + js[None, :], code, mask=part[:, None])
            # units counted by u but not written above (entries >= M, a row that does not
            # fit): zeros, as the torch form leaves them
            rest = m[:, None] & (js[None, :] < u[:, None]) & ~(
                (js[None, :] < un[:, None]) & (fits & (un > 0))[:, None])
            tl.store(umap + pos[:, None] + js[None, :], -1, mask=rest)
        if SLOTS:  # the weight gradients' values of these rows (gather_slot_values)
            named = (tile != -1) & m[:, None]
            at = pos[:, None] + tl.cumsum(named.to(tl.int64), axis=1) - 1
            inb = named & (at >= 0) & (at < U)
            good = inb & (tile >= 0) & (tile < M)
            tl.store(umap + at, tl.load(vals + tile, mask=good, other=0), mask=inb)
    if UMAP or SLOTS:  # the chunk's header rows and its unused tail: zeros
        if UMAP:
            fill = -1
        else:
            fill = 0
        end = start + size  # one loop over the chunk (two spilled registers on sm_90)
        for b in range(start - hdr, end, BLOCK):  # (the rows' units in between are written)
            x = b + tl.arange(0, BLOCK)
            tl.store(umap + x, fill, mask=(x < end) & ((x < start) | (x >= start + carry)))


@triton.jit
def _token_units(p, send_map, idx, first, plan, T, K, E, L, S, UCAP, R, rows_off, sizes_off, cap,
                 chunk, hdr, MODE: tl.constexpr, STATIC: tl.constexpr, KP: tl.constexpr,
                 RP: tl.constexpr, BLOCK: tl.constexpr):
    """dedup's source side, chunk p: first [S] int64 for the send rows, the token rows
    send_map [T, R] names, in token order within each chunk (pack's order): a row's units are
    its token's kept slots on the chunk's rank (idx [T, K], the kept routing), at most UCAP.
    Rows of a static chunk that no token names (its header row, its unused tail) get -1."""
    lo, hi, start, size = _chunk(plan, p, S, R, rows_off, sizes_off, cap, chunk, hdr, UCAP,
                                 MODE, STATIC, RP)
    ks = tl.arange(0, KP)
    carry = start * 0
    used = start * 0
    for b in range(0, T, BLOCK):
        t = b + tl.arange(0, BLOCK).to(tl.int64)
        m = t < T
        e = tl.load(idx + t[:, None] * K + ks[None, :], mask=m[:, None] & (ks < K)[None, :],
                    other=-1).to(tl.int64)
        n = tl.sum(((e >= 0) & (e // L == p)).to(tl.int64), axis=1)
        r = tl.load(send_map + t * R + p, mask=m, other=-1)
        named = m & (r >= 0) & (r < S)
        u = tl.where(named, tl.minimum(n, UCAP), 0)
        pos = tl.where(u > 0, start + carry + tl.cumsum(u, axis=0) - u, -1)
        tl.store(first + r, pos, mask=named)
        carry += tl.sum(u, axis=0).to(tl.int32)
        used += tl.sum(named.to(tl.int32), axis=0)
    if STATIC:  # the rows no token names: the header row, and the tail past the used rows
        for b in range(lo, hi, BLOCK):
            x = b + tl.arange(0, BLOCK).to(tl.int64)
            tl.store(first + x, -1, mask=(x < hi) & ((x == lo) | (x > lo + used)))


@triton.jit
def _sides_kernel(src, first, umap, vals, plan, N, C, M, U, rows_off, sizes_off,
                  send_map, idx, first_src, S, T, K, E, L, src_rows_off, src_sizes_off,
                  UCAP, R, cap, chunk, hdr, MODE: tl.constexpr, STATIC: tl.constexpr,
                  VALUES: tl.constexpr, UMAP: tl.constexpr, SLOTS: tl.constexpr,
                  PER: tl.constexpr, CP: tl.constexpr, TOKENS: tl.constexpr, KP: tl.constexpr,
                  RP: tl.constexpr, BLOCK: tl.constexpr):
    """Both sides of an exchange, grid (2 R,): program p < R is the expert side's chunk p
    (:func:`_row_units` over src [N, C]: first, and umap with UMAP or SLOTS); program R + p the
    source side's chunk p, first_src [S]: dedup's token rows (TOKENS: :func:`_token_units` over
    send_map [T, R] and idx [T, K]), else one unit a data row (pairs: DENSE). The two sides
    write disjoint outputs and read only their inputs and the plan."""
    p = tl.program_id(0).to(tl.int64)
    if p < R:
        _row_units(p, src, first, umap, vals, plan, N, C, M, UCAP, R, rows_off, sizes_off, cap,
                   chunk, hdr, U, MODE, STATIC, VALUES, UMAP, SLOTS, PER, CP, RP, BLOCK)
    else:
        if TOKENS:
            _token_units(p - R, send_map, idx, first_src, plan, T, K, E, L, S, UCAP, R,
                         src_rows_off, src_sizes_off, cap, chunk, hdr, MODE, STATIC, KP, RP,
                         BLOCK)
        else:
            _row_units(p - R, plan, first_src, first_src, first_src, plan, S, 1, 0, UCAP, R,
                       src_rows_off, src_sizes_off, cap, chunk, hdr, 0, MODE, STATIC, DENSE_C,
                       False, False, 1, 2, RP, BLOCK)


def sides(recv_map: torch.Tensor, plan: torch.Tensor, R: int, *, ucap: int, mode: int,
          recv_counts_off: int, recv_sizes_off: int, send_counts_off: int, send_sizes_off: int,
          S: int, static_cap: int = -1, chunk: int = 0, hdr: int = 0, umap_units: int = -1,
          per: int = 1, M: int = 0, slot_values: torch.Tensor | None = None,
          send_map: torch.Tensor | None = None, idx: torch.Tensor | None = None, E: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(first [N] int64, umap [U] or None, first_src [S] int64)`` in one launch: the first
    unit of each received row (its units ``recv_map [N, C]``'s entries >= 0, at most ``ucap``)
    and of each of the S sent rows (dedup, ``send_map [T, R]`` and ``idx [T, K]`` given: its
    token's kept slots, of the ``E`` experts, on the row's rank; pairs: one a data row). ``plan``: the device plan
    (row counts at ``*_counts_off``, chunk sizes at ``*_sizes_off``); ``static_cap >= 0``:
    static chunks of ``1 + static_cap`` rows, ``chunk`` units each after ``hdr`` (``mode``
    FIXED), else BOUNDED or COMPACT. ``umap_units >= 0``: also the units kernel's map over
    that many units (dedup's expert side, ``per`` units a token row at most, naming rows of
    y's ``M``); with ``slot_values [M] float32`` instead, the weight gradients' values laid
    out along the places (``backward.gather_slot_values``'s result)."""
    recv_map = recv_map.contiguous()
    N, C = recv_map.shape
    dev = recv_map.device
    first = torch.empty(N, dtype=torch.int64, device=dev)
    first_src = torch.empty(S, dtype=torch.int64, device=dev)
    U = max(umap_units, 0)
    slots = slot_values is not None
    umap = (torch.empty(U, dtype=torch.float32 if slots else torch.int64, device=dev)
            if umap_units >= 0 else None)
    if slots:
        M = slot_values.numel()
        out, vals = umap.view(torch.int32), slot_values.contiguous().view(torch.int32)
    else:
        out = vals = umap if umap is not None else first
    tokens = send_map is not None
    if tokens:
        send_map, idx = send_map.contiguous(), idx.contiguous()
        T, K = idx.shape
    else:
        send_map = idx = plan  # (unread: DENSE)
        T, K, E = 0, 1, R
    launch(_sides_kernel, (2 * R,), recv_map, first, out, vals, plan, N, C, M, U,
           recv_counts_off, recv_sizes_off, send_map, idx, first_src, S, T, K, E, E // R,
           send_counts_off, send_sizes_off, ucap, R, static_cap, chunk, hdr, MODE=mode,
           STATIC=static_cap >= 0, VALUES=MAP, UMAP=umap is not None and not slots, SLOTS=slots,
           PER=max(per, 1),
           CP=max(2, triton.next_power_of_2(C)), TOKENS=tokens,
           KP=max(2, triton.next_power_of_2(max(K, 1))),
           RP=max(2, triton.next_power_of_2(R)), BLOCK=BLOCK)
    return first, umap, first_src
