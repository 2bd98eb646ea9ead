"""The byte-row writer shared by pack, unpack and scatter_rows: one output-indexed Triton
kernel that writes whole rows of bytes, each from an index map.

Output row q (of Q) is the ``W`` bytes at ``out + out_off[q]``; it is written in one pass,
every byte once, by the one program that owns q (no atomics, no zero pre-pass, no program
reads what another writes: the sources are other tensors):

- bytes ``[0, P)``: the ``P`` bytes at ``src + src_off[q]`` (a payload row), or zeros when
  ``src_off[q] < 0`` (padding rows, gaps of fixed chunks);
- bytes ``[P, P + 4 NW)``: the ``NW`` int32 words ``meta[q, :]``, little-endian (``meta``
  holds zeros for rows without metadata);
- with ``HDR``: when ``hdr[q] >= 0`` bytes ``[0, 8)`` are that int64 instead (the static
  exchange's in-band count; such a row has ``src_off`` -1 and zero meta, so the rest is zero).

Rows move as integer units, never through a float type, so any dtype (E4M3 codes, NaN
payloads, scale bytes) travels bit for bit: int32 units when every row length and offset is a
multiple of 4 (the metadata words and the header's halves are then whole units), else bytes
(a metadata field may then sit at any byte offset: its bytes are cut from the word by shifts).
Offsets are int64 from the row index on (``program_id`` widened first), so buffers past 2**31
bytes are addressed correctly; writes outside ``out`` and reads outside ``src`` are masked (a
corrupt device plan cannot make the kernel touch memory it does not own).
"""

from __future__ import annotations

import math

import torch

from ._runtime import INTERPRETED, cdiv, launch, tl, triton

__all__ = ["write_rows", "int_at", "tile", "GPU_TILES"]

# A program owns ROWS rows and walks their units BLOCK at a time, the tile fitted to the row:
# a GPU takes one of three shapes (wide payload rows, short rows, the 8-byte slot rows), few
# rows each: every row carries its own int64 offsets and masks, and 32 x 128 or 256 x 16 tiles
# spilled scalar registers on gfx942 (epkit kernels --compile). Each holds at least 1,024
# units (4 KiB of int32): 16 bytes for each of a program's 256 threads on gfx942 (128 on
# sm_90), so a 16-byte row moves 16 bytes an access (32 x 16 gave gfx942's threads 8 bytes).
# The interpreter, which pays per tl.* operation more than per element: 64 Ki units, BLOCK the
# row's length rounded up to a power of two (at most 1 Ki).
GPU_TILES = ((4, 1024), (8, 128), (64, 16))  # (ROWS, BLOCK), chosen by the row's units
INTERPRETER_TILE = 1 << 16


def tile(W: int) -> tuple[int, int]:
    """(ROWS, BLOCK) for payloads of W units."""
    if INTERPRETED:
        block = min(1024, triton.next_power_of_2(max(W, 1)))
        return INTERPRETER_TILE // block, block
    for rows, block in reversed(GPU_TILES):
        if W <= block:
            return rows, block
    return GPU_TILES[0]


@triton.jit
def _rows_kernel(out, src, out_off, src_off, hdr, meta, Q, P, N_OUT, N_SRC,
                 NW: tl.constexpr, HDR: tl.constexpr, U: tl.constexpr, VB: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # Units of U bytes (1: uint8; 4: int32, when every row and offset is a multiple of 4):
    # P, N_OUT, N_SRC count units, out_off / src_off are bytes. A row is P payload units then
    # 4 NW / U metadata units; a header row's first 8 / U units are its header's. Two stores
    # with disjoint masks (payload, metadata): each unit has one writer, and a header row's
    # header units are chosen by value inside them, so no mask is cut below a vector.
    # VB: the bytes every offset, P and both buffers are multiples of (the launch guarantees
    # it): told to the compiler (tl.multiple_of), the payload moves VB bytes an access (16:
    # ld/st.global.v4.b32, global_load/store_dwordx4; epkit kernels --compile checks it).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64 from the start
    ob = tl.load(out_off + rows, mask=rows < Q, other=-1)
    sb = tl.load(src_off + rows, mask=rows < Q, other=-1)
    if VB > 1:  # (a row's -1 is no access: its masks are off)
        ob = tl.multiple_of(ob, VB)
        sb = tl.multiple_of(sb, VB)
    o = ob // U
    s = sb // U  # (tested on the byte offsets: -1 // U truncates to 0 on a GPU)
    PV = (P // (VB // U)) * (VB // U)  # P itself (VB // U divides it), its divisibility seen
    live = (rows < Q) & (ob >= 0) & (o + PV + 4 * NW // U <= N_OUT)  # the row fits out
    has = live & (sb >= 0) & (s + PV <= N_SRC)  # its payload comes from src (else zeros)
    if HDR:
        h = tl.load(hdr + rows, mask=live, other=-1)
        head = live & (h >= 0)
    else:
        head = rows < 0
    for c0 in range(0, PV, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        keep = live[:, None] & ((cols // (VB // U)) < (P // (VB // U)))[None, :]  # a vector's
        v = tl.load(src + (s[:, None] + cols[None, :]), mask=keep & has[:, None], other=0)
        if HDR:
            v = _with_header(v, head, h, cols, U)
        tl.store(out + (o[:, None] + cols[None, :]), v, mask=keep)
    if NW > 0:
        mc = tl.arange(0, 4 * NW // U)  # metadata units
        keep = live[:, None] & (mc >= 0)[None, :]
        if U == 1:  # field mc // 4, byte mc % 4 (little-endian), cut by shifts
            word = tl.load(meta + rows[:, None] * NW + (mc // 4)[None, :], mask=keep, other=0)
            v = ((word >> ((mc % 4) * 8)[None, :]) & 0xFF).to(tl.uint8)
        else:  # a unit is a field
            v = tl.load(meta + rows[:, None] * NW + mc[None, :], mask=keep, other=0)
        if HDR:
            v = _with_header(v, head, h, PV + mc, U)
        tl.store(out + (o[:, None] + (PV + mc)[None, :]), v, mask=keep)


@triton.jit
def _with_header(v, head, h, cols, U: tl.constexpr):
    """v [ROWS, n] (units at row columns ``cols``) with a header row's first 8 / U units
    replaced by its int64 header ``h`` (little-endian: 8 bytes, or two int32 halves)."""
    HU = 8 // U
    shift = (tl.minimum(cols, HU - 1) * (8 * U)).to(tl.int64)
    part = (h[:, None] >> shift[None, :]) & ((1 << (8 * U)) - 1)
    return tl.where(head[:, None] & (cols < HU)[None, :], part.to(v.dtype), v)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8 (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty((0,), dtype=torch.uint8)


def write_rows(out: torch.Tensor, out_off: torch.Tensor, W: int, src: torch.Tensor,
               src_off: torch.Tensor, P: int, meta: torch.Tensor | None = None,
               hdr: torch.Tensor | None = None, align: int = 1) -> None:
    """Write ``Q = out_off.numel()`` rows of ``W`` bytes into ``out`` (module docstring).

    out: contiguous, any dtype (its bytes); out_off, src_off: [Q] int64 byte offsets (src -1:
    a zero payload); src: contiguous, any dtype; meta: [Q, NW] int32 or None (NW = 0);
    hdr: [Q] int64 or None (no header rows). ``W = P + 4 NW``. ``align``: a number every
    offset is a multiple of (the caller's layout guarantees it); with 4 | align, P, W and
    both buffers, the rows move as int32 units instead of bytes."""
    Q = out_off.numel()
    if Q == 0 or W == 0:
        return
    NW = 0 if meta is None else meta.shape[1]
    assert W == P + 4 * NW and (hdr is None or W >= 8)
    ob, sb = _bytes(out), _bytes(src)
    HDR = hdr is not None
    # the widest access every row allows: offsets, payload length and both buffers' starts
    # (and lengths, for int32 units) its multiples; W - P (metadata) is whole int32 words
    VB = math.gcd(16, align, P, ob.data_ptr(), sb.data_ptr())
    U = 4 if VB % 4 == 0 and all(v % 4 == 0 for v in (W, ob.numel(), sb.numel())) else 1
    VB = VB if U == 4 else 1
    if U == 4:
        ob, sb = ob.view(torch.int32), sb.view(torch.int32)
    # Unused pointers (NW = 0, no HDR) still need their declared types.
    if hdr is None:
        hdr = src_off
    if meta is None:
        meta = src_off.new_empty((1, 1), dtype=torch.int32)  # (unread: NW = 0)
    rows, block = tile(P // U)
    launch(_rows_kernel, (cdiv(Q, rows),), ob, sb, out_off, src_off, hdr, meta,
           Q, P // U, ob.numel(), sb.numel(),
           NW=NW, HDR=HDR, U=U, VB=VB, ROWS=rows, BLOCK=block)


@triton.jit
def int_at(buf, a, live, NB, NBYTES: tl.constexpr):
    """The little-endian integers of NBYTES bytes at byte offsets ``a`` (int64, a tile) of
    buf [NB] uint8 (int64, signed for 4 and 8 bytes), 0 where not ``live`` or outside the
    buffer (never read): every read of a received buffer's words goes through here."""
    ok = live & (a >= 0) & (a + NBYTES <= NB)
    v = tl.zeros(a.shape, tl.int64)
    for j in tl.static_range(NBYTES):
        b = tl.load(buf + a + j, mask=ok, other=0).to(tl.int64) & 0xFF
        v = v | (b << (8 * j))
    if NBYTES == 4:  # the int32's sign
        v = v - ((v >> 31) & 1) * (1 << 32)
    return tl.where(ok, v, 0)
