"""unpack in Triton (cpu/unpack.cpp is the specification, byte for byte), and the unpack
*status word*.

The received buffer is the dispatch's chunks, one per source rank s (docs/design.md, "wire
format"). Its data rows are addressed in the row space combine and the backward passes
exchange (compact for ragged, padded and equal; static chunks of ``1 + cap`` rows). The expert
rows are filled in the canonical order: local expert j takes its rows from source ranks in
ascending order, from each in token order, each segment padded to ``offsets[j + 1]``.

Index pass (device-generic torch ops on the device plan and the received bytes, no host
read): pairs' expert row is closed-form (chunk s holds blocks (s, j), j ascending, of the
plan's ``recv_kept[s, j]`` rows; a received row's block is a search in their flat prefix);
dedup's slots, each token row's ``n`` slot rows read into an ``[N, K]`` table, take the next row
of their expert's segment in received order: a stable sort by local expert (rank = position
minus the exclusive cumsum of the counts). The inverse map (each expert row's received row)
then drives ``byterows.write_rows``, which writes every byte of ``expert_x`` once, payload or
zero padding; ``row_src``, ``row_weight`` and ``recv_map`` are gathers through the same maps.
The row space and the maps are shared, here; each slot's expert row is the path's
(``unpack_slots`` of pairs.py, dedup.py).

**The status word.** The C++ kernel raises when the received chunks disagree with the plan
(an in-band count, a slot row, an expert's total); a GPU cannot without a host read. So every
such check sets a bit of this call's status (the bits of the old CUDA kernel: 1 in-band
count, 2 in-band slot count, 4 rows, 8 slot row, 16 expert row, 32 plan shape or sizes, 64
expert total), and a nonzero status writes every output of the call in its "nothing
received" form (``expert_x`` zeros, ``row_src`` -1, ``row_weight`` 0, ``recv_map`` -1: never an
uninitialised row). On CUDA the bits are OR-ed into a sticky per-device word
(:func:`status_word`), which ``epkit.device.check_static`` / ``unpack_status`` read and clear;
``EPKIT_CUDA_CHECKS=1`` makes each CUDA unpack read its own status and raise at once (a host
wait). **On CPU tensors** (the interpreter, ``EPKIT_KERNELS=triton``) the call reads its status
after the launch and raises the C++ kernel's kind of error (``RuntimeError: epkit.unpack:
...``), so the interpreted path behaves as the C++ kernel does; the sticky word is then left
alone. A plan that carries an error on the device (the static exchange's deferred error)
receives nothing and sets no bit (check_static raises the plan's error).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import NamedTuple

import torch

from epkit.reference import abi

from .. import plan as W
from ..plan import host_plan
from . import byterows
from .byterows import read_ints
from .indexmaps import excl, place
from .transports import path_of
from .wirechecks import (ST_EXPERT_ROW, ST_EXPERT_TOTAL, ST_INBAND, ST_ROWS,  # noqa: F401
                         ST_SHAPE, ST_SLOT_ROW, ST_SLOTS, STATUS_BITS, check_dim, check_dtype,
                         check_nonneg, check_plan_chunks, check_plan_header, check_plan_tensor,
                         check_plan_transport, fail, row_bytes, status_bit, status_of)

__all__ = ["unpack", "unpack_with_status", "status_word", "STATUS_BITS"]

byterows.declare("unpack.rows", 0, False)

SLOT = abi.SLOT_ROW_BYTES

_STATUS: dict = {}  # torch.device -> [1] int32, the sticky word of that device


def status_word(device) -> torch.Tensor:
    """The sticky unpack status word of ``device`` (CUDA): ``[1] int32``, the OR of the status
    bits of every unpack there since it was last cleared (by ``epkit.device``). Made (zero) on
    first use: ask for it before a CUDA graph capture that unpacks."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    word = _STATUS.get(dev)
    if word is None:
        word = _STATUS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return word


def describe(bits: int) -> str:
    return "; ".join(text for bit, text in STATUS_BITS.items() if bits & bit)


def _check(recv, plan, transport, H, dtype, K, N, M):
    """checks.h check_unpack_args + check_unpack_plan; returns the plan's host words and the
    transport's path."""
    op = "epkit.unpack"
    check_dim(op, "recv", recv, 1)
    check_dtype(op, "recv", recv, torch.uint8)
    check_plan_tensor(op, plan, recv.device)
    path = path_of(op, transport)
    if not 0 <= H <= (1 << 31) - 1:
        fail(op, f"hidden {H} outside [0, 2^31)")
    if not 0 <= K <= path.MAX_TOPK:
        fail(op, f"topk {K} out of range for transport {transport}")
    check_nonneg(op, "recv_rows", N)
    check_nonneg(op, "expert_rows", M)
    p = host_plan(plan).tolist()
    sl = check_plan_header(op, p, plan.numel())
    P = H * dtype.itemsize
    check_plan_transport(op, p, path)
    if P != p[W.PAYLOAD_BYTES]:
        fail(op, f"rows of {P} payload bytes (hidden * dtype size), the plan says "
                 f"{p[W.PAYLOAD_BYTES]}")
    if M != p[W.EXPERT_ROWS]:
        fail(op, f"expert_rows {M} disagrees with the plan's {p[W.EXPERT_ROWS]}")
    if N != p[W.RECV_ROWS]:
        fail(op, f"recv_rows {N} disagrees with the plan's {p[W.RECV_ROWS]}")
    if recv.numel() != p[W.RECV_BYTES]:
        fail(op, f"received {recv.numel()} bytes, the plan says {p[W.RECV_BYTES]}")
    L, off = p[W.LOCAL_EXPERTS], p[sl["offsets"]]
    if off[0] < 0:
        fail(op, f"plan: offsets[0] = {off[0]}")
    for j in range(L):
        if off[j + 1] < off[j]:
            fail(op, f"plan: offsets decrease at local expert {j}")
    if off[L] > M:
        fail(op, f"plan: offsets end at {off[L]} > expert_rows {M}")
    check_plan_chunks(op, p, sl, True, path, recv.numel())
    return p, path


class RowSpace(NamedTuple):
    """What unpack's shared pass knows of the received rows, for its path's index pass
    (pairs.py, dedup.py): the row space [N] (combine's and the backward passes' rows) and the
    plan's receive words (on the device)."""
    recv: torch.Tensor     # [NB] uint8, the received chunks
    NB: int
    P: int                 # payload bytes of a row
    B: int                 # a first-section row's bytes
    R: int
    L: int
    K: int
    N: int                 # recv_rows
    M: int                 # expert_rows
    hdr: int               # 1: each section opens with its header row (static)
    tokcap: int            # first-section rows of a fixed chunk (-1: ragged)
    ok: torch.Tensor       # 0-d bool: the plan carries no error
    counts: torch.Tensor   # [R] int64: first-section rows from each source
    nslots: torch.Tensor   # [R] int64: slot rows from each source
    kept: torch.Tensor     # [R * L] int64: recv_kept, s-major
    offsets: torch.Tensor  # [L + 1] int64: each local expert's first row
    tpe: torch.Tensor      # [L] int64: tokens_per_expert
    rchunk: torch.Tensor   # [R] int64: each source's chunk's first byte
    r: torch.Tensor        # [N] int64: the rows
    s: torch.Tensor        # [N] int64: each row's source
    g: torch.Tensor        # [N] int64: its data row's index among all data rows
    at: torch.Tensor       # [N] int64: its byte offset in recv
    data: torch.Tensor     # [N] bool: it is a data row, inside the buffer


def _unpack(recv, plan, path, P, K, N, M, p):
    dev = recv.device
    R, E, L = p[W.RANKS], p[W.EXPERTS], p[W.LOCAL_EXPERTS]
    sl = W.plan_slices(R, E)
    B = row_bytes(path, P)
    cap, tokcap = p[W.STATIC_CAP], p[W.TOK_CAP]
    hdr = 1 if cap >= 0 else 0
    NB = recv.numel()
    i64 = dict(dtype=torch.int64, device=dev)

    pl = plan
    counts, nslots = pl[sl["recv_counts"]], pl[sl["recv_slots"]]
    offsets, tpe = pl[sl["offsets"]], pl[sl["tokens_per_expert"]]
    kept = pl[sl["recv_kept"]]  # [R * L], s-major
    ok = pl[W.ERR_CODE] == 0
    rchunk = excl(pl[sl["recv_bytes"]])
    bits = [status_bit(pl[sl["recv_bytes"]].sum() != NB, ST_SHAPE),
            status_bit(pl[W.RECV_BYTES] != NB, ST_SHAPE),
            status_bit(pl[W.RECV_ROWS] != N, ST_SHAPE),
            status_bit(pl[W.EXPERT_ROWS] != M, ST_SHAPE),
            status_bit(offsets[L] > M, ST_SHAPE),
            status_bit(offsets[1:] < offsets[:-1], ST_SHAPE),
            status_bit(offsets[0] < 0, ST_SHAPE)]

    # The row space: each row's source s, its data row i, whether it is one, its bytes.
    r = torch.arange(N, **i64)
    if cap >= 0:
        s, i = r // (1 + cap), r % (1 + cap) - 1
        data = (s < R) & (i >= 0)
        s = s.clamp(max=R - 1)
        data = data & (i < counts[s])
        g = excl(counts)[s] + i  # the data row's index among all data rows
        bits.append(status_bit((counts > 0) & (torch.arange(R, **i64) * (1 + cap) + counts >= N),
                               ST_SHAPE))  # a data row past recv_rows
        bits.append(status_bit(read_ints(recv, rchunk, ok, 8) != counts, ST_INBAND))
    else:
        data = r < counts.sum()
        s = torch.searchsorted(counts.cumsum(0), r, right=True).clamp(max=R - 1)
        i, g = r - excl(counts)[s], r
        bits.append(status_bit(counts.sum() > N, ST_SHAPE))
    at = rchunk[s] + (hdr + i) * B
    bits.append(status_bit(data & (at + B > NB), ST_SHAPE))
    data = data & ok & (at + B <= NB)
    t = read_ints(recv, at + P + abi.PAIRS_META.index("t") * 4, data, 4)

    # Each received slot's expert row comes from the path (a row's one slot, or a token row's
    # n slot rows); the outputs are then the same inverse maps for both.
    rs = RowSpace(recv, NB, P, B, R, L, K, N, M, hdr, tokcap, ok, counts, nslots, kept, offsets,
                  tpe, rchunk, r, s, g, at, data)
    m, live, entry, k, wbits = path.unpack_slots(rs, bits)
    status = torch.where(ok, status_of(bits), 0).to(torch.int32)
    good = status == 0
    C = path.recv_map_cols(K)
    src_slot = torch.where(good, place(M, m, live, torch.arange(N * C, **i64)), -1)
    recv_map = torch.where(good, place(N * C, entry, live, m), -1).view(N, C)
    has, qs = src_slot >= 0, src_slot.clamp(min=0)
    q = qs // max(C, 1)
    src = torch.where(has, q, -1)
    row_src = torch.where(has[:, None], torch.stack([_at(s, q), _at(t, q), _at(k, qs)], 1), -1)
    row_weight = torch.where(has, _at(wbits, qs), 0).to(torch.int32).view(torch.float32)
    return status, src, at, row_src, row_weight, recv_map


def _at(v: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``v[i]`` for indices that are only read where an entry exists: when ``v`` is empty (no
    slots: top-k 0, or no rows received) every such entry is masked, yet padding rows still
    index it (with 0), so an empty ``v`` reads as zeros (a shape decision, no host read)."""
    return v[i] if v.numel() else torch.zeros_like(i, dtype=v.dtype)


def unpack_with_status(recv: torch.Tensor, plan: torch.Tensor, transport: int, hidden: int,
                       dtype: torch.dtype, topk: int, recv_rows: int, expert_rows: int):
    """:func:`unpack`'s outputs and this call's status (a 0-d int32 tensor on recv's device;
    nonzero: the outputs are in their "nothing received" form), raising nothing for the data."""
    M, N, H, K = int(expert_rows), int(recv_rows), int(hidden), int(topk)
    p, path = _check(recv, plan, transport, H, dtype, K, N, M)
    recv = recv.contiguous()
    P = H * dtype.itemsize
    status, src, at, row_src, row_weight, recv_map = _unpack(recv, plan, path, P, K, N, M, p)
    expert_x = torch.empty((M, H), dtype=dtype, device=recv.device)
    src_off = torch.where(src >= 0, at[src.clamp(min=0)], -1) if N else torch.full_like(src, -1)
    out_off = torch.arange(M, dtype=torch.int64, device=recv.device) * P
    # every source offset is a chunk start plus rows of B bytes, every output one of P bytes
    chunks = p[W.plan_slices(p[W.RANKS], p[W.EXPERTS])["recv_bytes"]]
    align = math.gcd(P, row_bytes(path, P), SLOT, *chunks)
    byterows.write_rows(expert_x, out_off, P, recv, src_off, P, align=align)
    return (expert_x, row_src, row_weight, recv_map), status


def unpack(recv: torch.Tensor, plan: torch.Tensor, transport: int, hidden: int,
           dtype: torch.dtype, topk: int, recv_rows: int, expert_rows: int):
    """recv [recv_bytes] uint8, plan [n] int64 -> (expert_x [expert_rows, hidden] dtype,
    row_src [expert_rows, 3] int64 (source rank, token, k; -1 on padding), row_weight
    [expert_rows] float32, recv_map [recv_rows, 1 (pairs) or topk (dedup)] int64).

    A received chunk that disagrees with the plan: on CPU tensors a RuntimeError after the
    launch (what the C++ kernel raises), on CUDA the outputs in their "nothing received" form
    and the bits OR-ed into :func:`status_word` (module docstring)."""
    out, status = unpack_with_status(recv, plan, transport, hidden, dtype, topk, recv_rows,
                                     expert_rows)
    if recv.device.type == "cpu":
        _raise_on_cpu(status)
    else:
        status_word(recv.device).bitwise_or_(status)  # on the stream: no wait
        if os.environ.get("EPKIT_CUDA_CHECKS"):
            bits = int(status)  # a host wait, by request
            if bits:
                raise RuntimeError(f"epkit.unpack: the received chunks disagree with the plan "
                                   f"(status {bits}: {describe(bits)}); the outputs were "
                                   "zero-filled")
    return out


def _raise_on_cpu(status: torch.Tensor) -> None:
    """CPU tensors: read this call's status (host memory, no wait; not a device read, so not
    counted by epkit.hostreads) and raise what the C++ kernel raises."""
    try:
        from ..hostreads import quiet
    except ImportError:
        quiet = contextlib.nullcontext
    with quiet():
        bits = int(status)
    if bits:
        raise RuntimeError(f"epkit.unpack: the received chunks disagree with the plan: "
                           f"{describe(bits)} (status bits {bits:#x})")
