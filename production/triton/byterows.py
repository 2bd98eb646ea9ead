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

import torch

from ._runtime import INTERPRETED, cdiv, launch, specialization, tl, triton

__all__ = ["write_rows", "ROWS", "BLOCK"]

# A program owns ROWS rows and walks their units BLOCK at a time. The interpreter pays per
# tl.* operation, not per element, so it takes large tiles; a GPU takes 4 rows x 1 Ki units.
ROWS = 64 if INTERPRETED else 4
BLOCK = 1024


@triton.jit
def _rows_kernel(out, src, out_off, src_off, hdr, meta, Q, P, W, N_OUT, N_SRC,
                 NW: tl.constexpr, HDR: tl.constexpr, U: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr):
    # Units of U bytes (1: uint8; 4: int32, when every row and offset is a multiple of 4):
    # P, W, N_OUT, N_SRC count units, out_off / src_off are bytes.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64 from the start
    live = rows < Q
    ob = tl.load(out_off + rows, mask=live, other=-1)
    sb = tl.load(src_off + rows, mask=live, other=-1)
    live = live & (ob >= 0)
    has = sb >= 0  # tested on the byte offset: -1 // U truncates to 0 on a GPU
    o = ob // U
    s = sb // U
    if HDR:
        h = tl.load(hdr + rows, mask=live, other=-1)
    for c0 in range(0, W, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        at = o[:, None] + cols[None, :]  # int64 unit index in out
        keep = live[:, None] & (cols < W)[None, :] & (at < N_OUT)
        frm = s[:, None] + cols[None, :]
        pay = keep & has[:, None] & (cols < P)[None, :] & (frm < N_SRC)
        v = tl.load(src + frm, mask=pay, other=0)
        m = cols - P  # unit of the metadata
        if U == 1:  # field m // 4, byte m % 4 (little-endian), by shifts
            if NW > 0:
                inmeta = (m >= 0) & (m < 4 * NW)
                word = tl.load(meta + rows[:, None] * NW + (m // 4)[None, :],
                               mask=keep & inmeta[None, :], other=0)
                byte = (word >> ((m % 4) * 8)[None, :]) & 0xFF
                v = tl.where(inmeta[None, :], byte.to(tl.uint8), v)
            if HDR:
                lead = (h[:, None] >> (tl.minimum(cols, 7) * 8).to(tl.int64)[None, :]) & 0xFF
                v = tl.where((h >= 0)[:, None] & (cols < 8)[None, :], lead.to(tl.uint8), v)
        else:  # a unit is a field (int32); the int64 header two units, low first
            if NW > 0:
                inmeta = (m >= 0) & (m < NW)
                word = tl.load(meta + rows[:, None] * NW + m[None, :],
                               mask=keep & inmeta[None, :], other=0)
                v = tl.where(inmeta[None, :], word, v)
            if HDR:
                lead = (h[:, None] >> (tl.minimum(cols, 1) * 32).to(tl.int64)[None, :]) \
                    & 0xFFFFFFFF
                v = tl.where((h >= 0)[:, None] & (cols < 2)[None, :], lead.to(tl.int32), v)
        tl.store(out + at, v, mask=keep)


def _sig(U: int) -> dict:
    unit = "*u8" if U == 1 else "*i32"
    return {"out": unit, "src": unit, "out_off": "*i64", "src_off": "*i64", "hdr": "*i64",
            "meta": "*i32", "Q": "i64", "P": "i32", "W": "i32", "N_OUT": "i64", "N_SRC": "i64",
            "NW": "constexpr", "HDR": "constexpr", "U": "constexpr", "ROWS": "constexpr",
            "BLOCK": "constexpr"}


def declare(name: str, NW: int, HDR: bool) -> None:
    """Declare the compiled forms that ``write_rows(..., NW, HDR)`` launches, byte and int32
    units (for the compile gate; the interpreter's larger ROWS is not compiled)."""
    for U in (1, 4):
        specialization(f"{name}.u{U}", _rows_kernel, _sig(U),
                       {"NW": NW, "HDR": HDR, "U": U, "ROWS": 4, "BLOCK": BLOCK}, exact=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8 (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty((0,), dtype=torch.uint8)


def write_rows(out: torch.Tensor, out_off: torch.Tensor, W: int, src: torch.Tensor,
               src_off: torch.Tensor, P: int, meta: torch.Tensor | None = None,
               hdr: torch.Tensor | None = None, align: int = 1) -> None:
    """Write ``Q = out_off.numel()`` rows of ``W`` bytes into ``out`` (module docstring).

    out: contiguous, any dtype (its bytes); out_off, src_off: [Q] int64 byte offsets (src -1:
    a zero payload); src: contiguous, any dtype; meta: [Q, NW] int32 or None (NW = 0);
    hdr: [Q] int64 or None (no header rows). ``P + 4 NW <= W``. ``align``: a number every
    offset is a multiple of (the caller's layout guarantees it); with 4 | align, P, W and
    both buffers, the rows move as int32 units instead of bytes."""
    Q = out_off.numel()
    if Q == 0 or W == 0:
        return
    NW = 0 if meta is None else meta.shape[1]
    assert P + 4 * NW <= W
    ob, sb = _bytes(out), _bytes(src)
    HDR = hdr is not None
    U = 4 if all(v % 4 == 0 for v in (align, P, W, ob.numel(), sb.numel(), ob.data_ptr(),
                                      sb.data_ptr())) else 1
    if U == 4:
        ob, sb = ob.view(torch.int32), sb.view(torch.int32)
    # Unused pointers (NW = 0, no HDR) still need their declared types.
    if hdr is None:
        hdr = src_off
    if meta is None:
        meta = src_off.new_zeros((1, 1), dtype=torch.int32)
    launch(_rows_kernel, (cdiv(Q, ROWS),), ob, sb, out_off, src_off, hdr, meta,
           Q, P // U, W // U, ob.numel(), sb.numel(),
           NW=NW, HDR=HDR, U=U, ROWS=ROWS, BLOCK=BLOCK)
