"""pack, pack_into, scatter_rows, scatter_rows_into in Triton (cpu/pack.cpp is the
specification, byte for byte).

The send buffer is a run of chunks, one per destination rank d (docs/design.md, "wire
format"): a first section of ``tok_rows[d]`` rows of ``B`` bytes (pairs: one row per kept slot,
``payload | int32 t | int32 k | int32 j | float32 w``; dedup: one row per token with a kept slot
on d, ``payload | int32 t | int32 n``), then (dedup) a slot section of ``slot_rows[d]`` rows of
8 bytes (``int32 (k << 24 | j) | float32 w``). Ragged chunks hold exactly their rows; the fixed
chunks (padded, equal, static) ``tok_cap`` / ``slot_cap`` rows, the static ones opening each
section with a header row whose first 8 bytes carry the section's count (int64), the unused
rows zero, as cpu/pack.cpp's ``send.zero_()`` leaves them.

Index pass, no host read: each slot's rank among this rank's slots to its expert in token
order (``ranks.rank_in_key``, two launches: the blocks' histograms, then the ranks), so
``rank < own_kept[e]`` is the capacity's kept mask. The rest is the path's: pairs' row in its
chunk follows from the plan's ``own_kept`` prefix, in two launches of pairs.py (the slots',
then the first section's rows); dedup's token rows and slot rows are ranked in one more ranks
pass (a token among the tokens opening on a rank, a slot among the rank's slots), around an
open launch and a places launch of dedup.py, then each section's rows. Each section row of the
buffer gets its source (a payload row of x or none), its metadata words and its header value
(sections.py), and ``byterows.write_rows`` writes every byte of the section once.

Routing-dependent plan words are read on the device (the plan tensor); the host reads only
the words the C++ kernel checks through a host pointer (``plan_host``, the op's argument: the
plan's host words, count_exchange's second output; a copy of the plan when not given), and the
section sizes from them. Data the C++ kernel range-checks
(expert ids, a plan from another call) cannot raise on a GPU without a host read: such slots
are masked (not sent), and nothing is read or written out of bounds. A plan that carries an
error on the device (the static exchange's deferred error) sends nothing: ``send_map`` all -1,
the buffer all zeros (as csrc/cuda/pack.cu did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from epkit.reference import abi

from .. import plan as W
from ..plan import host_words
from . import byterows, ranks
from .inverse import invert
from .planview import PlanView
from .transports import PATHS
from .wirechecks import (check_pack_args, check_plan_chunks, check_plan_header,
                         check_plan_transport, check_scatter_args, check_scatter_into_args,
                         check_send_buffer, fail, row_bytes)

__all__ = ["pack", "pack_into", "scatter_rows", "scatter_rows_into"]


SLOT = abi.SLOT_ROW_BYTES


def _readable(t: torch.Tensor) -> bool:
    """Whether the data checks of the C++ kernel may read t: a CPU tensor off the device path
    (a direct call; under EPKIT_KERNELS=triton the ops mask as on a GPU and read nothing)."""
    from ..memory import device_path

    return t.device.type == "cpu" and not device_path(t)


def _check_pack(op, x, topk_idx, topk_weights, plan, transport, num_ranks, SB, plan_host):
    """checks.h check_pack_args + check_pack_plan; returns the plan's host words and the
    transport's path."""
    check_pack_args(op, x, topk_idx, topk_weights, plan, transport, SB, plan_host)  # the fake's too
    path = PATHS[transport]
    path.check_pack_topk(op, topk_idx.shape[1])
    p = (host_words(plan) if plan_host is None else plan_host).tolist()
    op = "epkit.pack"  # the plan checks name pack, as in checks.h
    sl = check_plan_header(op, p, plan.numel())
    if num_ranks != p[W.RANKS]:
        fail(op, f"num_ranks {num_ranks} disagrees with the plan's {p[W.RANKS]}")
    check_plan_transport(op, p, path)
    path.check_local_experts(op, p[W.LOCAL_EXPERTS])
    P = x.shape[1] * x.element_size()
    if P != p[W.PAYLOAD_BYTES]:
        fail(op, f"payload of {P} bytes, the plan says {p[W.PAYLOAD_BYTES]}")
    if SB != p[W.SEND_BYTES]:
        fail(op, f"send_bytes {SB} disagrees with the plan's {p[W.SEND_BYTES]}")
    check_plan_chunks(op, p, sl, False, path, SB)
    return p, path


@dataclass(frozen=True)
class Routing:
    """This rank's tokens as pack reads them."""
    x: torch.Tensor             # [T, H] contiguous, the payload rows
    idx: torch.Tensor           # [T * K] int64, the routing flattened
    topk_weights: torch.Tensor  # [T, K] float32
    payload_bytes: int          # P = H * x's element size: a row's payload

    @property
    def tokens(self) -> int:
        return self.topk_weights.shape[0]

    @property
    def topk(self) -> int:
        return self.topk_weights.shape[1]

    @property
    def weight_bits(self) -> torch.Tensor:  # [T * K] int32: each slot's weight's bits (a view)
        return self.topk_weights.contiguous().view(torch.int32).reshape(-1)


@dataclass(frozen=True)
class SendBuffer:
    """The send buffer being written and the shape of its two sections."""
    send: torch.Tensor  # [send_bytes] uint8
    row_bytes: int      # a first-section row's bytes (B)
    align: int          # of every row's byte offset
    first_rows: int     # first-section rows of all chunks (QA)
    slot_rows: int      # slot-section rows of all chunks (QB; 0 without a slot section)


@dataclass
class Slots:
    """What pack's shared index pass knows, for its path's row passes (pairs.py, dedup.py): the
    routing, the plan, the buffer, and every slot's rank among this rank's slots to its expert.
    No tensor is made here: the paths' kernels read the plan and the routing themselves."""
    routing: Routing
    plan: PlanView
    buffer: SendBuffer
    slot_rank: torch.Tensor   # [T * K] int64: each slot's rank among this rank's slots to its
                              # expert (ids outside [0, E): among "none")
    first_fill: torch.Tensor  # [first_rows] int64, filled with -1 by the ranks' first launch
    slot_src: Optional[torch.Tensor] = None  # [slot_rows] int64: the slot section's row map
                                             # (dedup's pack_rows writes it)


def _pack_into_send(x, topk_idx, topk_weights, plan, path, p, send) -> torch.Tensor:
    x = x.contiguous()
    T, K = topk_idx.shape
    P = x.shape[1] * x.element_size()
    pv = PlanView.of(plan, p)
    E, B, sl = pv.experts, row_bytes(path, P), pv.sections

    # Host sizes of the two sections (routing-independent for the static exchange; the eager
    # exchanges' host words are the whole plan), and whether they cover every byte.
    tok_h = [pv.token_cap if pv.token_cap >= 0 else c for c in p[sl["send_counts"]]]
    slot_h = [(pv.slot_cap if pv.slot_cap >= 0 else c) * path.SLOT_SECTIONS
              for c in p[sl["send_slots"]]]
    QA, QB = sum(tok_h), sum(slot_h)
    align = math.gcd(B, SLOT, *p[sl["send_bytes"]])  # of every row's byte offset
    if any(nb != a * B + b * SLOT for nb, a, b in zip(p[sl["send_bytes"]], tok_h, slot_h)):
        send.zero_()  # bytes outside every row (no plan of epkit.plan has them): zeros
        align = 1

    idx = topk_idx.to(torch.int64).reshape(-1).contiguous()
    if _readable(idx):  # the C++ kernel's range check (on a GPU: masked, not sent)
        bad = (idx < -1) | (idx >= E)
        if bool(bad.any()):
            i = int(bad.to(torch.uint8).argmax())
            fail("epkit.pack", f"topk_idx[{i // K}, {i % K}] = {int(idx[i])} outside [-1, {E})")
    # Each slot's rank among this rank's slots to its expert (token order): the capacity's
    # kept mask is rank < own_kept[e]. The same launches fill a first-section map with -1.
    fill = torch.empty(QA, dtype=torch.int64, device=x.device)
    rank = ranks.rank_in_key(idx, E, fill=fill)
    ix = Slots(Routing(x, idx, topk_weights, P), pv, SendBuffer(send, B, align, QA, QB), rank,
               fill)
    # The first section's rows come from the path (a row per slot, or per token and rank),
    # written here in one pass; then its slot section, if it has one.
    send_map, offA, src_off, meta, hdrA = path.pack_rows(ix)
    byterows.write_rows(send, offA, B, x, src_off, P, meta, hdrA, align=math.gcd(align, P))
    path.pack_slots(ix)
    return send_map


def pack(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
         plan: torch.Tensor, transport: int, num_ranks: int, send_bytes: int,
         plan_host: Optional[torch.Tensor] = None):
    """x [T, H] any dtype, topk_idx [T, K] integer, topk_weights [T, K] float32, plan [n] int64,
    plan_host [n] int64 (its words in host memory) -> (send [send_bytes] uint8, send_map [T, K]
    (pairs) or [T, R] (dedup) int64)."""
    SB = int(send_bytes)
    p, path = _check_pack("epkit.pack", x, topk_idx, topk_weights, plan, transport, num_ranks,
                          SB, plan_host)
    send = torch.empty((SB,), dtype=torch.uint8, device=x.device)
    return send, _pack_into_send(x, topk_idx, topk_weights, plan, path, p, send)


def pack_into(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
              plan: torch.Tensor, transport: int, num_ranks: int,
              send: torch.Tensor, plan_host: Optional[torch.Tensor] = None) -> torch.Tensor:
    """pack into ``send`` [send_bytes] uint8 (contiguous, x's device); returns send_map."""
    op = "epkit.pack_into"
    check_send_buffer(op, send, x.device)
    p, path = _check_pack(op, x, topk_idx, topk_weights, plan, transport, num_ranks,
                          send.numel(), plan_host)
    return _pack_into_send(x, topk_idx, topk_weights, plan, path, p, send)


def _check_map_data(op: str, m: torch.Tensor, S: int, C: int) -> None:
    """The C++ kernel's checks of send_map's entries: in [-1, S), no send row named twice."""
    bad = (m < -1) | (m >= S)
    if bool(bad.any()):
        i = int(bad.to(torch.uint8).argmax())
        fail(op, f"send_map entry {i} is {int(m[i])}, outside [-1, {S}) (send_rows)")
    n = torch.arange(m.numel(), dtype=torch.int64)
    first = torch.full((S + 1,), m.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, torch.where(m >= 0, m, S), n, "amin")
    again = (m >= 0) & (first[m.clamp(min=0)] != n)
    if bool(again.any()):
        i = int(again.to(torch.uint8).argmax())
        fail(op, f"send_map entry {i} names send row {int(m[i])}, named already by token "
                 f"{int(first[m[i]]) // C}")


def _scatter_into(op: str, src: torch.Tensor, send_map: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Output-indexed: send row r takes the token whose entry names it, or zeros. Entries
    outside [0, S) or naming a row twice raise on CPU tensors off the device path (as the C++
    kernel does); elsewhere (a GPU cannot raise without a host read) such entries are ignored,
    or one of the two wins."""
    S = out.shape[0]
    src = src.contiguous()
    C = send_map.shape[1]
    nbytes = src.shape[1] * src.element_size()
    m = send_map.reshape(-1)
    if _readable(m):
        _check_map_data(op, m, S, C)
    # each send row's source byte offset (its token's row, or -1: zeros) and its own offset
    frm, off = invert(m, S, div=C, scale=nbytes, own=True)
    byterows.write_rows(out, off, nbytes, src, frm, nbytes, align=nbytes)


def scatter_rows(src: torch.Tensor, send_map: torch.Tensor, send_rows: int) -> torch.Tensor:
    """src [T, H] any dtype, send_map [T, C] int64 -> [send_rows, H] of src's dtype: row r is
    the token whose entry names r, zeros where none does."""
    S = int(send_rows)
    check_scatter_args("epkit.scatter_rows", src, send_map, S)
    out = torch.empty((S, src.shape[1]), dtype=src.dtype, device=src.device)
    _scatter_into("epkit.scatter_rows", src, send_map, out)
    return out


def scatter_rows_into(src: torch.Tensor, send_map: torch.Tensor, out: torch.Tensor) -> None:
    """scatter_rows into ``out`` [send_rows, H] (src's dtype, contiguous)."""
    op = "epkit.scatter_rows_into"
    check_scatter_into_args(op, src, send_map, out)
    _scatter_into(op, src, send_map, out)
