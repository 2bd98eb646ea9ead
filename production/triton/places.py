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

__all__ = ["FIXED", "BOUNDED", "COMPACT", "row_places"]

FIXED, BOUNDED, COMPACT = 0, 1, 2  # how chunk p's start is found (the module docstring)
BLOCK = 256 if INTERPRETED else 1024  # rows a program scans at a time


@triton.jit
def _places_kernel(src, first, umap, plan, N, C, M, UCAP, R, rows_off, sizes_off, cap, chunk,
                   hdr, U, MODE: tl.constexpr, STATIC: tl.constexpr, VALUES: tl.constexpr,
                   UMAP: tl.constexpr, PER: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr,
                   BLOCK: tl.constexpr):
    """first [N] int64: row n's first unit (-1: none). Chunk p (this program) holds rows
    [p (1 + cap), (p + 1)(1 + cap)) (STATIC) or the plan's row counts at rows_off, prefix-summed.
    Units of row n: VALUES, src[n] (a count); else the entries >= 0 of src [N, C]; at most
    UCAP. Chunk p starts at p * chunk + hdr (FIXED), at the sum of the earlier chunks' sizes
    (BOUNDED: min(plan[sizes_off + q], UCAP * rows of q); COMPACT: plan[sizes_off + q])."""
    p = tl.program_id(0).to(tl.int64)
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
    cs = tl.arange(0, CP)
    js = tl.arange(0, PER)
    carry = start * 0
    for b in range(lo, hi, BLOCK):
        n = b + tl.arange(0, BLOCK)
        m = n < hi
        if VALUES:
            u = tl.load(src + n, mask=m, other=0)
        else:
            tile = tl.load(src + n[:, None] * C + cs[None, :], mask=m[:, None] & (cs < C)[None, :],
                           other=-1)
            u = tl.sum((tile >= 0).to(tl.int64), axis=1)
        u = tl.minimum(u, UCAP)
        pos = tl.where(u > 0, start + carry + tl.cumsum(u, axis=0) - u, -1)
        tl.store(first + n, pos, mask=m)
        carry += tl.sum(u, axis=0)
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
    if UMAP:  # the chunk's header rows and its unused tail: zeros
        for b in range(start - hdr, start, BLOCK):
            x = b + tl.arange(0, BLOCK)
            tl.store(umap + x, -1, mask=x < start)
        for b in range(start + carry, start + size, BLOCK):
            x = b + tl.arange(0, BLOCK)
            tl.store(umap + x, -1, mask=x < start + size)


def row_places(src: torch.Tensor, plan: torch.Tensor, R: int, rows_off: int, *, ucap: int,
               mode: int, static_cap: int = -1, chunk: int = 0, hdr: int = 0,
               sizes_off: int = 0, values: bool = False, umap_units: int = -1,
               per: int = 1, M: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(first [N] int64, umap [U] int64 or None)`` for the rows of ``src`` (``values``:
    ``[N]`` unit counts; else ``[N, C]``, a row's units its entries >= 0), on src's device, in
    one launch. ``plan``: the device plan (row counts at ``rows_off``, chunk sizes at
    ``sizes_off``); ``static_cap >= 0``: static chunks of ``1 + static_cap`` rows.
    ``umap_units >= 0``: also the units kernel's map over that many units (dedup's expert side,
    ``per`` units a token row at most; ``src`` is recv_map, naming rows of y's ``M``)."""
    src = src.contiguous()
    N = src.shape[0]
    C = 1 if values else src.shape[1]
    first = torch.empty(N, dtype=torch.int64, device=src.device)
    U = max(umap_units, 0)
    umap = torch.empty(U, dtype=torch.int64, device=src.device) if umap_units >= 0 else None
    launch(_places_kernel, (R,), src, first, umap if umap is not None else first, plan, N, C,
           M, ucap, R, rows_off, sizes_off, static_cap,
           chunk, hdr, U, MODE=mode, STATIC=static_cap >= 0, VALUES=values,
           UMAP=umap is not None, PER=max(per, 1), CP=max(2, triton.next_power_of_2(C)),
           RP=max(2, triton.next_power_of_2(R)), BLOCK=BLOCK)
    return first, umap


def _declare():
    sig = {"src": "*i64", "first": "*i64", "umap": "*i64", "plan": "*i64", "N": "i32",
           "C": "i32", "M": "i32", "UCAP": "i64", "R": "i32", "rows_off": "i32",
           "sizes_off": "i32", "cap": "i32", "chunk": "i32", "hdr": "i32", "U": "i32",
           "MODE": "constexpr", "STATIC": "constexpr", "VALUES": "constexpr",
           "UMAP": "constexpr", "PER": "constexpr", "CP": "constexpr", "RP": "constexpr",
           "BLOCK": "constexpr"}
    for mode, static, values, umap in ((FIXED, True, False, True), (BOUNDED, False, False, True),
                                       (BOUNDED, False, True, False), (COMPACT, False, False, False),
                                       (FIXED, True, True, False)):
        specialization(f"places[mode {mode}{',static' if static else ''}"
                       f"{',values' if values else ',map'}{',umap' if umap else ''}]",
                       _places_kernel, sig,
                       {"MODE": mode, "STATIC": static, "VALUES": values, "UMAP": umap,
                        "PER": 2, "CP": 8, "RP": 8, "BLOCK": BLOCK})


_declare()
