"""The pairs path of the Triton kernels (transport code 0): a row travels per kept slot, ``payload
| int32 t | int32 k | int32 j | float32 w``, and comes back as that slot's row of expert_y.

One module per transport path, as DeepEP splits its kernels into intranode and internode ones:
what pack, unpack, combine and the backward passes do differently for pairs is here, behind the
interface dedup.py has too (transports.py lists it); the per-op modules hold what both paths
share and ask the path ``transports.path_of`` resolved for the rest. Where pairs has nothing to
do (no slot section, no unit places), its function does nothing or its constant says so.
"""

from __future__ import annotations

import torch

from epkit.reference import abi

from . import rowchecks as ck
from .byterows import read_ints
from .indexmaps import excl, place, take
from .wirechecks import ST_EXPERT_ROW, ST_ROWS, status_bit

NAME = "pairs"
CODE = abi.TRANSPORT_CODES[NAME]
META_BYTES = abi.PAIRS_META_BYTES
TOKEN_ROWS = False   # a row per kept slot, not per (token, destination rank)
SLOT_SECTIONS = 0    # the slot itself travels in the row: a chunk has no slot section
MAX_TOPK = (1 << 31) - 1   # k travels as an int32
MAX_LOCAL = (1 << 31) - 1  # and j
SEND_MAP = "pairs: one column per slot"
# what cpu/combine.cpp raises for a slot whose row does not match its routing
UNMATCHED_SLOT = "send_map sends a slot whose topk_idx is -1"


def send_map_cols(K: int, R: int) -> int:
    return K


def recv_map_cols(K: int) -> int:
    return 1


def back_dtype(y_dtype: torch.dtype) -> torch.dtype:
    """The return path carries a slot's row of expert_y as it is."""
    return y_dtype


def units_per_row(itemsize: int) -> int:
    """Units of the return path per row: the row itself."""
    return 1


# ---- argument checks (checks.h, where it asks the transport) ---------------------------------
def check_pack_topk(op, K: int) -> None:
    """k travels as an int32: any topk a tensor has fits."""


def check_local_experts(op, L: int) -> None:
    """j travels as an int32: the plan header's bound on the experts (MAX_LOCAL) is the
    bound."""


def check_gather(op, y, recv_map, row_weight, weighted) -> None:
    """gather_rows / gather_units after the transport: one slot per received row (any dtype,
    unweighted: the weights are applied at the source)."""
    ck.check_size(op, "recv_map", recv_map, 1, 1, "pairs: one slot per row")


def check_units(op, recv_map, first, out, y) -> None:
    """gather_units' placement: a row per received row, no unit places."""
    if first is not None:
        ck.fail(op, "pairs' rows are placed one per row (no first)")
    ck.check_size(op, "out", out, 0, recv_map.shape[0], "pairs: rows of recv_map")


def check_first(op, first, rows, what, dev) -> None:
    if first is not None:
        ck.fail(op, "first (the return path's unit places) is dedup's only")


def check_back(op, back, first) -> None:
    """back's rows are expert_y's rows: any width."""


# ---- pack ------------------------------------------------------------------------------------
def pack_rows(ix):
    """The first section's rows, one per kept slot, from pack's index pass ``ix`` (pack.Slots):
    (send_map [T, K] int64, each row's token [QA] int64 (-1: no row), meta [QA, 4] int32)."""
    own_start = excl(ix.own)
    i = own_start[ix.e] + ix.rank - own_start[ix.d * ix.L]  # index in chunk d
    kept = ix.kept & (i >= 0) & (i < ix.counts[ix.d])
    send_map = torch.where(kept, ix.row_of(ix.d, i), -1).view(ix.T, ix.K)
    src = place(ix.QA, ix.baseA[ix.d] + ix.hdr + i, kept, ix.slot)
    has, s = src >= 0, src.clamp(min=0)
    words = torch.stack([take(v, s) for v in (ix.t, ix.k, ix.j, ix.wbits)], 1)
    meta = torch.where(has[:, None], words, 0).to(torch.int32)
    return send_map, torch.where(has, take(ix.t, s), -1), meta


def pack_slots(ix) -> None:
    """No slot section: the slot travelled in its row."""


# ---- unpack ----------------------------------------------------------------------------------
def unpack_slots(rs, bits: list):
    """Each received row's one slot, from unpack's row space ``rs`` (unpack.RowSpace): its
    expert row from the plan's kept blocks (recv_kept, s-major, each block's rows in order).
    Appends its status bits to ``bits``; returns per slot [N]: (expert row m, live, its
    recv_map entry's flat place, k, the weight's bits)."""
    R, L = rs.R, rs.L
    k, wbits = (read_ints(rs.recv, rs.at + rs.P + abi.PAIRS_META.index(f) * 4, rs.data, 4)
                for f in ("k", "w"))
    kept = rs.kept
    ends = kept.cumsum(0)  # flat prefix of the blocks (s, j)
    bits.append(status_bit((kept < 0) | (ends[-1] != rs.counts.sum()), ST_ROWS))
    blk = torch.searchsorted(ends, rs.g, right=True)
    inb = blk < R * L
    blk = blk.clamp(max=R * L - 1)
    base = (rs.offsets[:L][None, :] + excl(kept.view(R, L))).reshape(-1)  # block's first row
    bits.append(status_bit((base + kept).view(R, L) > rs.offsets[1:][None, :], ST_EXPERT_ROW))
    m = base[blk] + rs.g - (ends[blk] - kept[blk])
    live = rs.data & inb & (m >= 0) & (m < rs.M)
    bits.append(status_bit(rs.data & ~live & rs.ok, ST_ROWS))
    return m, live, rs.r, k, wbits


# ---- combine and the backward passes ---------------------------------------------------------
def unit_map(op, recv_map, M: int, per: int, first, U: int) -> torch.Tensor:
    """The expert side's units [N]: received row n is expert row recv_map[n, 0] (out of
    range: zeros, the kernel masks), a strided view of recv_map (nothing launched)."""
    if ck.on_host(recv_map):
        ck.check_map_range(op, "recv_map", recv_map, M, "rows of expert_y")
    return recv_map[:, 0]


def slot_rows(send_map, d, R: int) -> torch.Tensor:
    """The row each slot [T, K] went out in: its own column of send_map."""
    return send_map


def bad_rows(idx, ok_e, ok_r, r, send_map) -> torch.Tensor:
    """The slots cpu/combine.cpp raises for besides an expert >= E: a used slot's row outside
    [-1, S), a row sent for an unused slot."""
    return (ok_e & ~ok_r & (r != -1)) | ((idx < 0) & (send_map != -1))


def reduce_units(rows, on, start, last, i, first, per: int, S: int, U: int):
    """The source side's steps from each slot's row ``rows`` [T, K] (in the token's (rank, k)
    order, ``on``: used): each used slot adds its own row. Returns (unit, add, part,
    bad_first) [T, K]."""
    none = torch.zeros_like(on)
    return rows, on, none, none


def slot_places(d) -> torch.Tensor:
    """Each slot's place after its row's first value (scatter_slot_values): its row holds it
    alone."""
    return torch.zeros_like(d)


def send_map_entry(t: int, k: int, e: int, L: int, K: int, C: int) -> int:
    """The flat send_map entry slot (t, k) to expert e went out by (for messages)."""
    return t * K + k
