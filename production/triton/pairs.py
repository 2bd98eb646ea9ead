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

from . import rowchecks as ck
from ..transports.pairs import PAIRS as ROW
from .abi import PLAN_ERR_CODE
from ._runtime import INTERPRETED, cdiv, launch, tl, triton
from .sections import PAIRS_ROW, excl_at, section_rows

# The transport's facts are its row's (production/transports/pairs.py), not retyped here.
NAME, CODE, META_BYTES = ROW.name, ROW.code, ROW.meta_bytes
TOKEN_ROWS = ROW.rows_hold_many_slots  # False: a row per kept slot
send_map_cols, recv_map_cols, back_dtype = ROW.send_map_cols, ROW.recv_map_cols, ROW.back_dtype
SLOT_SECTIONS = 0    # the slot itself travels in the row: a chunk has no slot section
ROW_SLOT = True      # the row's metadata is its one slot: unpack's row space finds its expert row
MAX_TOPK = (1 << 31) - 1   # k travels as an int32
MAX_LOCAL = (1 << 31) - 1  # and j
SEND_MAP = "pairs: one column per slot"
# what cpu/combine.cpp raises for a slot whose row does not match its routing
UNMATCHED_SLOT = "send_map sends a slot whose topk_idx is -1"


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
@triton.jit
def _slots_kernel(idx, rank, plan, send_map, src, TK, E, L, R, CAP, TOKCAP, QA, o_own,
                  o_counts, BLOCK: tl.constexpr):
    """Slots q [pid * BLOCK, +BLOCK) of the flattened routing: whether each is sent (it names
    an expert e, its rank among this rank's slots to e is below own_kept[e], the plan carries
    no error) and where: row i of chunk d = e // L, i = its rank plus the kept slots of the
    experts before e on d (own_kept's prefix); send_map[q] its row in the row space (static
    d * (1 + cap) + 1 + i, ragged the rows of the chunks before plus i), -1 if not sent; and
    src[first-section row] = q (src filled with -1 by the ranks' launch)."""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < TK
    e = tl.load(idx + q, mask=inq, other=-1)
    valid = inq & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    d = e // L
    ok = (tl.zeros([BLOCK], tl.int64) + tl.load(plan + PLAN_ERR_CODE)) == 0  # a tile (interpreter)
    r = tl.load(rank + q, mask=inq, other=0)
    kept = valid & ok & (r < tl.load(plan + o_own + e, mask=valid, other=0))
    i = excl_at(plan, o_own, E, e, inq) + r - excl_at(plan, o_own, E, d * L, inq)
    count = tl.load(plan + o_counts + d, mask=valid, other=0)
    kept = kept & (i >= 0) & (i < count)
    before = excl_at(plan, o_counts, R, d, inq)  # rows of the chunks before d
    static = (tl.zeros([BLOCK], tl.int64) + CAP) >= 0
    row = tl.where(static, d * (1 + CAP) + 1 + i, before + i)
    tl.store(send_map + q, tl.where(kept, row, -1), mask=inq)
    # chunk d's first row among the first section's QA: the chunks before, fixed (the cap)
    # or ragged (their counts), then the header row (static)
    at = tl.where(TOKCAP >= 0, d * TOKCAP, before) + static.to(tl.int64) + i
    tl.store(src + at, q, mask=kept & (at >= 0) & (at < QA))


BLOCK = 4096 if INTERPRETED else 256  # slots a program of the slots' launch


def pack_rows(ix):
    """The first section's rows, one per kept slot, from pack's index pass ``ix`` (pack.Slots),
    in two launches (the slots', then the rows': sections.py): (send_map [T, K] int64, the
    rows' byte offsets [QA], their payloads' source offsets [QA] (-1: zeros), meta [QA, 4]
    int32, the header values [QA] int64 or None)."""
    idx, pv, QA = ix.routing.idx, ix.plan, ix.buffer.first_rows
    TK = idx.numel()
    send_map = torch.empty(TK, dtype=torch.int64, device=idx.device)
    if TK:
        launch(_slots_kernel, (cdiv(TK, BLOCK),), idx, ix.slot_rank, pv.tensor, send_map,
               ix.first_fill, TK, pv.experts, pv.local_experts, pv.ranks, pv.static_cap,
               pv.token_cap, QA, pv.start("own_kept"), pv.start("send_counts"), BLOCK=BLOCK)
    rows = section_rows(ix, PAIRS_ROW, ix.first_fill, QA, ix.buffer.row_bytes, "send_counts",
                        pv.token_cap)
    return (send_map.view(ix.routing.tokens, ix.routing.topk), *rows)


def pack_slots(ix) -> None:
    """No slot section: the slot travelled in its row."""


# ---- unpack ----------------------------------------------------------------------------------
def unpack_slots(rs):
    """Each received row's one slot: unpack's row space launch found its expert row (``rs``,
    unpack.RowSpace; rowspace.py, ROW_SLOT) and set its status bits. Returns per slot [N]:
    (expert row m, live, None: its recv_map entry is its row, k, the weight's bits) and no
    status words of its own (an empty int32 tensor)."""
    r = rs.rows
    return (r.slot_row, r.live, None, r.slot_k, r.weight_bits,
            r.slot_k.new_empty(0, dtype=torch.int32))


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
