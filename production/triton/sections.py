"""The send buffer's section rows for the row writer, one kernel for every kind of row (pack's
last index launch before ``byterows.write_rows``; pairs.py and dedup.py launch it).

A chunk of the send buffer (pack.py's docstring) is a first section of ``B``-byte rows (pairs: a
row per kept slot; dedup: a row per token with a kept slot on the chunk's rank) and, for dedup,
a slot section of 8-byte slot rows. Each path's slot launch writes, for every row that carries a
slot or a token, the flat slot ``s`` it comes from into ``src`` (at the row's place among the
section's rows, -1 elsewhere); this kernel then gives each of the section's ``Q`` rows what the
row writer takes:

- its metadata words (``KIND``): pairs' ``t, k, j, w`` (four int32), dedup's token row ``t, n``
  (n from ``aux`` [T * K] int64, the token's kept slots on the rank, at its opening slot) or
  slot row ``(k << 24 | j), w`` (two int32); zeros for a row without a slot;
- its payload's byte offset in x (``t * P``; -1: zeros, and always for slot rows);
- its own byte offset: its chunk's first byte, then (slot rows) the chunk's first section
  (``LEAD_CAP`` rows, or its count at ``o_lead``, of ``LEAD_B`` bytes), then its place in the
  section times ``B``;
- static (``HDR``): a chunk's first row of the section is its header row, whose value is the
  section's count (-1 elsewhere).

Chunk d of row q is found by walking the R section sizes (fixed: ``CAP`` rows each; ragged:
the plan's counts at ``o_counts``): cached scalar loads, no cumsum launch.
"""

from __future__ import annotations

import torch

from .abi import (DEDUP_TOKEN_META_N, DEDUP_TOKEN_META_T, PAIRS_META_J, PAIRS_META_K,
                  PAIRS_META_T, PAIRS_META_W, PLAN_ERR_CODE, SLOT_K_SHIFT)
from ._runtime import INTERPRETED, cdiv, launch, tl, triton

__all__ = ["excl_at", "section_rows", "PAIRS_ROW", "TOKEN_ROW", "SLOT_ROW"]

# the kinds of section row (KIND) and their metadata words
PAIRS_ROW, TOKEN_ROW, SLOT_ROW = 0, 1, 2
PAIRS_ROW_C, TOKEN_ROW_C, SLOT_ROW_C = (tl.constexpr(k) for k in (PAIRS_ROW, TOKEN_ROW, SLOT_ROW))
META_WORDS = {PAIRS_ROW: 4, TOKEN_ROW: 2, SLOT_ROW: 2}
BLOCK = 4096 if INTERPRETED else 256  # rows a program


@triton.jit
def excl_at(plan, o, n, at, inside):
    """The exclusive prefix sum of the plan's words [o, o + n) at positions ``at`` (a tile):
    a walk over the n words (cached scalar loads), no cumsum launch."""
    acc = tl.zeros(at.shape, tl.int64)
    for q in range(n):
        acc += tl.where(inside & (q < at), tl.load(plan + o + q), 0)
    return acc


@triton.jit
def _section_rows_kernel(idx, wbits, aux, plan, src, off, src_off, meta, hdr_v, Q, K, L, R, B,
                         P, CAP, LEAD_CAP, LEAD_B, HDR, o_counts, o_lead, o_bytes,
                         KIND: tl.constexpr, NW: tl.constexpr, BLOCK: tl.constexpr):
    """The section's rows q [pid * BLOCK, +BLOCK) (module docstring): idx [T * K] int64 the
    routing, wbits [T * K] int32 the weights' bits, src [Q] int64 each row's slot (-1: none),
    out: off, src_off, hdr_v [Q] int64 and meta [Q, NW] int32."""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < Q
    s = tl.load(src + q, mask=inq, other=-1)
    has = inq & (s >= 0)
    s = tl.where(has, s, 0)
    t, k = s // K, s % K
    e = tl.load(idx + s, mask=has, other=0)
    w = tl.load(wbits + s, mask=has, other=0)
    if KIND == PAIRS_ROW_C:  # t, k, j, w
        tl.store(meta + NW * q + PAIRS_META_T, tl.where(has, t, 0).to(tl.int32), mask=inq)
        tl.store(meta + NW * q + PAIRS_META_K, tl.where(has, k, 0).to(tl.int32), mask=inq)
        tl.store(meta + NW * q + PAIRS_META_J, tl.where(has, e % L, 0).to(tl.int32), mask=inq)
        tl.store(meta + NW * q + PAIRS_META_W, tl.where(has, w, 0), mask=inq)
    elif KIND == TOKEN_ROW_C:  # t, n
        n = tl.load(aux + s, mask=has, other=0)
        tl.store(meta + NW * q + DEDUP_TOKEN_META_T, tl.where(has, t, 0).to(tl.int32), mask=inq)
        tl.store(meta + NW * q + DEDUP_TOKEN_META_N, tl.where(has, n, 0).to(tl.int32), mask=inq)
    else:  # SLOT_ROW: k << 24 | j (k >= 128 sets the int32's sign bit: the low 32 bits), w
        code = (k << SLOT_K_SHIFT) | (e % L)
        tl.store(meta + NW * q, tl.where(has, code, 0).to(tl.int32), mask=inq)
        tl.store(meta + NW * q + 1, tl.where(has, w, 0), mask=inq)
    if KIND == SLOT_ROW_C:
        tl.store(src_off + q, tl.zeros([BLOCK], tl.int64) - 1, mask=inq)
    else:
        tl.store(src_off + q, tl.where(has, t * P, -1), mask=inq)
    # the chunk d of row q: how many chunks' sections end at or before q
    rows = tl.zeros([BLOCK], tl.int64)
    d = tl.zeros([BLOCK], tl.int64)
    for c in range(R):
        rows += tl.where(CAP >= 0, CAP, tl.load(plan + o_counts + c))
        d += (rows <= q).to(tl.int64)
    d = tl.minimum(d, R - 1)
    base = tl.where(CAP >= 0, d * CAP, excl_at(plan, o_counts, R, d, inq))
    pos = q - base
    lead = tl.where(LEAD_CAP >= 0, LEAD_CAP, tl.load(plan + o_lead + d, mask=inq, other=0))
    tl.store(off + q, excl_at(plan, o_bytes, R, d, inq) + lead * LEAD_B + pos * B, mask=inq)
    ok = (tl.zeros([BLOCK], tl.int64) + tl.load(plan + PLAN_ERR_CODE)) == 0  # a tile (interpreter)
    head = ok & (pos == 0) & ((tl.zeros([BLOCK], tl.int64) + HDR) != 0)
    tl.store(hdr_v + q, tl.where(head, tl.load(plan + o_counts + d, mask=inq, other=0), -1),
             mask=inq)


def section_rows(ix, kind: int, src: torch.Tensor, Q: int, B: int, counts: str, cap: int,
                 aux: torch.Tensor | None = None):
    """One launch: the ``Q`` rows of a section (``kind``: PAIRS_ROW, TOKEN_ROW or SLOT_ROW)
    from pack's index pass ``ix`` (pack.Slots) and ``src`` [Q] int64 (each row's slot, -1:
    none); ``counts``: the plan section of its per-chunk row counts, ``cap`` its fixed rows a
    chunk (-1: ragged). Returns (byte offsets [Q], payload source offsets [Q], meta [Q, NW]
    int32, header values [Q] int64 or None)."""
    idx, pv = ix.routing.idx, ix.plan
    i64 = dict(dtype=torch.int64, device=idx.device)
    NW = META_WORDS[kind]
    off, src_off, hdr = (torch.empty(Q, **i64) for _ in range(3))
    meta = torch.empty((Q, NW), dtype=torch.int32, device=idx.device)
    slot_rows = kind == SLOT_ROW  # after the chunk's first section
    if Q:
        launch(_section_rows_kernel, (cdiv(Q, BLOCK),), idx, ix.routing.weight_bits,
               idx if aux is None else aux, pv.tensor, src, off, src_off, meta, hdr, Q,
               max(ix.routing.topk, 1), pv.local_experts, pv.ranks, B,
               ix.routing.payload_bytes, cap, pv.token_cap if slot_rows else -1,
               ix.buffer.row_bytes if slot_rows else 0, pv.header_rows, pv.start(counts),
               pv.start("send_counts"), pv.start("send_bytes"), KIND=kind, NW=NW, BLOCK=BLOCK)
    return off, src_off, meta, hdr if pv.header_rows else None
