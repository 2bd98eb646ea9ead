"""unpack in Triton (cpu/unpack.cpp is the specification, byte for byte), and the unpack
*status word*.

The received buffer is the dispatch's chunks, one per source rank s (docs/design.md, "wire
format"). Its data rows are addressed in the row space combine and the backward passes
exchange (compact for ragged, padded and equal; static chunks of ``1 + cap`` rows). The expert
rows are filled in the canonical order: local expert j takes its rows from source ranks in
ascending order, from each in token order, each segment padded to ``offsets[j + 1]``.

Index pass, no host read, three launches: the row space (rowspace.py: each received row's
source, byte offset, data flag and token from the plan's words, every status bit, and pairs'
slot, whose expert row is closed-form: chunk s holds blocks (s, j), j ascending, of the plan's
``recv_kept[s, j]`` rows, a row's block a search in their flat prefix); the path's slots where
they travel apart (dedup: each token row's ``n`` slot rows read into an ``[N, K]`` table take the
next row of their expert's segment in received order, a stable sort by local expert, as torch
ops); the maps launch (each expert row's received slot, each recv_map entry); the outputs
launch (the call's status from the programs' words, then ``row_src``, ``row_weight`` and the
rows' byte offsets through the maps). ``byterows.write_rows`` then writes every byte of
``expert_x`` once, payload or zero padding.

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
from typing import NamedTuple, Optional

import torch

from epkit.reference import abi

from .. import plan as W
from ..plan import host_words
from . import byterows, rowspace
from .planview import PlanView
from ._runtime import INTERPRETED, cdiv, launch, tl, triton
from .abi import PLAN_ERR_CODE
from .transports import PATHS
from .wirechecks import (STATUS_BITS, check_nonneg, check_plan_chunks, check_plan_header,
                         check_plan_transport, check_unpack_args, fail, row_bytes)

__all__ = ["unpack", "unpack_with_status", "status_word", "STATUS_BITS"]


SLOT = abi.SLOT_ROW_BYTES
# row_src [M, 3] int64: each expert row's source rank, token and slot (its columns)
ROW_SRC_COLS = tl.constexpr(3)
ROW_SRC_S, ROW_SRC_T, ROW_SRC_K = (tl.constexpr(c) for c in range(3))

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


def _check(recv, plan, transport, H, dtype, K, N, M, plan_host):
    """checks.h check_unpack_args + check_unpack_plan; returns the plan's host words and the
    transport's path."""
    op = "epkit.unpack"
    check_unpack_args(recv, plan, transport, H, plan_host)  # the fake's checks too
    path = PATHS[transport]
    if not 0 <= K <= path.MAX_TOPK:
        fail(op, f"topk {K} out of range for transport {transport}")
    check_nonneg(op, "recv_rows", N)
    check_nonneg(op, "expert_rows", M)
    p = (host_words(plan) if plan_host is None else plan_host).tolist()
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


class Received(NamedTuple):
    """The received chunks and the sizes unpack checked against the plan."""
    recv: torch.Tensor  # [nbytes] uint8
    nbytes: int
    payload_bytes: int  # P: a row's payload (hidden * dtype size)
    row_bytes: int      # B: a first-section row's bytes
    topk: int           # K
    recv_rows: int      # N: the row space's rows
    expert_rows: int    # M


class Rows(NamedTuple):
    """What the row space launch (rowspace.py) found of each received row [N]."""
    source: torch.Tensor  # [N] int64: the rank it came from
    offset: torch.Tensor  # [N] int64: its byte offset in recv
    data: torch.Tensor    # [N] bool: a data row, inside the buffer, of a plan without error
    # A path with ROW_SLOT (its row is its one slot); empty tensors otherwise:
    slot_row: torch.Tensor  # [N] int64: the slot's expert row
    live: torch.Tensor      # [N] bool: whether it has one
    slot_k: torch.Tensor    # [N] int64: its k
    weight_bits: torch.Tensor  # [N]: its weight's bits


class RowSpace(NamedTuple):
    """What unpack's row space launch found of the received rows, for its path's slots
    (``unpack_slots`` of pairs.py, dedup.py): the received chunks, the plan (its receive words
    on the device) and the rows [N] (combine's and the backward passes' row space)."""
    received: Received
    plan: PlanView
    rows: Rows


MAPS_BLOCK = 4096 if INTERPRETED else 256  # slots a program of the maps and outputs launches


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _maps_kernel(m, live, entry, src_slot, recv_map, NQ, M, NC, ENTRY: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The inverse maps of slots q [NQ] (m: each one's expert row, live: it has one):
    src_slot[m[q]] = q and recv_map[entry[q]] = m[q] (ENTRY false: entry[q] = q) for the live
    ones in range; both were filled with -1 by the row space launch."""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < NQ
    mq = tl.load(m + q, mask=inq, other=-1)
    lv = inq & (tl.load(live + q, mask=inq, other=0) != 0)
    tl.store(src_slot + mq, q, mask=lv & (mq >= 0) & (mq < M))
    if ENTRY:
        e = tl.load(entry + q, mask=inq, other=-1)
    else:
        e = q
    tl.store(recv_map + e, mq, mask=lv & (e >= 0) & (e < NC))


@triton.jit
def _outputs_kernel(plan, bits, NBITS, words, NWORDS, src_slot, recv_map, s, t, at, k, w,
                    row_src, row_weight, src_off, out_off, status, M, NC, C, P,
                    BLOCK: tl.constexpr):
    """The call's status (the OR of the row space's words and the path's, 0 under a plan
    that carries an error) and, per expert row e [M], its received slot's outputs: row_src (s, t, k),
    row_weight's bits, the payload's byte offset in recv (src_off, -1: padding) and its own in
    expert_x (out_off); all in their "nothing received" form under a nonzero status, recv_map
    [NC] too."""
    pid = tl.program_id(0)
    v = tl.arange(0, 64)
    st = tl.zeros([], tl.int32)
    for b0 in range(0, NBITS, 64):
        st |= tl.reduce(tl.load(bits + b0 + v, mask=b0 + v < NBITS, other=0), 0, _or)
    for b0 in range(0, NWORDS, 64):
        st |= tl.reduce(tl.load(words + b0 + v, mask=b0 + v < NWORDS, other=0), 0, _or)
    st = tl.where(tl.load(plan + PLAN_ERR_CODE) == 0, st, 0)
    e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    good = (tl.zeros([BLOCK], tl.int32) + st) == 0  # a tile (the interpreter: a bool one)
    em = e < M
    ss = tl.load(src_slot + e, mask=em, other=-1)
    has = em & good & (ss >= 0)
    qs = tl.maximum(ss, 0)
    q = qs // C
    src_row = row_src + ROW_SRC_COLS * e
    tl.store(src_row + ROW_SRC_S, tl.where(has, tl.load(s + q, mask=has, other=0), -1), mask=em)
    tl.store(src_row + ROW_SRC_T, tl.where(has, tl.load(t + q, mask=has, other=0), -1), mask=em)
    tl.store(src_row + ROW_SRC_K, tl.where(has, tl.load(k + qs, mask=has, other=0), -1), mask=em)
    tl.store(row_weight + e, tl.where(has, tl.load(w + qs, mask=has, other=0), 0).to(tl.int32),
             mask=em)
    tl.store(src_off + e, tl.where(has, tl.load(at + q, mask=has, other=0), -1), mask=em)
    tl.store(out_off + e, e * P, mask=em)
    tl.store(recv_map + e, tl.full([BLOCK], -1, tl.int64), mask=(e < NC) & ~good)
    if pid == 0:
        tl.store(status, st)


def _unpack(recv, plan, path, P, K, N, M, p):
    """The index pass (module docstring): (status, row_src, row_weight, recv_map, src_off,
    out_off), in three launches and the path's own slot work."""
    dev = recv.device
    pv = PlanView.of(plan, p)
    B = row_bytes(path, P)
    C = path.recv_map_cols(K)
    i64 = dict(dtype=torch.int64, device=dev)
    src_slot, recv_map = torch.empty(M, **i64), torch.empty(N * C, **i64)
    s, at, data, t, m, live, k, wbits, bits = rowspace.row_space(
        recv, plan, path.ROW_SLOT, P, B, pv.ranks, pv.experts, N, M, pv.static_cap,
        (src_slot, recv_map))
    rs = RowSpace(Received(recv, recv.numel(), P, B, K, N, M), pv,
                  Rows(s, at, data, m, live, k, wbits))
    m, live, entry, k, wbits, words = path.unpack_slots(rs)
    NQ = m.numel()
    launch(_maps_kernel, (cdiv(NQ, MAPS_BLOCK),), m, live.view(torch.uint8),
           m if entry is None else entry, src_slot, recv_map, NQ, M, N * C,
           ENTRY=entry is not None, BLOCK=MAPS_BLOCK)
    row_src = torch.empty((M, 3), **i64)
    row_weight = torch.empty(M, dtype=torch.int32, device=dev)
    src_off, out_off = torch.empty(M, **i64), torch.empty(M, **i64)
    status = torch.empty((), dtype=torch.int32, device=dev)
    launch(_outputs_kernel, (cdiv(max(M, N * C, 1), MAPS_BLOCK),), plan, bits, bits.numel(),
           words if words.numel() else bits, words.numel(), src_slot, recv_map, s, t, at, k if k.numel() else s, wbits if wbits.numel() else s,
           row_src, row_weight, src_off, out_off, status, M, N * C, max(C, 1), P, BLOCK=MAPS_BLOCK)
    return status, row_src, row_weight.view(torch.float32), recv_map.view(N, C), src_off, out_off


def unpack_with_status(recv: torch.Tensor, plan: torch.Tensor, transport: int, hidden: int,
                       dtype: torch.dtype, topk: int, recv_rows: int, expert_rows: int,
                       plan_host: Optional[torch.Tensor] = None):
    """:func:`unpack`'s outputs and this call's status (a 0-d int32 tensor on recv's device;
    nonzero: the outputs are in their "nothing received" form), raising nothing for the data."""
    M, N, H, K = int(expert_rows), int(recv_rows), int(hidden), int(topk)
    p, path = _check(recv, plan, transport, H, dtype, K, N, M, plan_host)
    recv = recv.contiguous()
    P = H * dtype.itemsize
    status, row_src, row_weight, recv_map, src_off, out_off = _unpack(recv, plan, path, P, K,
                                                                      N, M, p)
    expert_x = torch.empty((M, H), dtype=dtype, device=recv.device)
    # every source offset is a chunk start plus rows of B bytes, every output one of P bytes
    chunks = p[W.plan_slices(p[W.RANKS], p[W.EXPERTS])["recv_bytes"]]
    align = math.gcd(P, row_bytes(path, P), SLOT, *chunks)
    byterows.write_rows(expert_x, out_off, P, recv, src_off, P, align=align)
    return (expert_x, row_src, row_weight, recv_map), status


def unpack(recv: torch.Tensor, plan: torch.Tensor, transport: int, hidden: int,
           dtype: torch.dtype, topk: int, recv_rows: int, expert_rows: int,
           plan_host: Optional[torch.Tensor] = None):
    """recv [recv_bytes] uint8, plan [n] int64, plan_host [n] int64 (its words in host memory;
    a copy of the plan when not given) -> (expert_x [expert_rows, hidden] dtype,
    row_src [expert_rows, 3] int64 (source rank, token, k; -1 on padding), row_weight
    [expert_rows] float32, recv_map [recv_rows, 1 (pairs) or topk (dedup)] int64).

    A received chunk that disagrees with the plan: on CPU tensors a RuntimeError after the
    launch (what the C++ kernel raises), on CUDA the outputs in their "nothing received" form
    and the bits OR-ed into :func:`status_word` (module docstring)."""
    out, status = unpack_with_status(recv, plan, transport, hidden, dtype, topk, recv_rows,
                                     expert_rows, plan_host)
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
