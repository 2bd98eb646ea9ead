"""unpack's row space in one launch: each received row's source, bytes and token, the plan's
and the chunks' status bits, and (a path whose row metadata is its one slot: pairs) the row's
expert row.

The received buffer's rows are addressed in the row space combine and the backward passes
exchange (unpack.py's docstring): ``recv_rows`` rows, static chunks of ``1 + cap`` rows (an
in-band header row, then the data rows), ragged chunks back to back. One program owns BLOCK
rows r and finds, from the plan's words alone (no host read, no data-dependent size):

- ``s``: the source rank (static: ``r // (1 + cap)``; ragged: how many chunks end at or
  before r, the searchsorted of the torch form), clamped to ``R - 1``;
- its data row ``i`` in the chunk, ``g`` among all data rows, its byte offset ``at``
  (the chunk's first byte, the exclusive prefix of recv_bytes, plus ``(hdr + i) * B``);
- ``data``: a data row, inside the buffer, of a plan that carries no error;
- ``t``: the int32 token after the payload (0 elsewhere);
- with ``ROW_SLOT`` (pairs): the slot's ``k`` and weight bits, and its expert row ``m``: the
  plan's kept blocks (recv_kept, s-major: block (s, j) holds ``recv_kept[s, j]`` rows) in flat
  order; row g lies in block b (a search in their flat prefix) and takes row ``g - start(b)``
  of it after ``offsets[j] + sum over s' < s of recv_kept[s', j]``; ``live`` when that row
  lies in [0, expert_rows).

Every check of the torch form (the C++ kernel's) sets its bit of this program's status word
``bits[pid]`` (per row: a data row past the buffer; pairs, a data row without an expert row;
program 0 also the plan's: shape words, offsets, the static chunks' in-band counts, pairs' kept
blocks), 0 when the plan carries an error. The words cross programs through a second launch
(unpack's outputs kernel ORs them). The same launch fills unpack's inverse maps with -1 (the
maps launch writes into them next), so the fills cost no launch of their own.

The per-row searches walk the plan's R (or R * L) words: a handful of cached scalar loads a
row block, against the dozens of launches the torch form took.
"""

from __future__ import annotations

import torch

from epkit.reference import abi

from .. import plan as W
from .abi import PLAN_ERR_CODE, PLAN_EXPERT_ROWS, PLAN_RECV_BYTES, PLAN_RECV_ROWS
from ._runtime import INTERPRETED, cdiv, launch, tl, triton
from .byterows import int_at
from .wirechecks import ST_EXPERT_ROW, ST_INBAND, ST_ROWS, ST_SHAPE

__all__ = ["row_space", "BLOCK"]

BLOCK = 4096 if INTERPRETED else 256  # rows a program

# the plan's header words and the wire's metadata offsets, as the kernel reads them
_META_T = tl.constexpr(4 * abi.PAIRS_META.index("t"))
_META_K = tl.constexpr(4 * abi.PAIRS_META.index("k"))
_META_W = tl.constexpr(4 * abi.PAIRS_META.index("w"))
_ST_SHAPE = tl.constexpr(ST_SHAPE)
_ST_INBAND = tl.constexpr(ST_INBAND)
_ST_ROWS = tl.constexpr(ST_ROWS)
_ST_EXPERT_ROW = tl.constexpr(ST_EXPERT_ROW)
_VEC = tl.constexpr(64)  # plan words a step of program 0's checks


@triton.jit
def any_bit(cond, bit):
    """``bit`` where any lane of ``cond`` holds, else 0 (int32)."""
    return tl.max(cond.to(tl.int32), 0) * bit


@triton.jit
def _plan_bits(recv, plan, N, NB, M, R, L, CAP, o_counts, o_offsets, o_kept, o_rbytes,
               ROW_SLOT: tl.constexpr):
    """The plan's own status bits (program 0): its shape words, offsets, the static chunks'
    in-band counts, and with ROW_SLOT its kept blocks."""
    v = tl.arange(0, _VEC)
    bits = ((tl.load(plan + PLAN_RECV_BYTES) != NB) | (tl.load(plan + PLAN_RECV_ROWS) != N)
            | (tl.load(plan + PLAN_EXPERT_ROWS) != M)).to(tl.int32) * _ST_SHAPE
    ok = (tl.zeros([_VEC], tl.int64) + tl.load(plan + PLAN_ERR_CODE)) == 0  # a tile (interpreter)
    # offsets: start at 0 or after, never decrease, end inside expert_rows
    bits |= ((tl.load(plan + o_offsets) < 0) | (tl.load(plan + o_offsets + L) > M)).to(
        tl.int32) * _ST_SHAPE
    for j0 in range(0, L, _VEC):
        j = j0 + v
        lo = tl.load(plan + o_offsets + j, mask=j < L, other=0)
        hi = tl.load(plan + o_offsets + j + 1, mask=j < L, other=0)
        bits |= any_bit((j < L) & (hi < lo), _ST_SHAPE)
    # the chunks: their bytes add up to the buffer; static chunks hold at most cap rows and
    # open with their in-band count; ragged ones hold at most recv_rows rows in all
    nbytes = tl.zeros([_VEC], tl.int64)
    nrows = tl.zeros([_VEC], tl.int64)
    for s0 in range(0, R, _VEC):
        s = s0 + v
        c = tl.load(plan + o_counts + s, mask=s < R, other=0)
        b = tl.load(plan + o_rbytes + s, mask=s < R, other=0)
        first = tl.sum(nbytes, 0) + tl.cumsum(b, 0) - b  # each chunk's first byte
        if CAP >= 0:
            bits |= any_bit((s < R) & (c > 0) & (s * (1 + CAP) + c >= N), _ST_SHAPE)
            bits |= any_bit((s < R) & (int_at(recv, first, (s < R) & ok, NB, 8) != c), _ST_INBAND)
        nbytes += b
        nrows += c
    bits |= (tl.sum(nbytes, 0) != NB).to(tl.int32) * _ST_SHAPE
    if CAP < 0:
        bits |= (tl.sum(nrows, 0) > N).to(tl.int32) * _ST_SHAPE
    if ROW_SLOT:
        # the kept blocks cover the rows received, and each fits its expert's segment
        ends = tl.zeros([_VEC], tl.int64)
        for j0 in range(0, L, _VEC):
            j = j0 + v
            col = tl.load(plan + o_offsets + j, mask=j < L, other=0)  # block (s, j)'s first row
            nxt = tl.load(plan + o_offsets + j + 1, mask=j < L, other=0)
            for s in range(R):
                kp = tl.load(plan + o_kept + s * L + j, mask=j < L, other=0)
                bits |= any_bit((j < L) & (kp < 0), _ST_ROWS)
                bits |= any_bit((j < L) & (col + kp > nxt), _ST_EXPERT_ROW)
                col += kp
                ends += kp
        bits |= (tl.sum(ends, 0) != tl.sum(nrows, 0)).to(tl.int32) * _ST_ROWS
    return bits


@triton.jit
def _row_space_kernel(recv, plan, s_o, at_o, data_o, t_o, m_o, live_o, k_o, w_o, bits_o,
                      fill_a, fill_b, N, NB, M, B, P, R, L, CAP, QA, QB,
                      o_counts, o_offsets, o_kept, o_rbytes,
                      ROW_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    """The row space of rows [pid * BLOCK, +BLOCK) (module docstring); fill_a [QA] and fill_b
    [QB] = -1 over the same range."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(fill_a + r, tl.full([BLOCK], -1, tl.int64), mask=r < QA)
    tl.store(fill_b + r, tl.full([BLOCK], -1, tl.int64), mask=r < QB)
    ok = (tl.zeros([BLOCK], tl.int64) + tl.load(plan + PLAN_ERR_CODE)) == 0  # (tiles: as static)
    row = r < N
    static = (tl.zeros([BLOCK], tl.int64) + CAP) >= 0  # a tile: the interpreter keeps it bool
    # the source: static chunks of 1 + cap rows; ragged, the chunks ending at or before r
    after = tl.zeros([BLOCK], tl.int64)
    total = tl.zeros([BLOCK], tl.int64)
    for q in range(R):
        total += tl.load(plan + o_counts + q)
        after += (total <= r).to(tl.int64)
    step = tl.maximum(CAP + 1, 1)
    s = tl.where(static, r // step, after)
    i_static = r % step - 1
    data = (static & (s < R) & (i_static >= 0)) | (~static & (r < total))
    s = tl.minimum(s, R - 1)
    before = tl.zeros([BLOCK], tl.int64)  # data rows of the chunks before s
    first = tl.zeros([BLOCK], tl.int64)   # chunk s's first byte
    count = tl.zeros([BLOCK], tl.int64)   # chunk s's data rows
    for q in range(R):
        c = tl.load(plan + o_counts + q)
        before += tl.where(q < s, c, 0)
        first += tl.where(q < s, tl.load(plan + o_rbytes + q), 0)
        count += tl.where(q == s, c, 0)
    i = tl.where(static, i_static, r - before)
    g = tl.where(static, before + i, r)
    data = row & data & ((i < count) | ~static)
    at = first + (static.to(tl.int64) + i) * B
    bits = any_bit(data & (at + B > NB), _ST_SHAPE)
    data = data & ok & (at + B <= NB)
    tl.store(s_o + r, s, mask=row)
    tl.store(at_o + r, at, mask=row)
    tl.store(t_o + r, int_at(recv, at + P + _META_T, data, NB, 4), mask=row)
    if ROW_SLOT:
        tl.store(k_o + r, int_at(recv, at + P + _META_K, data, NB, 4), mask=row)
        tl.store(w_o + r, int_at(recv, at + P + _META_W, data, NB, 4), mask=row)
        # the kept block b holding data row g, and where it starts
        RL = R * L
        ends = tl.zeros([BLOCK], tl.int64)
        blk = tl.zeros([BLOCK], tl.int64)
        for q in range(RL):
            ends += tl.load(plan + o_kept + q)
            blk += (ends <= g).to(tl.int64)
        inb = blk < RL
        blk = tl.minimum(blk, RL - 1)
        sb, jb = blk // L, blk % L
        start = tl.zeros([BLOCK], tl.int64)
        for q in range(RL):
            start += tl.where(q < blk, tl.load(plan + o_kept + q), 0)
        base = tl.load(plan + o_offsets + jb, mask=row, other=0)
        for q in range(R):
            base += tl.where(q < sb, tl.load(plan + o_kept + q * L + jb, mask=row, other=0), 0)
        m = base + g - start
        live = data & inb & (m >= 0) & (m < M)
        bits |= any_bit(data & ~live, _ST_ROWS)
        tl.store(m_o + r, m, mask=row)
        tl.store(live_o + r, live.to(tl.uint8), mask=row)
    tl.store(data_o + r, data.to(tl.uint8), mask=row)
    if pid == 0:
        bits |= _plan_bits(recv, plan, N, NB, M, R, L, CAP, o_counts, o_offsets, o_kept,
                           o_rbytes, ROW_SLOT)
    tl.store(bits_o + pid, bits)  # (the outputs launch zeroes it under an erroneous plan)


def row_space(recv, plan, row_slot: bool, P: int, B: int, R: int, E: int, N: int, M: int,
              cap: int, fills: tuple):
    """The row space of unpack's N received rows in one launch (module docstring): returns
    ``(s, at, data, t, m, live, k, wbits, bits)``: [N] int64 (data, live bool), ``m``, ``live``,
    ``k``, ``wbits`` empty without ``row_slot``; ``bits`` [programs] int32, the programs'
    status words. ``fills``: two int64 tensors the
    launch fills with -1."""
    dev = recv.device
    i64 = dict(dtype=torch.int64, device=dev)
    sl = W.plan_slices(R, E)
    L = E // R
    NS = N if row_slot else 0
    s, at, t = (torch.empty(N, **i64) for _ in range(3))
    m, k, w = (torch.empty(NS, **i64) for _ in range(3))
    data = torch.empty(N, dtype=torch.bool, device=dev)
    live = torch.empty(NS, dtype=torch.bool, device=dev)
    fa, fb = fills
    programs = cdiv(max(N, fa.numel(), fb.numel(), 1), BLOCK)
    bits = torch.empty(programs, dtype=torch.int32, device=dev)
    launch(_row_space_kernel, (programs,), recv, plan, s, at, data.view(torch.uint8), t,
           m if row_slot else s, live.view(torch.uint8) if row_slot else data.view(torch.uint8),
           k if row_slot else s, w if row_slot else s, bits, fa, fb,
           N, recv.numel(), M, B, P, R, L, cap, fa.numel(), fb.numel(),
           sl["recv_counts"].start, sl["offsets"].start, sl["recv_kept"].start,
           sl["recv_bytes"].start, ROW_SLOT=row_slot, BLOCK=BLOCK)
    return s, at, data, t, m, live, k, w, bits
