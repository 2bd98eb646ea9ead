"""The return path's places in one launch: where each row's units go in a chunked buffer.

combine, the dispatch backward and the weight gradients' return path send, for each row of the
dispatch's row space (the received rows on the expert side, the sent rows on the source side),
``u`` units (dedup: ``min(n, per)`` of a token row's n kept slots; the weight gradients: one
float32 per kept slot) along the exchange's chunks, one chunk per peer. A row's first unit lies
at its chunk's start (after the chunk's header rows) plus the units of the chunk's rows before
it, in row order; a row without units has place -1. As torch ops that is a dozen launches (an
index_add, two cumsums, gathers; production/moves.py ``_unit_positions`` is the torch form,
which the C++ path runs); here it is one program per chunk (grid ``(R,)``): the chunk's rows and
its start come from the plan (the row counts, and the chunk sizes: fixed, or each peer's bounded
or exact count), and the program scans its rows in blocks (integer ``tl.cumsum``, order-free).
Programs write disjoint places, and read nothing another writes.

With ``UMAP`` (dedup's expert side of combine) the same launch writes the units kernel's map
(``combine._units_kernel``: unit -> y's row, or a float32 partial's part, or -1 for zeros) for
every unit of the chunk, the header rows and the unused tail included, so no fill runs first.
"""

from __future__ import annotations

import torch

from ._runtime import INTERPRETED, launch, specialization, tl, triton

__all__ = ["FIXED", "BOUNDED", "COMPACT", "MAP", "VALUES", "DENSE", "row_places",
           "token_places"]

FIXED, BOUNDED, COMPACT = 0, 1, 2  # how chunk p's start is found (the module docstring)
MAP, VALUES, DENSE = 0, 1, 2  # what gives a row's units: a map's entries, counts, one a row
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
def _places_kernel(src, first, umap, vals, plan, N, C, M, UCAP, R, rows_off, sizes_off, cap,
                   chunk, hdr, U, MODE: tl.constexpr, STATIC: tl.constexpr,
                   VALUES: tl.constexpr, UMAP: tl.constexpr, SLOTS: tl.constexpr,
                   PER: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr):
    """first [N] int64: row n's first unit (-1: none). Chunk p (this program) holds rows
    [p (1 + cap), (p + 1)(1 + cap)) (STATIC) or the plan's row counts at rows_off, prefix-summed.
    Units of row n: VALUES 1, src[n] (a count); VALUES 2 (DENSE), one for each of the chunk's
    data rows (a static chunk's first row is its header, and its rows past the plan's count
    unused); else the entries >= 0 of src [N, C]; at most UCAP. Chunk p starts at p * chunk +
    hdr (FIXED), at the sum of the earlier chunks' sizes (BOUNDED: min(plan[sizes_off + q],
    UCAP * rows of q); COMPACT: plan[sizes_off + q]). With UMAP or SLOTS, umap [U] (int64, or
    int32 bits of float32) is written whole: the units kernel's map, or the weight gradients'
    values vals [M] (gather_slot_values: row n's entries that are not -1, c ascending, at
    first[n], first[n] + 1, ...; those naming no row of vals 0), the chunk's other units -1 or
    0."""
    p = tl.program_id(0).to(tl.int64)
    lo, hi, start, size = _chunk(plan, p, N, R, rows_off, sizes_off, cap, chunk, hdr, UCAP,
                                 MODE, STATIC, RP)
    cs = tl.arange(0, CP)
    js = tl.arange(0, PER)
    carry = start * 0
    for b in range(lo, hi, BLOCK):
        n = b + tl.arange(0, BLOCK)
        m = n < hi
        if VALUES == 1:
            u = tl.load(src + n, mask=m, other=0)
        elif VALUES == 2:  # DENSE: one unit a data row (past a static chunk's header row)
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
def _token_places_kernel(send_map, idx, first, plan, T, K, E, L, S, UCAP, R, rows_off,
                         sizes_off, cap, chunk, hdr, MODE: tl.constexpr, STATIC: tl.constexpr,
                         KP: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr):
    """dedup's source side: first [S] int64 for the send rows, the token rows send_map [T, R]
    names, in token order within each chunk (pack's order): a row's units are its token's
    kept slots on the chunk's rank (idx [T, K], the kept routing), at most UCAP. Rows of a
    static chunk that no token names (its header row, its unused tail) get -1."""
    p = tl.program_id(0).to(tl.int64)
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


def token_places(send_map: torch.Tensor, idx: torch.Tensor, plan: torch.Tensor, R: int,
                 E: int, S: int, rows_off: int, *, ucap: int, mode: int, static_cap: int = -1,
                 chunk: int = 0, hdr: int = 0, sizes_off: int = 0) -> torch.Tensor:
    """``first [S] int64`` of dedup's send rows (``_token_places_kernel``), one launch; the
    chunk arguments as :func:`row_places`'."""
    send_map, idx = send_map.contiguous(), idx.contiguous()
    T, K = idx.shape
    first = torch.empty(S, dtype=torch.int64, device=send_map.device)
    launch(_token_places_kernel, (R,), send_map, idx, first, plan, T, K, E, E // R, S, ucap, R,
           rows_off, sizes_off, static_cap, chunk, hdr, MODE=mode, STATIC=static_cap >= 0,
           KP=max(2, triton.next_power_of_2(max(K, 1))),
           RP=max(2, triton.next_power_of_2(R)), BLOCK=BLOCK)
    return first


def row_places(src: torch.Tensor, plan: torch.Tensor, R: int, rows_off: int, *, ucap: int,
               mode: int, static_cap: int = -1, chunk: int = 0, hdr: int = 0,
               sizes_off: int = 0, values: int = MAP, umap_units: int = -1,
               per: int = 1, M: int = 0, rows: int | None = None,
               slot_values: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(first [N] int64, umap [U] int64 or None)`` for the rows of ``src`` (``values``:
    ``MAP``, ``src [N, C]``, a row's units its entries >= 0; ``VALUES``, ``src [N]`` unit
    counts; ``DENSE``, one unit a data row, ``src`` only sizes), on src's device, in one
    launch. ``plan``: the device plan (row counts at ``rows_off``, chunk sizes at
    ``sizes_off``); ``static_cap >= 0``: static chunks of ``1 + static_cap`` rows.
    ``umap_units >= 0``: also the units kernel's map over that many units (dedup's expert side,
    ``per`` units a token row at most; ``src`` is recv_map, naming rows of y's ``M``); with
    ``slot_values`` [M] float32 instead, the weight gradients' ``[umap_units]`` float32 values
    laid out along the places (``backward.gather_slot_values``'s result)."""
    src = src.contiguous()
    N = src.shape[0] if rows is None else rows  # (DENSE: src unread, rows given)
    C = 1 if values != MAP else src.shape[1]
    first = torch.empty(N, dtype=torch.int64, device=src.device)
    U = max(umap_units, 0)
    slots = slot_values is not None
    umap = (torch.empty(U, dtype=torch.float32 if slots else torch.int64, device=src.device)
            if umap_units >= 0 else None)
    if slots:
        M = slot_values.numel()
        out, vals = umap.view(torch.int32), slot_values.contiguous().view(torch.int32)
    else:
        out = vals = umap if umap is not None else first
    launch(_places_kernel, (R,), src, first, out, vals, plan, N, C, M, ucap, R, rows_off,
           sizes_off, static_cap, chunk, hdr, U, MODE=mode, STATIC=static_cap >= 0,
           VALUES=int(values), UMAP=umap is not None and not slots, SLOTS=slots,
           PER=max(per, 1), CP=max(2, triton.next_power_of_2(C)),
           RP=max(2, triton.next_power_of_2(R)), BLOCK=BLOCK)
    return first, umap


def _declare():
    # (mode, static, units from, writes): the forms moves.py launches
    forms = ((FIXED, True, MAP, "umap"), (BOUNDED, False, MAP, "umap"),
             (FIXED, True, MAP, "slots"), (COMPACT, False, MAP, "slots"),
             (COMPACT, False, DENSE, ""), (FIXED, True, DENSE, ""))
    for mode, static, units, writes in forms:
        ptr = "*i32" if writes == "slots" else "*i64"
        sig = {"src": "*i64", "first": "*i64", "umap": ptr, "vals": ptr, "plan": "*i64",
               "N": "i32", "C": "i32", "M": "i32", "UCAP": "i64", "R": "i32",
               "rows_off": "i32", "sizes_off": "i32", "cap": "i32", "chunk": "i32",
               "hdr": "i32", "U": "i32", "MODE": "constexpr", "STATIC": "constexpr",
               "VALUES": "constexpr", "UMAP": "constexpr", "SLOTS": "constexpr",
               "PER": "constexpr", "CP": "constexpr", "RP": "constexpr", "BLOCK": "constexpr"}
        specialization(f"places[mode {mode}{',static' if static else ''},"
                       f"{('map', 'values', 'dense')[units]}{',' + writes if writes else ''}]",
                       _places_kernel, sig,
                       {"MODE": mode, "STATIC": static, "VALUES": units,
                        "UMAP": writes == "umap", "SLOTS": writes == "slots",
                        "PER": 2 if writes == "umap" else 1, "CP": 8, "RP": 8, "BLOCK": BLOCK})


_declare()


for _mode, _static in ((FIXED, True), (BOUNDED, False), (COMPACT, False)):
    specialization(f"places.tokens[mode {_mode}{',static' if _static else ''}]",
                   _token_places_kernel,
                   {"send_map": "*i64", "idx": "*i64", "first": "*i64", "plan": "*i64",
                    "T": "i32", "K": "i32", "E": "i32", "L": "i32", "S": "i32", "UCAP": "i64",
                    "R": "i32", "rows_off": "i32", "sizes_off": "i32", "cap": "i32",
                    "chunk": "i32", "hdr": "i32", "MODE": "constexpr", "STATIC": "constexpr",
                    "KP": "constexpr", "RP": "constexpr", "BLOCK": "constexpr"},
                   {"MODE": _mode, "STATIC": _static, "KP": 8, "RP": 8, "BLOCK": BLOCK})
