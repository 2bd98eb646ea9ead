"""Combine's row arithmetic in Triton (cpu/combine.cpp): gather_rows, gather_units (the expert
side) and reduce_tokens (the source side), bit for bit the C++ kernels' outputs.

The order of every float32 sum is the spec's (docs/semantics.md, "Combine"), as the C++ kernel
writes it: per destination rank d a partial ``P = +0.0 + c_0 * r_0 + c_1 * r_1 + ...`` over the
token's slots on d, k ascending (unweighted: no multiply), the partials added over d ascending
into ``total = +0.0 + P + ...`` (ranks_per_node G > 1: into a node partial ``N = +0.0 + P + ...``
per node, each N added into total when the next node opens). Each lane of a tile is one (token,
column) and runs that sequence serially, so the tiling changes no bit.

What differs by transport (which unit holds which row, which steps a token's slots take;
dedup's return path of raw rows and float32 partials) is the path's, pairs.py or dedup.py: the
kernels and the passes here are shared, and ask the path ``transports.path_of`` resolved.

Kernels see every row through an integer view of its dtype (bfloat16 as int16, float32 as
int32, any pairs dtype as the integer of its size): rows are moved as bits, and float32
arithmetic happens on ``bits.to_f32`` / ``bits.from_f32`` of them, never through ``.to()``.

The integer bookkeeping (which unit holds what, each token's slots in (rank, k) order) is a
few device-generic torch ops (stable sort, cumsum, cummax, scatter): no host read, no
data-dependent size. Map entries out of range are masked (read and write nothing); on CPU
tensors the C++ kernel's error is raised too (reading them is free there).
"""

from __future__ import annotations

import math

import torch

from . import bits
from . import rowchecks as ck
from ._runtime import INTERPRETED, cdiv, launch, tl, triton, vb16
from .transports import path_of

__all__ = ["gather_rows", "gather_units", "reduce_tokens"]

# A program owns ROWS rows x BLOCK columns. The interpreter pays per tl.* operation, not per
# element: large tiles there; a GPU takes a few rows per program, a column block each (4 x 128:
# 4 elements a thread, so the reduce's three float32 partials stay in registers; 4 x 256
# spilled on sm_90, epkit kernels --compile).
ROWS = 64 if INTERPRETED else 4
BLOCK = 256 if INTERPRETED else 128
# the reduce's tiles, (ROWS, BLOCK), at two warps a program: it also walks the token's slots
# ([ROWS, KP] tiles). Rows that are whole 16-byte pieces (VB = 16) take 8 x 128: 16 elements a
# thread on sm_90, 8 on gfx942, so a bfloat16 row's loads and stores are 16 bytes; other rows
# take 4 x 32 (more elements a thread spilled there: 4 x 64 at two warps 4 bytes on sm_90, at
# one warp SGPRs on gfx942; epkit kernels --compile). The warps do not follow the data (a
# launch option the record keys on; VB does, SIZE_CONSTEXPRS)
REDUCE_TILE = (64, 256) if INTERPRETED else (4, 32)
REDUCE_TILE_16 = (64, 256) if INTERPRETED else (8, 128)
REDUCE_WARPS = 2
# the units kernel's row tile on a GPU, in bytes: ROWS x 1 KiB is 16 bytes for each thread of
# a program (4 warps of 32 on sm_90, 4 wavefronts of 64 on gfx942: 256 threads), so a thread's
# access can be 16 bytes whatever the element size (BLOCK = 1 KiB / element bytes). Forming
# partials takes two warps (a float32 sum a column: at four, a bfloat16 form spilled on sm_90)
UNITS_ROW_BYTES = 1024
UNITS_PARTIAL_WARPS = 2
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """t (contiguous, 2-D) as the integer dtype of its element size: rows as bits. A 16-byte
    element (complex128) becomes two int64 columns."""
    size = t.element_size()
    return t.view(_INT_OF_SIZE[size]) if size in _INT_OF_SIZE else t.view(torch.int64)


# ---- the expert side -----------------------------------------------------------------------
@triton.jit
def _units_kernel(y, umap, recv_map, row_weight, out, U, H, M, C, US,
                  PARTIAL: tl.constexpr, PER: tl.constexpr, BF16: tl.constexpr,
                  WEIGHTED: tl.constexpr, ES: tl.constexpr, VB: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out [U, H] (the units, integer view) from umap [U] int64 (stride US: pairs reads
    recv_map's column in place): m in [0, M), the unit is y's row m (bits); -1 or out of range,
    zeros (padding, gaps, a raw token row's unused units); -2 - (n * PER + j) (PARTIAL), unit
    j of token row n's float32 partial (its bytes j H .. (j + 1) H of y's dtype), the partial
    formed here from recv_map [N, C] row n, c ascending. ES: y's element bytes; VB: the bytes
    H * ES and both buffers' starts are multiples of (up to 16), told to the compiler so a row
    moves VB bytes an access."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    H = (H // (VB // ES)) * (VB // ES)  # H itself (VB // ES divides it), its divisibility seen
    rmask = rows < U
    cmask = (cols // (VB // ES)) < (H // (VB // ES))  # constant over a vector
    src = tl.load(umap + rows * US, mask=rmask, other=-1)
    src = tl.where(src < M, src, -1)
    raw = rmask & (src >= 0)
    v = tl.load(y + src[:, None] * H + cols[None, :], mask=raw[:, None] & cmask[None, :], other=0)
    if PARTIAL:
        part = rmask & (src <= -2)
        if tl.max(part.to(tl.int32), axis=0) > 0:  # a tile of raw rows skips the slot loop
            code = -2 - src
            n = code // PER
            q = (code % PER)[:, None] * H + cols[None, :]  # element of the 4H-byte row
            f = q // PER                                     # the float32 it lies in
            pm = part[:, None] & cmask[None, :]
            acc = tl.zeros([ROWS, BLOCK], tl.float32)
            for c in range(C):
                m = tl.load(recv_map + n * C + c, mask=part, other=-1)
                kept = part & (m >= 0) & (m < M)
                km = kept[:, None] & cmask[None, :]
                yv = bits.to_f32(tl.load(y + m[:, None] * H + f, mask=km, other=0), BF16)
                if WEIGHTED:
                    w = tl.load(row_weight + m, mask=kept, other=0.0)
                    yv = w[:, None] * yv
                acc = tl.where(km, acc + yv, acc)
            # C++ stores +0.0 + P: P's bits (P is never -0.0, and a NaN in P is already quiet)
            b = acc.to(tl.uint32, bitcast=True)
            if PER == 2:  # the little-endian half of the float this bfloat16 unit column holds
                pv = ((b >> ((q & 1) * 16).to(tl.uint32)) & 0xFFFF).to(tl.uint16)
                pv = pv.to(tl.int16, bitcast=True)
            else:
                pv = b.to(tl.int32, bitcast=True)
            v = tl.where(pm, pv, v)
    tl.store(out + rows[:, None] * H + cols[None, :], v, mask=rmask[:, None] & cmask[None, :])


def _gather_path(op, y, recv_map, row_weight, transport, weighted):
    """The checks both expert-side ops open with (checks.h's order); returns the path."""
    ck.check_expert_side(op, y, recv_map)
    path = path_of(op, transport)
    path.check_gather(op, y, recv_map, row_weight, weighted)
    return path


def _gather(op, y, recv_map, row_weight, path, weighted, first, out):
    """The pass both expert-side ops share: out (contiguous; pairs [N, H] in y's dtype, dedup
    [U, H] units of y's dtype as their integer view) written whole, from the path's units."""
    y = y.contiguous()
    recv_map = recv_map.contiguous()
    N = recv_map.shape[0]
    M = y.shape[0]
    per = path.units_per_row(y.element_size())
    U = out.shape[0] if first is not None else N * per
    umap = path.unit_map(op, recv_map, M, per, first.contiguous() if first is not None else None,
                         U)
    units(y, umap, recv_map, row_weight, path.TOKEN_ROWS, weighted, out)


def units(y, umap, recv_map, row_weight, partial: bool, weighted: bool, out) -> None:
    """The units kernel's launch: out [U, H] (y's dtype, contiguous) from umap [U] int64
    (``_units_kernel``); ``partial``: token rows (dedup), whose float32 partials are formed
    from recv_map [N, C] (weighted by row_weight [M] float32). The expert side of the return
    path calls it directly with the map ``places.row_places`` made (no checks: its own
    arguments)."""
    y = y.contiguous()
    recv_map = recv_map.contiguous()
    yi = int_view(y)
    M, U = y.shape[0], umap.shape[0]
    per = 4 // y.element_size() if partial else 1
    # token rows sum their slots into float32 partials (weighted there); slot rows are copied
    w = row_weight.contiguous() if partial and weighted else yi  # (unread otherwise)
    oi = out.view(yi.dtype).view(U, yi.shape[1])
    es = yi.element_size()
    vb = math.gcd(16, yi.shape[1] * es, yi.data_ptr(), oi.data_ptr())
    block = BLOCK if INTERPRETED else UNITS_ROW_BYTES // es
    launch(_units_kernel, (cdiv(U, ROWS), cdiv(yi.shape[1], block)), yi, umap, recv_map, w, oi,
           U, yi.shape[1], M, recv_map.shape[1], umap.stride(0), PARTIAL=partial, PER=per,
           BF16=partial and y.dtype == torch.bfloat16, WEIGHTED=partial and weighted, ES=es,
           VB=vb, ROWS=ROWS, BLOCK=block, num_warps=UNITS_PARTIAL_WARPS if partial else 4)


def gather_rows(expert_y: torch.Tensor, recv_map: torch.Tensor, row_weight: torch.Tensor,
                transport: int, weighted: bool) -> torch.Tensor:
    """The expert side's rows for the return path (cpu/combine.cpp gather_rows_cpu).

    expert_y [M, H] (pairs: any dtype; dedup: float32 or bfloat16), recv_map [N, C] int64
    (pairs: C = 1), row_weight [M] float32 (read when dedup and weighted). Returns pairs: [N, H]
    in y's dtype, row n = y[recv_map[n, 0]] (zeros for -1); dedup: [N, H] float32, token row n's
    4H bytes: its n kept rows of y (c order) when n <= per, the unused bytes zero, else its
    float32 partial (weighted by row_weight when weighted)."""
    op = "epkit.gather_rows"
    path = _gather_path(op, expert_y, recv_map, row_weight, transport, weighted)
    N, H = recv_map.shape[0], expert_y.shape[1]
    out = torch.empty((N, H), dtype=path.back_dtype(expert_y.dtype), device=expert_y.device)
    _gather(op, expert_y, recv_map, row_weight, path, weighted, None, out)
    return out


def gather_units(expert_y: torch.Tensor, recv_map: torch.Tensor, row_weight: torch.Tensor,
                 transport: int, weighted: bool, first: torch.Tensor | None,
                 out: torch.Tensor) -> None:
    """gather_rows written into out (the exchange's send buffer), cpu/combine.cpp
    gather_units_cpu. out [N, H] (pairs) or [units, H] (dedup), y's dtype, contiguous; dedup
    places token row n's min(n, per) units at first [N] int64 (unit first[n] on); units no row
    places (gaps) are written zero."""
    op = "epkit.gather_units"
    path = _gather_path(op, expert_y, recv_map, row_weight, transport, weighted)
    ck.check_units_out(op, out, expert_y)
    path.check_units(op, recv_map, first, out, expert_y)
    _gather(op, expert_y, recv_map, row_weight, path, weighted, first, out)


# ---- the source side -----------------------------------------------------------------------
@triton.jit
def slot_tile(idx, send_map, rows, rmask, K, C, E, R, L, TOKEN_ROWS: tl.constexpr,
              ROWS: tl.constexpr, KP: tl.constexpr):
    """The slots of tokens ``rows`` as [ROWS, KP] tiles: (in range, expert in [0, E), rank d
    (R: none), the row each went out in: pairs send_map[t, k], dedup send_map[t, d] (-1:
    none)); idx [T, K] any integer dtype, send_map [T, C] int64."""
    ks = tl.arange(0, KP)
    tk = rmask[:, None] & (ks < K)[None, :]
    e = tl.load(idx + rows[:, None] * K + ks[None, :], mask=tk, other=-1).to(tl.int64)
    ok_e = tk & (e >= 0) & (e < E)
    d = tl.where(ok_e, e // L, R)
    if TOKEN_ROWS:
        col = tl.minimum(d, R - 1)
    else:
        col = ks[None, :].to(tl.int64) + tl.zeros([ROWS, KP], tl.int64)
    r = tl.load(send_map + rows[:, None] * C + col, mask=ok_e, other=-1)
    return tk, ok_e, d, r


@triton.jit
def _reduce_kernel(back, send_map, idx, w, first, out, T, H, K, C, E, R, L, G, S, U,
                   TOKEN_ROWS: tl.constexpr, COMPACT: tl.constexpr, PER: tl.constexpr,
                   BACK_BF16: tl.constexpr, OUT_BF16: tl.constexpr, WEIGHTED: tl.constexpr,
                   GROUPED: tl.constexpr, KP: tl.constexpr, VB: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out [T, H] (integer view of out_dtype): each token's sum over its used slots in (rank,
    k) order, the steps found here from its routing (no bookkeeping launched before it).

    idx [T, K] (the kept routing: dropped slots -1), send_map [T, C] int64 (pairs: C = K, a
    slot's row; dedup: C = R, the token row to each rank), w [T, K] float32 (read when
    WEIGHTED), first [S] int64 (dedup COMPACT: token row r's units at first[r]; else r * PER),
    back [U, H] (integer view). A slot is used when its expert is in [0, E) and its row in [0,
    S). Step i takes the token's i-th used slot in (rank d, k) order: the smallest key d * KP +
    k above the last one (an integer min over the token's slots: order-free). pairs: the slot
    adds its row. dedup: a group of n used slots to one rank shares its token row; n <= PER:
    each adds its own unit (first + place in the group), else the group's first slot takes its
    float32 partial. The group's last slot flushes the partial into the total (or the node
    partial, GROUPED: nodes of G ranks). A group whose units lie outside back's U adds
    nothing (the C++ kernel raises; on the device path it is masked). VB: 16 when H is a
    multiple of 8 and both buffers start 16-byte aligned (a row is then whole 16-byte pieces in
    either element size), told to the compiler; else 1."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, KP)
    rmask = rows < T
    if VB == 16:
        H = (H // 8) * 8  # H itself, its divisibility seen
        cmask = (cols // 8) < (H // 8)  # constant over a vector
    else:
        cmask = cols < H
    tk, ok_e, d, r = slot_tile(idx, send_map, rows, rmask, K, C, E, R, L, TOKEN_ROWS, ROWS, KP)
    used = ok_e & (r >= 0) & (r < S)
    NONE = (R + 1) * KP  # above every used key
    key = tl.where(used, d * KP + ks[None, :], NONE)
    cur = tl.min(key, axis=1)
    part = tl.zeros([ROWS, BLOCK], tl.float32)
    node = tl.zeros([ROWS, BLOCK], tl.float32)
    total = tl.zeros([ROWS, BLOCK], tl.float32)
    open_node = tl.full([ROWS], -1, tl.int64)
    prev_d = tl.full([ROWS], -1, tl.int64)
    q = tl.zeros([ROWS], tl.int64)
    for i in range(K):
        on = rmask & (cur < NONE)
        kc = cur % KP
        dc = cur // KP
        nxt = tl.min(tl.where(key > cur[:, None], key, NONE), axis=1)
        last = on & ((nxt >= NONE) | (nxt // KP != dc))
        start = on & (dc != prev_d)
        q = tl.where(start, 0, q + 1)
        this = ks[None, :] == kc[:, None]
        rs = tl.sum(tl.where(this, r, 0), axis=1)  # the slot's row (an integer sum of one)
        if TOKEN_ROWS:
            n = tl.sum((used & (d == dc[:, None])).to(tl.int64), axis=1)
            r0 = tl.minimum(tl.maximum(rs, 0), tl.maximum(S - 1, 0))
            if COMPACT:
                at0 = tl.load(first + r0, mask=on, other=0)  # (S = 0: no slot is on)
            else:
                at0 = r0 * PER
            fits = (at0 >= 0) & (at0 + tl.minimum(n, PER) <= U)
            add = on & fits & (n <= PER)
            take = on & fits & (n > PER) & (q == 0)
            un = tl.where(add, at0 + q, at0)
        else:
            add = on
            un = rs
        am = add[:, None] & cmask[None, :]
        v = bits.to_f32(tl.load(back + un[:, None] * H + cols[None, :], mask=am, other=0),
                        BACK_BF16)
        if WEIGHTED:
            v = tl.load(w + rows * K + kc, mask=add, other=0.0)[:, None] * v
        part = tl.where(am, part + v, part)
        if TOKEN_ROWS:
            pm = take[:, None] & cmask[None, :]
            if BACK_BF16:  # a partial spans 2 units and may start at an odd element: two halves
                el = back + un[:, None] * H + 2 * cols[None, :]
                lo = tl.load(el, mask=pm, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
                hi = tl.load(el + 1, mask=pm, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
                pv = (lo | (hi << 16)).to(tl.float32, bitcast=True)
            else:
                pv = tl.load(back + un[:, None] * H + cols[None, :], mask=pm, other=0)
                pv = pv.to(tl.float32, bitcast=True)
            part = tl.where(pm, pv, part)
        fm = last[:, None]
        if GROUPED:  # N = +0.0 + P + ... per node, added into total when the next node opens
            nd = dc // G
            opens = last & (nd != open_node)
            total = tl.where((opens & (open_node >= 0))[:, None], total + node, total)
            node = tl.where(opens[:, None], 0.0, node)
            open_node = tl.where(opens, nd, open_node)
            node = tl.where(fm, node + part, node)
        else:
            total = tl.where(fm, total + part, total)
        part = tl.where(fm, 0.0, part)
        prev_d = tl.where(on, dc, prev_d)
        cur = nxt
    if GROUPED:
        total = tl.where((open_node >= 0)[:, None], total + node, total)
    tl.store(out + rows[:, None] * H + cols[None, :], bits.from_f32(total, OUT_BF16),
             mask=rmask[:, None] & cmask[None, :])


def _steps(send_map, idx, E, R, path, per, first, S, U):
    """What the C++ kernel raises for, per slot [T, K]: (bad, bad_first), from each token's
    slots in (rank, k) order (a stable sort by rank) as the kernel walks them. Torch ops, run
    only where reading them is free (a CPU tensor off the device path): the kernel itself
    masks these slots."""
    T, K = idx.shape
    dev = idx.device
    L = E // R
    ok_e = (idx >= 0) & (idx < E)
    d = torch.where(ok_e, idx // L, R)
    r = path.slot_rows(send_map, d, R)
    ok_r = (r >= 0) & (r < S)
    used = ok_e & ok_r
    bad = (idx >= E) | path.bad_rows(idx, ok_e, ok_r, r, send_map)
    ds, order = torch.sort(torch.where(used, d, R), dim=1, stable=True)
    on = ds < R
    i = torch.arange(K, device=dev).expand(T, K)
    prev = torch.cat([torch.full_like(ds[:, :1], -1), ds[:, :-1]], 1)
    nxt = torch.cat([ds[:, 1:], torch.full_like(ds[:, :1], -1)], 1)
    start, last = on & (ds != prev), on & (ds != nxt)
    rs = torch.gather(r, 1, order)
    _, _, _, bad_first = path.reduce_units(rs, on, start, last, i, first, per, S, U)
    return bad, bad_first


def reduce_tokens(back: torch.Tensor, send_map: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, num_experts: int, num_ranks: int, transport: int,
                  weighted: bool, out_dtype: torch.dtype, ranks_per_node: int = 1,
                  first: torch.Tensor | None = None) -> torch.Tensor:
    """The source side's sum (cpu/combine.cpp reduce_tokens_cpu): out [T, H] out_dtype, one
    launch on the device path.

    back: pairs [S, H] (a slot's row of y), dedup [U, H] with first [S] int64 (token row r's
    units at first[r]) or [S, per * H] without (at r * per), float32 or bfloat16; send_map
    [T, C] int64 (pairs C = K: a slot's row; dedup C = R: a token row per rank); topk_idx
    [T, K] integer (the kept routing: dropped slots -1); topk_weights [T, K] float32 (read when
    weighted)."""
    E, R, G = num_experts, num_ranks, ranks_per_node
    op = "epkit.reduce_tokens"
    ck.check_reduce_options(op, E, R, G)
    path = path_of(op, transport)
    ck.check_reduce_tokens_args(back, send_map, topk_idx, topk_weights, R, path, weighted,
                                out_dtype, first)
    back = back.contiguous()
    send_map = send_map.contiguous()
    idx = topk_idx.contiguous()
    compact = first is not None
    first = first.contiguous() if compact else None
    per = path.units_per_row(back.element_size())  # pairs: 1, a row per slot
    H = back.shape[1] if compact else back.shape[1] // per
    S = first.shape[0] if compact else back.shape[0]
    U = back.shape[0] if compact else S * per
    T, K = idx.shape
    if ck.on_host(back):
        bad, bad_first = _steps(send_map, idx.to(torch.int64), E, R, path, per, first, S, U)
        if bool((bad | bad_first).any()):
            ck.check_map_range(op, "send_map", send_map, S, "rows of back")
            ck.check_expert_range(op, idx, E)
            if bool(bad_first.any()):
                ck.fail(op, f"a token row whose units lie outside back's {U} units (first "
                            "names a unit out of range)")
            ck.fail(op, path.UNMATCHED_SLOT)
    w = topk_weights.contiguous() if weighted else out_dummy(back)  # (unread unweighted)
    out = torch.empty((T, H), dtype=out_dtype, device=back.device)
    vb = vb16(H, back, out)
    rows, block = REDUCE_TILE_16 if vb == 16 else REDUCE_TILE
    launch(_reduce_kernel, (cdiv(T, rows), cdiv(H, block)), int_view(back).view(U, H),
           send_map, idx, w, first if compact else send_map, int_view(out), T, H, K,
           send_map.shape[1], E, R, E // R, G, S, U, TOKEN_ROWS=path.TOKEN_ROWS,
           COMPACT=compact, PER=per, BACK_BF16=back.dtype == torch.bfloat16,
           OUT_BF16=out_dtype == torch.bfloat16, WEIGHTED=weighted, GROUPED=G > 1,
           KP=kp(K), VB=vb, ROWS=rows, BLOCK=block, num_warps=REDUCE_WARPS)
    return out


def out_dummy(t: torch.Tensor) -> torch.Tensor:
    """A float32 pointer the kernel never reads (one launch form for unweighted sums)."""
    return torch.empty(1, dtype=torch.float32, device=t.device)


def kp(K: int) -> int:
    """The slot tile of a token: K rounded up to a power of two (at least 2)."""
    return max(2, triton.next_power_of_2(max(K, 1)))
