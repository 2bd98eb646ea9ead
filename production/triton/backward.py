"""The backward kernels in Triton (cpu/backward.cpp), bit for bit the C++ kernels' outputs:
combine_backward_dest (the combine backward's expert side), gather_slot_values and
scatter_slot_values (the weight gradients' return path).

The weight gradient ``<g, y>`` is summed in the C++ kernel's 16-lane order (csrc/lanes.h,
cpu/backward.cpp ``weighted_row``): lane i sums the products g_h * y_h of h = i (mod 16) in
ascending h, the tail h >= 16 * (H // 16) goes into lane 0, then ``+0.0 + lane_0 + ... +
lane_15``. A program owns ROWS rows and walks H 16 columns at a time, a [ROWS, 16] tile being
those lanes (64 columns a step where there are, cut into four 16-column chunks added in order;
the tail one more masked tile), so every float32 operation is the C++ kernel's, in its order. The lanes are read
out one at a time by an integer max over their bits (exact: one nonzero candidate), never by a
float reduction.

Rows are kept as integer views (bfloat16 as int16, float32 as int32), converted on the bits
(``bits.py``). Maps out of range are masked (read and write nothing); on CPU tensors the C++
kernel's error is raised too.
"""

from __future__ import annotations

import torch

from . import bits
from . import rowchecks as ck
from ._runtime import INTERPRETED, cdiv, launch, tl, triton, vb16
from .combine import kp, slot_tile
from .inverse import invert
from .transports import path_of

__all__ = ["combine_backward_dest", "gather_slot_values", "scatter_slot_values"]

# Rows per program: the 16-lane walk along H is serial per row, so a program's parallelism is
# ROWS x 16 lanes; the interpreter pays per operation and takes many rows.
ROWS = 64 if INTERPRETED else 8
# the dest kernel's rows at two warps a program: rows that are whole 16-byte pieces (VB = 16)
# take 16 x 64 columns, 16 elements a thread on sm_90 and 8 on gfx942, so a bfloat16 row moves
# 16 bytes an access (8 x 64 at 4 warps: 4 to 8 bytes); other rows ROWS (16 spilled their
# weighted forms on both targets: epkit kernels --compile)
DEST_ROWS_16 = 64 if INTERPRETED else 16
DEST_WARPS = 2  # (not by VB: a launch option the record keys on)


def _iview(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@triton.jit
def _lane(lanes, i: tl.constexpr):
    """Lane i of a [ROWS, 16] float32 tile as a [ROWS] vector, exactly (an unsigned max over
    the bits, the other lanes masked to 0)."""
    sel = tl.arange(0, 16)[None, :] == i
    b = tl.where(sel, lanes.to(tl.uint32, bitcast=True), 0)
    return tl.max(b, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _add_chunks(lanes, p, ROWS: tl.constexpr):
    """lanes + p[:, 0:16] + p[:, 16:32] + p[:, 32:48] + p[:, 48:64], in that order: p [ROWS,
    64] cut into its four 16-column chunks by reshapes, a permute and splits (data movement
    only), so 64 columns cost one pass of wide operations, the adds staying the lanes' own."""
    q = tl.reshape(tl.permute(tl.reshape(p, (ROWS, 4, 16)), (0, 2, 1)), (ROWS, 16, 2, 2))
    even, odd = tl.split(q)  # chunks 2a, 2a + 1 (a = 0, 1)
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return lanes + c0 + c1 + c2 + c3


@triton.jit
def _dest_kernel(recv, src, y, row_weight, grad_y, grad_w, M, H, C,
                 G_BF16: tl.constexpr, Y_BF16: tl.constexpr, WEIGHTED: tl.constexpr,
                 VB: tl.constexpr, ROWS: tl.constexpr):
    """Rows m of grad_y [M, H] (integer view of y's dtype) and grad_w [M] float32: the received
    row n = src[m] // C of recv [N, H] (integer view) times row_weight[m] (weighted), cast to
    y's dtype; grad_w[m] = <g, y[m]> in 16 lanes (weighted, else 0); src[m] < 0: zeros.
    VB: 16 when H is a multiple of 8 and every buffer starts 16-byte aligned (_runtime.vb16),
    told to the compiler so a row moves 16 bytes an access; else 1."""
    if VB == 16:
        H = (H // 8) * 8  # H itself, its divisibility seen
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    s = tl.load(src + rows, mask=rmask, other=-1)
    has = rmask & (s >= 0)
    n = tl.where(has, s // C, 0)
    hm = has[:, None]
    lane16 = tl.arange(0, 16)
    H16 = H // 16 * 16
    if WEIGHTED:
        w = tl.load(row_weight + rows, mask=has, other=0.0)
    lanes = tl.zeros([ROWS, 16], tl.float32)
    H64 = H // 64 * 64
    span = tl.arange(0, 64)
    for h0 in range(0, H64, 64):  # 64 columns a step: four lane steps, in order
        cols = h0 + span
        g = bits.to_f32(tl.load(recv + n[:, None] * H + cols[None, :], mask=hm, other=0), G_BF16)
        if WEIGHTED:
            yv = bits.to_f32(tl.load(y + rows[:, None] * H + cols[None, :], mask=hm, other=0),
                             Y_BF16)
            gy = bits.from_f32(w[:, None] * g, Y_BF16)
            lanes = _add_chunks(lanes, g * yv, ROWS)
        else:
            gy = bits.from_f32(g, Y_BF16)
        tl.store(grad_y + rows[:, None] * H + cols[None, :], tl.where(hm, gy, 0),
                 mask=rmask[:, None])
    for h0 in range(H64, H16, 16):
        cols = h0 + lane16
        g = bits.to_f32(tl.load(recv + n[:, None] * H + cols[None, :], mask=hm, other=0), G_BF16)
        if WEIGHTED:
            yv = bits.to_f32(tl.load(y + rows[:, None] * H + cols[None, :], mask=hm, other=0),
                             Y_BF16)
            gy = bits.from_f32(w[:, None] * g, Y_BF16)
            lanes = lanes + g * yv
        else:
            gy = bits.from_f32(g, Y_BF16)
        tl.store(grad_y + rows[:, None] * H + cols[None, :], tl.where(hm, gy, 0),
                 mask=rmask[:, None])
    # the tail (fewer than 16 columns): one masked tile, its products added into lane 0 in
    # ascending h; a masked column adds +0.0, which changes no bit (lane 0 starts at +0.0, so
    # it is never -0.0, and a NaN stays itself)
    cols = H16 + lane16
    tm = hm & (cols < H)[None, :]
    g = bits.to_f32(tl.load(recv + n[:, None] * H + cols[None, :], mask=tm, other=0), G_BF16)
    if WEIGHTED:
        yv = bits.to_f32(tl.load(y + rows[:, None] * H + cols[None, :], mask=tm, other=0),
                         Y_BF16)
        gy = bits.from_f32(w[:, None] * g, Y_BF16)
        prod = tl.where(tm, g * yv, 0.0)
        lane0 = _lane(lanes, 0)
        for j in tl.static_range(15):
            lane0 = lane0 + _lane(prod, j)
    else:
        gy = bits.from_f32(g, Y_BF16)
    tl.store(grad_y + rows[:, None] * H + cols[None, :], tl.where(hm, gy, 0),
             mask=rmask[:, None] & (cols < H)[None, :])
    if WEIGHTED:
        dot = tl.zeros([ROWS], tl.float32) + lane0
        for i in tl.static_range(1, 16):
            dot = dot + _lane(lanes, i)
        tl.store(grad_w + rows, tl.where(has, dot, 0.0), mask=rmask)
    else:
        tl.store(grad_w + rows, tl.zeros([ROWS], tl.float32), mask=rmask)


def _source_rows(op: str, recv_map: torch.Tensor, M: int) -> torch.Tensor:
    """checks.h source_rows: for each of the M rows, the flat entry of recv_map that names it,
    or -1 (``inverse.invert``: two launches). On CPU, the C++ errors: the first entry (in flat order) outside
    [-1, M) or naming a row named before."""
    flat = recv_map.reshape(-1)
    if ck.on_host(recv_map):
        ok = (flat >= 0) & (flat < M)
        twice = torch.bincount(flat[ok], minlength=M).gt(1).any() if M else torch.tensor(False)
        if bool(twice) or bool((~ok & (flat != -1)).any()):
            seen: dict[int, int] = {}
            for i, m in enumerate(flat.tolist()):
                if m != -1 and not 0 <= m < M:
                    ck.check_map_range(op, "recv_map", recv_map, M, "rows of expert_y")
                if m >= 0 and m in seen:
                    ck.fail(op, f"recv_map entries {seen[m]} and {i} both name row {m} "
                                "(rows of expert_y)")
                seen.setdefault(m, i)
    return invert(flat, M)


def combine_backward_dest(recv: torch.Tensor, recv_map: torch.Tensor, row_weight: torch.Tensor,
                          expert_y: torch.Tensor, weighted: bool):
    """cpu/backward.cpp combine_backward_dest_cpu. recv [N, H] float32 or bfloat16 (grad_out
    rows as the sources sent them), recv_map [N, C] int64 (each expert-major row named at most
    once), row_weight [M] float32 (read when weighted), expert_y [M, H] float32 or bfloat16.
    Returns grad_y [M, H] in y's dtype (cast(c_m * g), zeros for padding rows) and grad_w [M]
    float32 (<g, y[m]> in 16 lanes when weighted, else 0)."""
    op = "epkit.combine_backward_dest"
    ck.check_combine_backward_dest_args(recv, recv_map, row_weight, expert_y, weighted)
    recv, y = recv.contiguous(), expert_y.contiguous()
    recv_map = recv_map.contiguous()
    M, H = y.shape
    src = _source_rows(op, recv_map, M)
    grad_y = torch.empty((M, H), dtype=y.dtype, device=y.device)
    grad_w = torch.empty((M,), dtype=torch.float32, device=y.device)
    w = row_weight.contiguous() if weighted else grad_w  # (unread when unweighted)
    vb = vb16(H, recv, y, grad_y)
    rows = DEST_ROWS_16 if vb == 16 else ROWS
    launch(_dest_kernel, (cdiv(M, rows),), _iview(recv), src, _iview(y), w, _iview(grad_y),
           grad_w, M, H, max(recv_map.shape[1], 1), G_BF16=recv.dtype == torch.bfloat16,
           Y_BF16=y.dtype == torch.bfloat16, WEIGHTED=weighted, VB=vb, ROWS=rows,
           num_warps=DEST_WARPS)
    return grad_y, grad_w


# ---- the weight gradients' return path ----------------------------------------------------------
SLOT_ROWS = 256 if INTERPRETED else 32  # received rows / tokens a program owns


@triton.jit
def _gather_slots_kernel(values, recv_map, first, out, N, C, M, B, CP: tl.constexpr,
                         ROWS: tl.constexpr):
    """out [B] (int32 view of float32, zeroed before): received row n's entries that name a
    row of values [M] (c ascending; -1 entries skipped, other bad ones keep their place) at
    first[n], first[n] + 1, ...; places outside [0, B) are not written."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cs = tl.arange(0, CP)
    rmask = rows < N
    tile = tl.load(recv_map + rows[:, None] * C + cs[None, :],
                   mask=rmask[:, None] & (cs < C)[None, :], other=-1)
    named = tile != -1
    f = tl.load(first + rows, mask=rmask, other=-1)
    at = f[:, None] + tl.cumsum(named.to(tl.int64), axis=1) - 1  # C++: first[n], then ++
    good = (tile >= 0) & (tile < M) & (at >= 0) & (at < B)
    tl.store(out + at, tl.load(values + tile, mask=good, other=0), mask=good)


def gather_slot_values(values: torch.Tensor, recv_map: torch.Tensor, first: torch.Tensor,
                       out_rows: int) -> torch.Tensor:
    """cpu/backward.cpp gather_slot_values_cpu. values [M] float32 (one per expert-major row),
    recv_map [N, C] int64, first [N] int64 -> out [out_rows] float32: received row n's entries
    that name a row (c ascending) at first[n], first[n] + 1, ...; every other place 0. Two
    launches: the zeros, then a program per block of received rows writes its rows' places."""
    op = "epkit.gather_slot_values"
    B = out_rows
    ck.check_gather_slot_values_args(values, recv_map, first, B)
    recv_map, first = recv_map.contiguous(), first.contiguous()
    M = values.numel()
    if ck.on_host(recv_map):  # the C++ errors, where reading them is free
        named = recv_map != -1
        at = first[:, None] + named.cumsum(1) - 1  # C++: at = first[n], then ++ per named entry
        in_map = (recv_map >= 0) & (recv_map < M)
        placed = (at >= 0) & (at < B)
        i = ck.first_bad(named & ~(in_map & placed))
        if i >= 0:
            n, c = divmod(i, recv_map.shape[1])
            if not bool(in_map.reshape(-1)[i]):
                ck.check_map_range(op, "recv_map", recv_map, M, "entries of values")
            ck.fail(op, f"first[{n}] = {int(first[n])} places entry {c} of row {n} at "
                        f"{int(at[n, c])}, outside [0, {B}) (out_rows)")
    out = torch.zeros((B,), dtype=torch.float32, device=values.device)
    N, C = recv_map.shape
    launch(_gather_slots_kernel, (cdiv(N, SLOT_ROWS),), values.contiguous().view(torch.int32),
           recv_map, first, out.view(torch.int32), N, C, M, B,
           CP=max(2, triton.next_power_of_2(C)), ROWS=SLOT_ROWS)
    return out


@triton.jit
def _scatter_slots_kernel(back, send_map, idx, first, out, T, K, C, E, R, L, S, B,
                          TOKEN_ROWS: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr):
    """out [T, K] (int32 view of float32): slot (t, k) to rank d = e / L reads back[first[r] +
    place], r its row (pairs: send_map[t, k], place 0; dedup: send_map[t, d], place = its slots
    on d before it, k ascending); 0 for unused, dropped and misplaced slots."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, KP)
    rmask = rows < T
    tk, ok_e, d, r = slot_tile(idx, send_map, rows, rmask, K, C, E, R, L, TOKEN_ROWS, ROWS, KP)
    ok = ok_e & (r >= 0) & (r < S)
    f = tl.load(first + tl.maximum(r, 0), mask=ok, other=-1)
    place = tl.zeros([ROWS, KP], tl.int64)
    if TOKEN_ROWS:
        for j in range(K):  # slot j precedes the later slots to its rank
            dj = tl.sum(tl.where(ks[None, :] == j, d, 0), axis=1)
            place += ((d == dj[:, None]) & (ks[None, :] > j)).to(tl.int64)
    at = f + place
    ok = ok & (f >= 0) & (at < B)
    tl.store(out + rows[:, None] * K + ks[None, :], tl.load(back + at, mask=ok, other=0),
             mask=tk)


def scatter_slot_values(back: torch.Tensor, send_map: torch.Tensor, topk_idx: torch.Tensor,
                        first: torch.Tensor, num_experts: int, num_ranks: int,
                        transport: int) -> torch.Tensor:
    """cpu/backward.cpp scatter_slot_values_cpu. back [B] float32 (as gather_slot_values laid it
    out), send_map [T, C] int64, topk_idx [T, K] integer (the kept routing), first [S] int64
    -> out [T, K] float32: slot (t, k) to rank d = e / L reads back[first[r] + rank], r =
    send_map[t, k] (pairs, rank 0) or send_map[t, d] (dedup, rank = its place among t's kept
    slots on d, k ascending: from a stable sort by d); 0 for unused and dropped slots."""
    op = "epkit.scatter_slot_values"
    E, R = num_experts, num_ranks
    ck.check_experts_ranks(op, E, R)
    path = path_of(op, transport)
    ck.check_scatter_slot_values_args(back, send_map, topk_idx, first, R, path)
    send_map, first = send_map.contiguous(), first.contiguous()
    T, K = topk_idx.shape
    L, S, B = E // R, first.shape[0], back.shape[0]
    if ck.on_host(back):  # the C++ errors, where reading them is free
        _scatter_errors(op, back, send_map, topk_idx.to(torch.int64), first, E, R, path)
    out = torch.empty((T, K), dtype=torch.float32, device=back.device)
    launch(_scatter_slots_kernel, (cdiv(T, SLOT_ROWS),), back.contiguous().view(torch.int32),
           send_map, topk_idx.contiguous(), first, out.view(torch.int32), T, K,
           send_map.shape[1], E, R, L, S, B, TOKEN_ROWS=path.TOKEN_ROWS, KP=kp(K),
           ROWS=SLOT_ROWS)
    return out


def _scatter_errors(op, back, send_map, idx, first, E, R, path) -> None:
    """scatter_slot_values' C++ errors (the first bad slot in flat order), as torch ops."""
    T, K = idx.shape
    L, S, B = E // R, first.shape[0], back.shape[0]
    ok_e = (idx >= 0) & (idx < E)
    d = torch.where(ok_e, idx // L, R)
    r, rank = path.slot_rows(send_map, d, R), path.slot_places(d)
    ok_r = (r >= 0) & (r < S)
    f = first[r.clamp(0, max(S - 1, 0))] if S > 0 else torch.zeros_like(r)
    at = f + rank
    fits = (f >= 0) & (at < B)
    bad_e = ~ok_e & (idx != -1)
    bad_r = ok_e & ~ok_r & (r != -1)
    j = ck.first_bad(bad_e | bad_r | (ok_e & ok_r & ~fits))
    if j >= 0:
        t, k = divmod(j, K)
        if bool(bad_e.reshape(-1)[j]):
            ck.check_expert_range(op, idx, E)
        if bool(bad_r.reshape(-1)[j]):
            entry = path.send_map_entry(t, k, int(idx[t, k]), L, K, send_map.shape[1])
            ck.fail(op, f"send_map entry {entry} is {int(r[t, k])}, outside [-1, {S}) "
                        "(rows of first)")
        ck.fail(op, f"first[{int(r[t, k])}] = {int(f[t, k])} places slot ({t}, {k}) at "
                    f"{int(at[t, k])}, outside [0, {B}) (rows of back)")
