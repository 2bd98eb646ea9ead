"""The dedup path of the Triton kernels (transport code 1): a token travels once per destination
rank as a token row ``payload | int32 t | int32 n``, its n kept slots there as slot rows
``int32 (k << 24 | j) | float32 w`` in the chunk's slot section; on the return path a token row
comes back as its n rows of expert_y when n <= per = 4 / itemsize(y), else as its float32
partial (per units of H elements of y's dtype), at unit first[r] of a [units, H] buffer, or at
r * per of rows of 4H bytes without first (docs/design.md).

One module per transport path, as DeepEP splits its kernels into intranode and internode ones:
what pack, unpack, combine and the backward passes do differently for dedup is here, behind the
interface pairs.py has too (transports.py lists it); the per-op modules hold what both paths
share and ask the path ``transports.path_of`` resolved for the rest.
"""

from __future__ import annotations

import torch

from epkit.reference import abi

from . import byterows
from . import rowchecks as ck
from .byterows import read_ints
from .indexmaps import excl, place, rank_in_key, section, take
from .wirechecks import (ST_EXPERT_ROW, ST_EXPERT_TOTAL, ST_SHAPE, ST_SLOT_ROW, ST_SLOTS,
                         status_bit)

NAME = "dedup"
CODE = abi.TRANSPORT_CODES[NAME]
META_BYTES = abi.DEDUP_TOKEN_META_BYTES
TOKEN_ROWS = True    # a row per (token, destination rank), its slots in slot rows
SLOT_SECTIONS = 1    # each chunk ends in its slot section
MAX_TOPK = abi.DEDUP_MAX_TOPK    # a slot row's k: 8 bits
MAX_LOCAL = abi.DEDUP_MAX_LOCAL  # a slot row's j: 24 bits
SLOT = abi.SLOT_ROW_BYTES
SEND_MAP = "dedup: one column per rank"
# what cpu/combine.cpp raises for a slot whose row does not match its routing
UNMATCHED_SLOT = "a kept slot whose token row send_map does not name"


def send_map_cols(K: int, R: int) -> int:
    return R


def recv_map_cols(K: int) -> int:
    return K


def back_dtype(y_dtype: torch.dtype) -> torch.dtype:
    """The return path's rows are 4H bytes: a token row's float32 partial or its raw rows."""
    return torch.float32


def units_per_row(itemsize: int) -> int:
    """per: units of H elements of y's dtype in a 4H-byte row (a float32 partial)."""
    return 4 // itemsize


# ---- argument checks (checks.h, where it asks the transport) ---------------------------------
def check_pack_topk(op, K: int) -> None:
    if K > MAX_TOPK:
        ck.fail(op, f"dedup carries k in 8 bits: topk {K} > {MAX_TOPK}")


def check_local_experts(op, L: int) -> None:
    if L > MAX_LOCAL:
        ck.fail(op, f"dedup carries the local expert in 24 bits: {L} local experts")


def check_gather(op, y, recv_map, row_weight, weighted) -> None:
    """gather_rows / gather_units after the transport: y float (the partials' sums), the row
    weights when weighted (applied at the expert side)."""
    ck.check_float_dtype(op, "expert_y", y.dtype)
    if weighted:
        ck.check_weights_1d(op, row_weight, y)


def check_units(op, recv_map, first, out, y) -> None:
    """gather_units' placement: every token row's units at first."""
    if first is None:
        ck.fail(op, "dedup places its units by first")
    check_first(op, first, recv_map.shape[0], "rows of recv_map", y.device)


def check_first(op, first, rows, what, dev) -> None:
    """The return path's unit places: first [rows] int64 on dev (rows < 0: any length)."""
    if first is None:
        return
    ck.check_map(op, "first", first, 1)
    ck.check_device(op, "first", first, dev)
    if rows >= 0:
        ck.check_size(op, "first", first, 0, rows, what)


def check_back(op, back, first) -> None:
    """Without first, back holds a 4H-byte row per token row."""
    if first is None and back.shape[1] % (4 // back.element_size()):
        ck.fail(op, f"dedup's back must be [S, 4 H / itemsize] (a float32 row per token row), "
                    f"got {list(back.shape)} of {back.dtype}")


# ---- pack ------------------------------------------------------------------------------------
def pack_rows(ix):
    """The first section's token rows, from pack's index pass ``ix`` (pack.Slots): kept slots
    per (token, destination), a token's row in chunk d by an exclusive cumsum over the tokens.
    Returns (send_map [T, R] int64, each row's token [QA] int64 (-1: no row), meta [QA, 2]
    int32)."""
    T, R, dev = ix.T, ix.R, ix.t.device
    td = ix.t * R + ix.d
    n_td = torch.zeros(T * R + 1, dtype=torch.int64, device=dev)
    n_td.scatter_add_(0, torch.where(ix.kept, td, T * R), torch.ones_like(td))
    n_td = n_td[: T * R].view(T, R)
    opens = n_td > 0
    tok = excl(opens.to(torch.int64))  # token row of (t, d) within chunk d
    dd = torch.arange(R, dtype=torch.int64, device=dev).expand(T, R)
    opens = opens & (tok < ix.counts[None, :])
    send_map = torch.where(opens, ix.row_of(dd, tok), -1)
    src = place(ix.QA, (ix.baseA[None, :] + ix.hdr + tok).reshape(-1), opens.reshape(-1),
                torch.arange(T * R, dtype=torch.int64, device=dev))
    has, s = src >= 0, src.clamp(min=0)
    words = torch.stack([s // R, take(n_td.reshape(-1), s)], 1)
    meta = torch.where(has[:, None], words, 0).to(torch.int32)
    return send_map, torch.where(has, s // R, -1), meta


def pack_slots(ix) -> None:
    """The slot rows: chunk d's kept slots in (t, k) order, after its token section."""
    R, d = ix.R, ix.d
    u = rank_in_key(torch.where(ix.kept, d, R), R)
    kept = ix.kept & (u < ix.nslots[d])
    dB, posB, offB, baseB = section(ix.QB, ix.slot_rows, ix.chunk + ix.tok_rows * ix.B, SLOT, R)
    src = place(ix.QB, baseB[d] + ix.hdr + u, kept, ix.slot)
    has, s = src >= 0, src.clamp(min=0)
    # k >= 128 sets the int32's sign bit: the conversion keeps the low 32 bits
    code = ((take(ix.k, s) << abi.SLOT_K_SHIFT) | take(ix.j, s)).to(torch.int32)
    words = torch.stack([code.to(torch.int64), take(ix.wbits, s)], 1)
    meta = torch.where(has[:, None], words, 0).to(torch.int32)
    hdrB = torch.where(ix.ok & (posB == 0), ix.nslots[dB], -1) if ix.hdr else None
    byterows.write_rows(ix.send, offB, SLOT, ix.x, torch.full_like(offB, -1), 0, meta, hdrB,
                        align=ix.align)


# ---- unpack ----------------------------------------------------------------------------------
def unpack_slots(rs, bits: list):
    """Each received token row's n slots, from unpack's row space ``rs`` (unpack.RowSpace):
    its slot rows (the chunk's slot section, the rows' n in order), each slot's expert row its
    place among its local expert's slots (in received order) after the expert's offset. Appends
    its status bits to ``bits``; returns per slot [N * K]: (expert row m, live, its recv_map
    entry's flat place, k, the weight's bits)."""
    recv, R, L, K, N, M, NB = rs.recv, rs.R, rs.L, rs.K, rs.N, rs.M, rs.NB
    i64 = dict(dtype=torch.int64, device=recv.device)
    offsets, data = rs.offsets, rs.data
    n = read_ints(recv, rs.at + rs.P + abi.DEDUP_TOKEN_META.index("n") * 4, data, 4)
    nn = torch.where(data, n.clamp(min=0), 0)
    tot = torch.zeros(R, **i64).scatter_add_(0, rs.s, nn)
    bits.append(status_bit(data & (n < 0), ST_SLOTS))
    bits.append(status_bit(tot != rs.nslots, ST_SLOTS))
    bits.append(status_bit(nn > K, ST_EXPERT_ROW))  # n > K slots cannot name distinct k
    tok_rows = rs.counts if rs.tokcap < 0 else torch.full_like(rs.counts, rs.tokcap)
    sec = rs.rchunk + tok_rows * rs.B  # each chunk's slot section (its header row first)
    if rs.hdr:
        bits.append(status_bit(read_ints(recv, sec, rs.ok, 8) != rs.nslots, ST_SLOTS))
    first = sec[rs.s] + rs.hdr * SLOT + (excl(nn) - excl(tot)[rs.s]) * SLOT
    qk = torch.arange(K, **i64)
    sv = data[:, None] & (qk[None, :] < nn[:, None].clamp(max=K))
    so = first[:, None] + qk[None, :] * SLOT
    bits.append(status_bit(sv & ((so < 0) | (so + SLOT > NB)), ST_SHAPE))
    sv = sv & (so >= 0) & (so + SLOT <= NB)
    word = read_ints(recv, so, sv, 4)
    wbits = read_ints(recv, so + 4, sv, 4).reshape(-1)
    kk = (word & 0xFFFFFFFF) >> abi.SLOT_K_SHIFT
    jj = word & ((1 << abi.SLOT_K_SHIFT) - 1)
    bad = sv & ((jj >= L) | (kk >= K))
    bits.append(status_bit(bad, ST_SLOT_ROW))
    sv = (sv & ~bad).reshape(-1)
    kk, jj = kk.reshape(-1), jj.reshape(-1).clamp(max=L - 1)
    rank = rank_in_key(torch.where(sv, jj, L), L)
    cnt = torch.zeros(L + 1, **i64).scatter_add_(0, torch.where(sv, jj, L),
                                                 torch.ones_like(jj))[:L]
    bits.append(status_bit(cnt != rs.tpe, ST_EXPERT_TOTAL))
    m = offsets[jj] + rank
    bits.append(status_bit(sv & ((m >= offsets[jj + 1]) | (m >= M)), ST_EXPERT_ROW))
    rk = (rs.r[:, None] * K + kk.view(N, K)).reshape(-1) if K else kk
    seen = torch.zeros(N * K + 1, **i64).scatter_add_(0, torch.where(sv, rk, N * K),
                                                     torch.ones_like(rk))[: N * K]
    bits.append(status_bit(seen > 1, ST_EXPERT_ROW))
    return m, sv & (m < M), rk, kk, wbits


# ---- combine and the backward passes ---------------------------------------------------------
def _unit_map(recv_map, M, per, first, U):
    """umap [U] for combine's units kernel, whether each token row's units fit (first set),
    and each row's unit count."""
    N, C = recv_map.shape
    dev = recv_map.device
    kept = (recv_map >= 0) & (recv_map < M)
    cnt = kept.sum(1)
    u = cnt.clamp(max=per)
    n = torch.arange(N, device=dev)
    base = first if first is not None else n * per
    fits = (u == 0) | ((base >= 0) & (base + u <= U))
    umap = torch.full((U + 1,), -1, dtype=torch.int64, device=dev)  # [U]: a sink for the rest
    raw = kept & ((cnt <= per) & fits)[:, None]  # unit base + (its place among the kept)
    at = torch.where(raw, base[:, None] + kept.cumsum(1) - 1, U)
    umap.scatter_(0, at.reshape(-1), torch.where(raw, recv_map, -1).reshape(-1))
    partial = (cnt > per) & fits
    j = torch.arange(per, device=dev)
    at = torch.where(partial[:, None], base[:, None] + j, U)
    umap.scatter_(0, at.reshape(-1), (-2 - (n[:, None] * per + j)).reshape(-1))
    return umap[:U], fits, u


def unit_map(op, recv_map, M: int, per: int, first, U: int) -> torch.Tensor:
    """The expert side's units [U]: token row n's min(n, per) units at first[n] (n * per
    without first), its kept rows of y (m >= 0) when they fit in per units, else its float32
    partial (-2 - (n * per + j): unit j of it); -1 elsewhere (zeros)."""
    umap, fits, u = _unit_map(recv_map, M, per, first, U)
    if ck.on_host(recv_map):
        if first is not None:
            bad = ck.first_bad(~fits)
            if bad >= 0:
                ck.fail(op, f"first[{bad}] = {int(first[bad])} puts its {int(u[bad])} unit(s) "
                            f"outside the {U} units")
        ck.check_map_range(op, "recv_map", recv_map, M, "rows of expert_y")
    return umap


def slot_rows(send_map, d, R: int) -> torch.Tensor:
    """The row each slot [T, K] went out in: its token's row to its destination d."""
    return torch.gather(send_map, 1, d.clamp(max=R - 1))


def bad_rows(idx, ok_e, ok_r, r, send_map) -> torch.Tensor:
    """The slots cpu/combine.cpp raises for besides an expert >= E: a used slot whose token
    row is -1 or outside [0, S)."""
    return ok_e & ~ok_r


def reduce_units(rows, on, start, last, i, first, per: int, S: int, U: int):
    """The source side's steps from each slot's token row ``rows`` [T, K] (in the token's
    (rank, k) order, ``on``: used; a group of slots to one rank shares it): a group of n <= per
    adds its n units, one a slot; a larger one reads its float32 partial (its first slot),
    once. Returns (unit, add, part, bad_first) [T, K], bad_first: units outside back's U."""
    K = i.shape[1]
    q = i - torch.where(start, i, 0).cummax(1).values  # place in the group
    end = torch.where(last, i, K).flip(1).cummin(1).values.flip(1)
    cnt = end - (i - q) + 1
    r0 = rows.clamp(0, max(S - 1, 0))
    if first is None:
        at0 = r0 * per
    else:  # (S = 0: no slot is used, and first has nothing to index)
        at0 = first[r0] if S > 0 else torch.zeros_like(r0)
    fits = (at0 >= 0) & (at0 + cnt.clamp(max=per) <= U)
    partial = on & fits & (cnt > per)
    add = on & fits & (cnt <= per)
    return torch.where(add, at0 + q, at0), add, partial & (q == 0), on & ~fits


def slot_places(d) -> torch.Tensor:
    """Each slot's place after its token row's first value (scatter_slot_values): its place
    among the token's kept slots on d, k ascending (from a stable sort by d)."""
    T, K = d.shape
    ds, order = torch.sort(d, dim=1, stable=True)
    i = torch.arange(K, device=d.device).expand(T, K)
    prev = torch.cat([torch.full_like(ds[:, :1], -1), ds[:, :-1]], 1)
    q = i - torch.where(ds != prev, i, 0).cummax(1).values  # place among t's slots on d
    return torch.empty_like(q).scatter_(1, order, q)


def send_map_entry(t: int, k: int, e: int, L: int, K: int, C: int) -> int:
    """The flat send_map entry slot (t, k) to expert e went out by (for messages)."""
    return t * C + e // L
