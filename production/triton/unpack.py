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

import torch

from epkit.reference import abi

from .. import plan as W
from ..plan import host_plan
from . import byterows
from .indexmaps import excl, place, rank_in_key
from .wirechecks import (check_dim, check_dtype, check_nonneg, check_plan_chunks,
                         check_plan_header, check_plan_tensor, check_transport, fail, row_bytes)

__all__ = ["unpack", "unpack_with_status", "status_word", "STATUS_BITS"]

byterows.declare("unpack.rows", 0, False)

SLOT = abi.SLOT_ROW_BYTES
ST_INBAND, ST_SLOTS, ST_ROWS, ST_SLOT_ROW, ST_EXPERT_ROW, ST_SHAPE, ST_EXPERT_TOTAL = (
    1, 2, 4, 8, 16, 32, 64)
STATUS_BITS = {
    ST_INBAND: "a static chunk's in-band row count differs from the plan's recv_counts",
    ST_SLOTS: "the slots a source sent (in-band or by its rows' n) differ from the plan's "
              "recv_slots",
    ST_ROWS: "the plan's kept blocks (recv_kept) do not cover the rows received",
    ST_SLOT_ROW: "a corrupt slot row (k >= topk or local expert >= L)",
    ST_EXPERT_ROW: "a slot overruns its expert's segment or repeats k",
    ST_SHAPE: "the plan's sizes differ from the buffer, recv_rows or expert_rows",
    ST_EXPERT_TOTAL: "an expert received a count that disagrees with the plan",
}

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


def _check(recv, plan, transport, H, dtype, K, N, M) -> list:
    """checks.h check_unpack_args + check_unpack_plan; returns the plan's host words."""
    op = "epkit.unpack"
    check_dim(op, "recv", recv, 1)
    check_dtype(op, "recv", recv, torch.uint8)
    check_plan_tensor(op, plan, recv.device)
    check_transport(op, transport)
    if not 0 <= H <= (1 << 31) - 1:
        fail(op, f"hidden {H} outside [0, 2^31)")
    if not 0 <= K <= ((1 << 31) - 1 if transport == W.PAIRS else abi.DEDUP_MAX_TOPK):
        fail(op, f"topk {K} out of range for transport {transport}")
    check_nonneg(op, "recv_rows", N)
    check_nonneg(op, "expert_rows", M)
    p = host_plan(plan).tolist()
    sl = check_plan_header(op, p, plan.numel())
    P = H * dtype.itemsize
    tr = abi.PLAN_FIELDS.index("transport")
    if transport != p[tr]:
        fail(op, f"transport {transport} disagrees with the plan's {p[tr]}")
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
    check_plan_chunks(op, p, sl, True, row_bytes(transport, P), recv.numel())
    return p


def _read(recv: torch.Tensor, at: torch.Tensor, live: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The little-endian integer of ``nbytes`` bytes at byte offsets ``at`` (int64, signed for
    4 and 8 bytes), 0 where not ``live`` or out of the buffer (never read)."""
    NB = recv.numel()
    live = live & (at >= 0) & (at + nbytes <= NB)
    if NB < nbytes:
        return torch.zeros_like(at)
    idx = torch.where(live, at, 0)[..., None] + torch.arange(nbytes, device=at.device)
    b = recv[idx].to(torch.int64)
    v = torch.zeros_like(at)
    for i in range(nbytes):
        v = v | (b[..., i] << (8 * i))
    if nbytes == 4:  # sign of the int32
        v = v - ((v >> 31) & 1) * (1 << 32)
    return torch.where(live, v, 0)


def _any(cond: torch.Tensor, bit: int) -> torch.Tensor:
    """``bit`` where any element holds, else 0 (a 0-d int64 tensor, no host read)."""
    return cond.any().to(torch.int64) * bit


def _unpack(recv, plan, transport, P, K, N, M, p):
    dev = recv.device
    R, E, L = p[W.RANKS], p[W.EXPERTS], p[W.LOCAL_EXPERTS]
    sl = W.plan_slices(R, E)
    pairs = transport == W.PAIRS
    B = row_bytes(transport, P)
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
    bits = [_any(pl[sl["recv_bytes"]].sum() != NB, ST_SHAPE),
            _any(pl[W.RECV_BYTES] != NB, ST_SHAPE), _any(pl[W.RECV_ROWS] != N, ST_SHAPE),
            _any(pl[W.EXPERT_ROWS] != M, ST_SHAPE), _any(offsets[L] > M, ST_SHAPE),
            _any(offsets[1:] < offsets[:-1], ST_SHAPE), _any(offsets[0] < 0, ST_SHAPE)]

    # The row space: each row's source s, its data row i, whether it is one, its bytes.
    r = torch.arange(N, **i64)
    if cap >= 0:
        s, i = r // (1 + cap), r % (1 + cap) - 1
        data = (s < R) & (i >= 0)
        s = s.clamp(max=R - 1)
        data = data & (i < counts[s])
        g = excl(counts)[s] + i  # the data row's index among all data rows
        bits.append(_any((counts > 0) & (torch.arange(R, **i64) * (1 + cap) + counts >= N),
                         ST_SHAPE))  # a data row past recv_rows
        bits.append(_any(_read(recv, rchunk, ok, 8) != counts, ST_INBAND))
    else:
        data = r < counts.sum()
        s = torch.searchsorted(counts.cumsum(0), r, right=True).clamp(max=R - 1)
        i, g = r - excl(counts)[s], r
        bits.append(_any(counts.sum() > N, ST_SHAPE))
    at = rchunk[s] + (hdr + i) * B
    bits.append(_any(data & (at + B > NB), ST_SHAPE))
    data = data & ok & (at + B <= NB)
    t = _read(recv, at + P + abi.PAIRS_META.index("t") * 4, data, 4)

    if pairs:
        k = _read(recv, at + P + abi.PAIRS_META.index("k") * 4, data, 4)
        wbits = _read(recv, at + P + abi.PAIRS_META.index("w") * 4, data, 4)
        ends = kept.cumsum(0)  # flat prefix of the blocks (s, j)
        bits.append(_any((kept < 0) | (ends[-1] != counts.sum()), ST_ROWS))
        blk = torch.searchsorted(ends, g, right=True)
        inb = blk < R * L
        blk = blk.clamp(max=R * L - 1)
        kv = kept.view(R, L)
        base = (offsets[:L][None, :] + excl(kv)).reshape(-1)  # expert row of block's first
        bits.append(_any((base + kept).view(R, L) > offsets[1:][None, :], ST_EXPERT_ROW))
        m = base[blk] + g - (ends[blk] - kept[blk])
        live = data & inb & (m >= 0) & (m < M)
        bits.append(_any(data & ~live & ok, ST_ROWS))
        status = torch.where(ok, sum(bits), 0).to(torch.int32)
        good = status == 0
        src = torch.where(good, place(M, m, live, r), -1)
        recv_map = torch.where(live & good, m, -1).view(N, 1)
        has, q = src >= 0, src.clamp(min=0)
        row_src = torch.where(has[:, None], torch.stack([s[q], t[q], k[q]], 1), -1)
        wsrc = wbits[q]
    else:
        n = _read(recv, at + P + abi.DEDUP_TOKEN_META.index("n") * 4, data, 4)
        nn = torch.where(data, n.clamp(min=0), 0)
        tot = torch.zeros(R, **i64).scatter_add_(0, s, nn)
        bits.append(_any(data & (n < 0), ST_SLOTS))
        bits.append(_any(tot != nslots, ST_SLOTS))
        bits.append(_any(nn > K, ST_EXPERT_ROW))  # n > K slots cannot name distinct k
        tok_rows = counts if tokcap < 0 else torch.full_like(counts, tokcap)
        sec = rchunk + tok_rows * B  # each chunk's slot section (its header row first)
        if cap >= 0:
            bits.append(_any(_read(recv, sec, ok, 8) != nslots, ST_SLOTS))
        first = sec[s] + hdr * SLOT + (excl(nn) - excl(tot)[s]) * SLOT
        qk = torch.arange(K, **i64)
        sv = data[:, None] & (qk[None, :] < nn[:, None].clamp(max=K))
        so = first[:, None] + qk[None, :] * SLOT
        bits.append(_any(sv & ((so < 0) | (so + SLOT > NB)), ST_SHAPE))
        sv = sv & (so >= 0) & (so + SLOT <= NB)
        word = _read(recv, so, sv, 4)
        wbits = _read(recv, so + 4, sv, 4).reshape(-1)
        kk = (word & 0xFFFFFFFF) >> abi.SLOT_K_SHIFT
        jj = word & ((1 << abi.SLOT_K_SHIFT) - 1)
        bad = sv & ((jj >= L) | (kk >= K))
        bits.append(_any(bad, ST_SLOT_ROW))
        sv = (sv & ~bad).reshape(-1)
        kk, jj = kk.reshape(-1), jj.reshape(-1).clamp(max=L - 1)
        rank = rank_in_key(torch.where(sv, jj, L), L)
        cnt = torch.zeros(L + 1, **i64).scatter_add_(0, torch.where(sv, jj, L),
                                                     torch.ones_like(jj))[:L]
        bits.append(_any(cnt != tpe, ST_EXPERT_TOTAL))
        m = offsets[jj] + rank
        bits.append(_any(sv & ((m >= offsets[jj + 1]) | (m >= M)), ST_EXPERT_ROW))
        rk = (r[:, None] * K + kk.view(N, K)).reshape(-1) if K else kk
        seen = torch.zeros(N * K + 1, **i64).scatter_add_(0, torch.where(sv, rk, N * K),
                                                         torch.ones_like(rk))[: N * K]
        bits.append(_any(seen > 1, ST_EXPERT_ROW))
        live = sv & (m < M)
        status = torch.where(ok, sum(bits), 0).to(torch.int32)
        good = status == 0
        slot_id = torch.arange(N * K, **i64)
        src_slot = torch.where(good, place(M, m, live, slot_id), -1)
        recv_map = torch.where(good, place(N * K, rk, live, m), -1).view(N, K)
        has, qs = src_slot >= 0, src_slot.clamp(min=0)
        q = qs // max(K, 1)
        src = torch.where(has, q, -1)
        row_src = torch.where(has[:, None], torch.stack([s[q], t[q], kk[qs]], 1), -1)
        wsrc = wbits[qs]
    row_weight = torch.where(has, wsrc, 0).to(torch.int32).view(torch.float32)
    return status, src, at, row_src, row_weight, recv_map


def unpack_with_status(recv: torch.Tensor, plan: torch.Tensor, transport: int, hidden: int,
                       dtype: torch.dtype, topk: int, recv_rows: int, expert_rows: int):
    """:func:`unpack`'s outputs and this call's status (a 0-d int32 tensor on recv's device;
    nonzero: the outputs are in their "nothing received" form), raising nothing for the data."""
    M, N, H, K = int(expert_rows), int(recv_rows), int(hidden), int(topk)
    p = _check(recv, plan, transport, H, dtype, K, N, M)
    recv = recv.contiguous()
    P = H * dtype.itemsize
    status, src, at, row_src, row_weight, recv_map = _unpack(recv, plan, transport, P, K, N,
                                                             M, p)
    expert_x = torch.empty((M, H), dtype=dtype, device=recv.device)
    src_off = torch.where(src >= 0, at[src.clamp(min=0)], -1) if N else torch.full_like(src, -1)
    out_off = torch.arange(M, dtype=torch.int64, device=recv.device) * P
    # every source offset is a chunk start plus rows of B bytes, every output one of P bytes
    chunks = p[W.plan_slices(p[W.RANKS], p[W.EXPERTS])["recv_bytes"]]
    align = math.gcd(P, row_bytes(transport, P), SLOT, *chunks)
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
