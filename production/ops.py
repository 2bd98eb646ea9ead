"""Operator registration: fake kernels for the C++ ops, and the collective-bearing ops with
their autograd.

Two layers of ``torch.library`` ops, all in the ``epkit`` namespace:

- Local kernels, schema and CPU kernel in C++ (``csrc/``): ``layout``, ``prepare``, ``plan``,
  ``pack``, ``unpack``, ``gather_rows``, ``reduce_tokens``, ``scatter_rows``,
  ``combine_backward_dest``, ``gather_slot_values``, ``scatter_slot_values``. Their fake kernels
  are here; every routing-dependent size arrives as a SymInt argument, never guessed.
- Ops that move data over a process group (Python custom ops, opaque to ``torch.compile``):
  ``count_exchange`` (the one small all-gather that yields the plan, and the collective error),
  ``dispatch_tokens`` / ``combine_tokens`` and their backward ops ``dispatch_tokens_backward`` /
  ``combine_tokens_backward``. Autograd is registered with ``register_autograd``; the backward
  passes are ops too, and ``setup_context`` only saves tensors (no host sync).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _build
from .device import host_plan
from .agree import (COMBINE_BACKWARD, DISPATCH_BACKWARD, NO_OPTIONS, agree, header)
from .collectives import all_gather, all_to_all, dtype_code, group_from_name
from epkit.reference import abi
from epkit.reference.errors import Reason, error

_build.load()
C = torch.ops.epkit

# The ABI (codes, the plan layout, the wire format): reference/abi.py, the one definition the
# kernels' csrc/abi.h is generated from.
TRANSPORTS = dict(abi.TRANSPORT_CODES)
PAIRS, DEDUP = TRANSPORTS["pairs"], TRANSPORTS["dedup"]
_F = {name: i for i, name in enumerate(abi.PLAN_FIELDS)}
ERR_CODE, ERR_A, ERR_B, ERR_RANK = (_F[n] for n in ("err_code", "err_a", "err_b", "err_rank"))
SEND_ROWS, RECV_ROWS, EXPERT_ROWS, UNIFORM, MAX_CHUNK = (
    _F[n] for n in ("send_rows", "recv_rows", "expert_rows", "uniform", "max_chunk"))
RANKS, LOCAL_EXPERTS, EXPERTS = _F["ranks"], _F["local_experts"], _F["experts"]
(STATIC_CAP, VARIANT, PAYLOAD_BYTES, TOK_CAP, SLOT_CAP, SEND_BYTES, RECV_BYTES,
 NONUNIFORM_RANK, DROPPED_ANY, RANKS_PER_NODE) = (
    _F[n] for n in ("static_cap", "variant", "payload_bytes", "tok_cap", "slot_cap", "send_bytes",
                    "recv_bytes", "nonuniform_rank", "dropped_any", "ranks_per_node"))
PLAN_HEADER = abi.PLAN_HEADER
VARIANT_NAMES = {v: k for k, v in abi.VARIANT_CODES.items()}
WORD_HEADER = abi.WORD_HEADER
plan_size = abi.plan_size
plan_slices = abi.plan_slices


def ranks_per_node(plan: torch.Tensor) -> int:
    """The plan's ``G``, the nodes of the combine's summation order (a plan word that
    :func:`count_exchange` writes; a plan made by ``epkit::plan`` alone reads as 1)."""
    return max(1, int(host_plan(plan)[RANKS_PER_NODE]))


def stamp_ranks_per_node(plan: torch.Tensor, G: int) -> torch.Tensor:
    """Write ``G`` into the plan and its host mirror (on CUDA a fill, no host wait)."""
    plan[RANKS_PER_NODE] = G
    mirror = host_plan(plan)
    if mirror is not plan:
        mirror[RANKS_PER_NODE] = G
    return plan


def dispatch_chunk_bytes(transport: int, P: int, rows: int, slots: int) -> int:
    """Bytes of one dispatch chunk (docs/design.md wire format): pairs rows of ``P + 16``;
    dedup token rows of ``P + 8`` plus slot rows of 8."""
    if transport == PAIRS:
        return rows * (P + abi.PAIRS_META_BYTES)
    return rows * (P + abi.DEDUP_TOKEN_META_BYTES) + slots * abi.SLOT_ROW_BYTES


# ---- fake kernels of the C++ ops -------------------------------------------------------------

@torch.library.register_fake("epkit::layout")
def _(topk_idx, num_experts, num_ranks):
    T = topk_idx.shape[0]
    long = dict(dtype=torch.int64, device=topk_idx.device)
    return (topk_idx.new_empty((num_experts,), **long), topk_idx.new_empty((num_ranks,), **long),
            topk_idx.new_empty((num_ranks,), **long),
            topk_idx.new_empty((T, num_ranks), dtype=torch.bool))


@torch.library.register_fake("epkit::prepare")
def _(x, topk_idx, topk_weights, num_experts, num_ranks, pre_error, payload):
    return topk_idx.new_empty((WORD_HEADER + num_experts + num_ranks,), dtype=torch.int64)


@torch.library.register_fake("epkit::plan")
def _(words, rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank):
    return words.new_empty((plan_size(words.shape[0], num_experts),))


@torch.library.register_fake("epkit::pack")
def _(x, topk_idx, topk_weights, plan, transport, num_ranks, send_bytes):
    T, K = topk_idx.shape
    cols = K if transport == PAIRS else num_ranks
    return x.new_empty((send_bytes,), dtype=torch.uint8), x.new_empty((T, cols), dtype=torch.int64)


@torch.library.register_fake("epkit::unpack")
def _(recv, plan, transport, hidden, dtype, topk, recv_rows, expert_rows):
    cols = 1 if transport == PAIRS else topk
    return (recv.new_empty((expert_rows, hidden), dtype=dtype),
            recv.new_empty((expert_rows, 3), dtype=torch.int64),
            recv.new_empty((expert_rows,), dtype=torch.float32),
            recv.new_empty((recv_rows, cols), dtype=torch.int64))


@torch.library.register_fake("epkit::gather_rows")
def _(expert_y, recv_map, row_weight, transport, weighted):
    dtype = expert_y.dtype if transport == PAIRS else torch.float32
    return expert_y.new_empty((recv_map.shape[0], expert_y.shape[1]), dtype=dtype)


@torch.library.register_fake("epkit::reduce_tokens")
def _(back, send_map, topk_idx, topk_weights, num_experts, num_ranks, transport, weighted, out_dtype,
      ranks_per_node=1):
    # dedup: back [S, 4 H / itemsize] in y's dtype (one float32 row per token row)
    H = back.shape[1] if transport == PAIRS else back.shape[1] * back.element_size() // 4
    return back.new_empty((send_map.shape[0], H), dtype=out_dtype)


@torch.library.register_fake("epkit::scatter_rows")
def _(src, send_map, send_rows):
    return src.new_empty((send_rows, src.shape[1]))


@torch.library.register_fake("epkit::combine_backward_dest")
def _(recv, recv_map, row_weight, expert_y, weighted):
    return torch.empty_like(expert_y), expert_y.new_empty((expert_y.shape[0],), dtype=torch.float32)


@torch.library.register_fake("epkit::quantize_mxfp8")
def _(x):
    T, H = x.shape
    return (x.new_empty((T, H), dtype=torch.float8_e4m3fn),
            x.new_empty((T, H // abi.MXFP8_BLOCK), dtype=torch.uint8))


@torch.library.register_fake("epkit::quantize_fp8_block128")
def _(x):
    T, H = x.shape
    return (x.new_empty((T, H), dtype=torch.float8_e4m3fn),
            x.new_empty((T, H // abi.FP8_BLOCK128_BLOCK), dtype=torch.float32))


@torch.library.register_fake("epkit::gather_slot_values")
def _(values, recv_map, first, out_rows):
    return values.new_empty((out_rows,), dtype=torch.float32)


@torch.library.register_fake("epkit::scatter_slot_values")
def _(back, send_map, topk_idx, first, num_experts, num_ranks, transport):
    return back.new_empty(topk_idx.shape, dtype=torch.float32)


# ---- the exchange inside the ops ----------------------------------------------------------

def _move(buf: torch.Tensor, plan: torch.Tensor, group_name: str, reverse: bool,
          async_op: bool = False, what: str = "epkit"):
    """All-to-all of row-space ``buf`` (combine, the backward passes) along the plan's counts;
    ``reverse``: expert side -> source side. With ``async_op``, returns a callable that waits
    and returns the rows."""
    plan = host_plan(plan)  # on CUDA its pinned host mirror: no host wait
    R = int(plan[RANKS])
    variant = VARIANT_NAMES[int(plan[VARIANT])]
    cap = int(plan[STATIC_CAP])
    if variant == "static":  # fixed chunks of 1 + cap rows, counts in-band
        send = recv = [1 + cap] * R
        variant = "equal"
    else:
        sl = plan_slices(R, int(plan[EXPERTS]))
        send = plan[sl["send_counts"]].tolist()
        recv = plan[sl["recv_counts"]].tolist()
        if reverse:
            send, recv = recv, send
    return all_to_all(buf, send, recv, group_from_name(group_name), variant, int(plan[MAX_CHUNK]),
                      async_op=async_op, what=what)


def _move_dispatch(buf: torch.Tensor, plan: torch.Tensor, group_name: str, async_op: bool = False):
    """The dispatch exchange: ``buf`` holds this rank's chunks back to back as bytes, already in
    the variant's layout (pack pads), so only ragged needs split sizes."""
    plan = host_plan(plan)
    R = int(plan[RANKS])
    sl = plan_slices(R, int(plan[EXPERTS]))
    send = plan[sl["send_bytes"]].tolist()
    recv = plan[sl["recv_bytes"]].tolist()
    variant = "ragged" if int(plan[VARIANT]) == 0 else "equal"
    return all_to_all(buf, send, recv, group_from_name(group_name), variant, send[0] if R else 0,
                      async_op=async_op, what="epkit.dispatch (token exchange)")


# ---- dedup: the kept routing, and the way back of raw rows or partials -----------------------

def may_drop(plan: torch.Tensor) -> bool:
    """Whether capacity may have dropped a slot of this plan, read on the host: the plan's
    ``DROPPED_ANY``; under the static exchange on CUDA, whose host mirror is a routing-free
    template (epkit/device.py), whether a capacity is set at all."""
    hp = host_plan(plan)
    if plan.is_cuda and int(hp[STATIC_CAP]) >= 0:
        return int(hp[_F["capacity"]]) >= 0
    return bool(int(hp[DROPPED_ANY]))


def kept_routing(topk_idx: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """``topk_idx [T, K]`` as int64 with the slots capacity dropped set to -1 (``topk_idx``
    itself, as int64, when the plan dropped nothing). The rule is pack's: of this rank's slots to
    expert ``e`` in token order, the first ``own_kept[e]`` are kept. Torch ops on the plan's
    device, no host read (:func:`may_drop` reads the host mirror); values outside ``[0, E)``
    count as unused."""
    idx = topk_idx.to(torch.int64)
    hp = host_plan(plan)
    if not may_drop(plan):
        return idx
    E = int(hp[EXPERTS])
    own_kept = plan[plan_slices(int(hp[RANKS]), E)["own_kept"]].to(idx.device)
    flat = idx.reshape(-1)
    e = torch.where((flat >= 0) & (flat < E), flat, E)             # E: not a kept candidate
    order = torch.sort(e, stable=True).indices
    sorted_e = e[order]
    used = torch.zeros(E + 1, dtype=torch.int64, device=idx.device).index_add_(
        0, e, torch.ones_like(e))
    start = torch.cumsum(used, 0) - used
    rank_in_e = torch.arange(flat.numel(), device=idx.device) - start[sorted_e]
    limit = torch.cat([own_kept, own_kept.new_zeros(1)])
    keep = torch.empty_like(flat, dtype=torch.bool).scatter_(0, order, rank_in_e < limit[sorted_e])
    return torch.where(keep, flat, -1).view(idx.shape)


def kept_token_rows(topk_idx: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """``[R] int64``: this rank's tokens with a kept slot on each rank (dedup's token rows, what
    the count exchange's second all-gather carries)."""
    hp = host_plan(plan)
    R, L = int(hp[RANKS]), int(hp[LOCAL_EXPERTS])
    kept = kept_routing(topk_idx, plan)
    T = kept.shape[0]
    t = torch.arange(T, device=kept.device).unsqueeze(1).expand_as(kept)
    at = torch.where(kept >= 0, t * R + kept // L, T * R)          # T * R: no row
    hit = torch.zeros(T * R + 1, dtype=torch.int64, device=kept.device).index_add_(
        0, at.reshape(-1), torch.ones_like(at).reshape(-1))
    return (hit[:T * R].view(T, R) > 0).sum(0)


def token_rows_gather(gathered: torch.Tensor, plan: torch.Tensor, topk_idx, group, R: int,
                      num_experts: int) -> torch.Tensor:
    """The count exchange's second all-gather (dedup, when capacity dropped a slot anywhere):
    every rank's kept token rows (R words) replace the words' tokens_per_rank, so the plan made
    from the result has the token rows that really travel. Returns the new words ``[R, W]``.
    A rank without its routing contributes -1 words, and every rank then raises."""
    rows = (kept_token_rows(topk_idx, plan) if topk_idx is not None else
            torch.full((R,), -1, dtype=torch.int64, device=gathered.device))
    got = gathered.new_empty((R * R,))
    all_gather(got, rows.to(gathered.device).contiguous(), group,
               "epkit.dispatch (count exchange: token rows)")
    if not got.is_cuda:  # (on CUDA a host read; there the plan kernel sees negative words)
        if bool((got < 0).any()):
            raise ValueError("epkit.count_exchange: capacity dropped slots and a rank gave no "
                             "topk_idx, which the dedup transport's token rows need")
    words = gathered.view(R, -1).clone()
    words[:, WORD_HEADER + num_experts:] = got.view(R, R)
    return words


def _back_layout(hp, per: int):
    """dedup's way back: ``(chunk rows, header rows)`` of a fixed-chunk variant (padded and equal:
    ``min(max slots, per * max token rows)``; static: ``1 + min(slot cap, per * token cap)``),
    ``(None, 0)`` for ragged. Caps from the plan alone, never above pairs' chunk."""
    variant = VARIANT_NAMES[int(hp[VARIANT])]
    if variant == "ragged":
        return None, 0
    tok, slot = int(hp[TOK_CAP]), int(hp[SLOT_CAP])
    if variant == "static":  # the caps count the header row
        return 1 + min(slot - 1, per * (tok - 1)), 1
    return min(slot, per * tok), 0


def _row_chunks(hp, n: int, recv: bool) -> torch.Tensor:
    """``[n] int64``: the peer (chunk) of each row of the dispatch's row space (``recv``: the
    received rows, else the sent ones): compact along the plan's counts, or static chunks."""
    R = int(hp[RANKS])
    if int(hp[STATIC_CAP]) >= 0:
        return torch.arange(n) // (1 + int(hp[STATIC_CAP]))
    counts = hp[plan_slices(R, int(hp[EXPERTS]))["recv_counts" if recv else "send_counts"]]
    return torch.repeat_interleave(torch.arange(R), counts.cpu(), output_size=n)


def _unit_positions(u: torch.Tensor, chunk_of: torch.Tensor, R: int, per: int, chunk, hdr: int):
    """Where the way back puts each token row's rows. ``u [n]``: rows of each token row (row
    space order, chunk-major), ``chunk_of [n]``: its peer. Returns ``(pos [n, per] int64``: the
    way-back row of its i-th row, -1 past ``u``; ``per_chunk [R]`` rows per peer)."""
    per_chunk = torch.zeros(R, dtype=torch.int64, device=u.device).index_add_(0, chunk_of, u)
    base = torch.cumsum(u, 0) - u                                    # compact: rows before it
    if chunk is not None:                                            # fixed chunks
        first = torch.cumsum(per_chunk, 0) - per_chunk
        base = chunk_of * chunk + hdr + base - first[chunk_of]
    i = torch.arange(per, device=u.device)
    return torch.where(i < u.unsqueeze(1), base.unsqueeze(1) + i, -1), per_chunk


def _send_row_slots(kept_idx: torch.Tensor, send_map: torch.Tensor, L: int, S: int,
                    pairs: bool = False) -> torch.Tensor:
    """``[S] int64``: the kept slots of each send row, 0 for the rows ``send_map`` names not (a
    static chunk's header). dedup: token row ``(t, d)``, the row ``send_map [T, R]`` names, with
    the kept routing ``kept_idx [T, K]`` (dropped slots -1); ``pairs``: one slot per row that
    ``send_map [T, K]`` names."""
    if pairs:
        n = (send_map >= 0).to(torch.int64)
    else:
        T, R = send_map.shape
        kept = kept_idx >= 0
        n = torch.zeros((T, R), dtype=torch.int64, device=kept.device).scatter_add_(
            1, torch.where(kept, kept_idx // L, 0), kept.to(torch.int64))
    return torch.zeros(S + 1, dtype=torch.int64, device=n.device).index_add_(
        0, torch.where(send_map >= 0, send_map, S).reshape(-1), n.reshape(-1))[:S]


def _dedup_move_back(rows: torch.Tensor, dtype: torch.dtype, recv_map: torch.Tensor,
                     send_map: torch.Tensor, kept_idx: torch.Tensor, plan: torch.Tensor,
                     group_name: str, async_op: bool, what: str):
    """dedup's way back. ``rows [N, H]`` float32 from gather_rows (a token row's 4H bytes: its
    n rows of ``dtype`` when n <= per, else its float32 partial); only the ``min(n, per)`` rows
    of ``dtype`` each token row uses travel. Returns ``back [S, per * H]`` in ``dtype`` for
    reduce_tokens (or, with ``async_op``, a callable that waits and returns it)."""
    hp = host_plan(plan)
    R, L = int(hp[RANKS]), int(hp[LOCAL_EXPERTS])
    per = 4 // dtype.itemsize
    N, H = rows.shape
    chunk, hdr = _back_layout(hp, per)
    # expert side: its received token rows' rows, laid out for the variant
    u = (recv_map >= 0).sum(1).clamp(max=per)
    pos, send = _unit_positions(u, _row_chunks(hp, N, True).to(u.device), R, per, chunk, hdr)
    total = int(send.sum()) if chunk is None else R * chunk
    buf = rows.new_zeros((total + 1, H), dtype=dtype)               # row `total`: discarded
    buf.index_copy_(0, torch.where(pos >= 0, pos, total).reshape(-1),
                    rows.view(dtype).reshape(N * per, H))
    # source side: the rows each of its token rows gets back
    S = int(hp[SEND_ROWS])
    u_row = _send_row_slots(kept_idx, send_map, L, S).clamp(max=per)
    at, recv = _unit_positions(u_row, _row_chunks(hp, S, False).to(u_row.device), R, per, chunk,
                               hdr)
    group = group_from_name(group_name)
    sizes = ([send.tolist(), recv.tolist()] if chunk is None else [[chunk] * R] * 2)
    move = all_to_all(buf[:total], *sizes, group, "ragged" if chunk is None else "equal",
                      chunk or 0, async_op=async_op, what=what)

    def finish() -> torch.Tensor:
        got = move() if async_op else move
        back = got.new_zeros((S * per + 1, H))                       # row S * per: discarded
        if got.shape[0]:
            dst = torch.where(at >= 0, torch.arange(S * per, device=at.device).view(S, per),
                              S * per)
            back.index_copy_(0, dst.reshape(-1), got[at.clamp(min=0).reshape(-1)])
        return back[:S * per].view(S, per * H)

    return finish if async_op else finish()


def move_back(expert_y: torch.Tensor, row_weight: torch.Tensor, topk_idx: torch.Tensor,
              send_map: torch.Tensor, recv_map: torch.Tensor, plan: torch.Tensor,
              group_name: str, transport: int, weighted: bool, async_op: bool = False,
              what: str = "epkit.combine"):
    """The way back of combine (``expert_y``) or dispatch backward (gradient rows, unweighted):
    gather_rows on the expert side and the exchange. Returns ``(back, idx)`` for
    ``reduce_tokens(back, send_map, idx, ...)`` (``idx``: dedup's kept routing, pairs'
    topk_idx), or with ``async_op`` a callable that waits and returns them."""
    rows = C.gather_rows(expert_y, recv_map, row_weight, transport, weighted)
    if transport == PAIRS:
        moved = _move(rows, plan, group_name, reverse=True, async_op=async_op, what=what)
        if async_op:
            return lambda: (moved(), topk_idx)
        return moved, topk_idx
    kept_idx = kept_routing(topk_idx, plan)
    moved = _dedup_move_back(rows, expert_y.dtype, recv_map, send_map, kept_idx, plan,
                             group_name, async_op, what)
    if async_op:
        return lambda: (moved(), kept_idx)
    return moved, kept_idx


# ---- the weight gradients' way back: one float32 per kept slot -------------------------------

class SlotPlaces(NamedTuple):
    """Where the weight gradients' way back puts each value (:func:`slot_places`).

    first [N] int64: the place of received row n's first value in the expert side's buffer (-1:
    none); rows: that buffer's length; first_src [S] int64: the place of send row r's first value
    in what the source gets back; send / recv: rows to / from each peer; fixed: the chunks are
    of one size (moved split-free)."""
    first: torch.Tensor
    rows: int
    first_src: torch.Tensor
    send: list
    recv: list
    fixed: bool


def slot_places(hp, recv_map: torch.Tensor, send_map: torch.Tensor, idx: torch.Tensor,
                transport: int) -> SlotPlaces:
    """The weight gradients' way back along the dispatch's slot section (pairs' rows, dedup's
    slot rows), transposed: one float32 per kept slot, in slot-row order (dedup: a token row's n
    values k ascending). Ragged: chunks of the plan's slot counts; padded and equal: the section's
    chunk (its largest count); static: its ``1 + cap`` rows, the first a zero row; so pairs' own
    chunks. Each side counts the values of its rows itself (the expert side its received rows'
    kept slots, ``recv_map >= 0``; the source its kept routing's ``idx``): sizes from the host
    plan ``hp``, places as device tensors, nothing read back."""
    R, E, L, S = (int(hp[f]) for f in (RANKS, EXPERTS, LOCAL_EXPERTS, SEND_ROWS))
    dedup = transport == DEDUP
    variant = VARIANT_NAMES[int(hp[VARIANT])]
    chunk = None if variant == "ragged" else int(hp[SLOT_CAP if dedup else TOK_CAP])
    front = 1 if variant == "static" else 0
    u = (recv_map >= 0).sum(1)
    first, _ = _unit_positions(u, _row_chunks(hp, recv_map.shape[0], True).to(u.device), R, 1,
                               chunk, front)
    u_src = _send_row_slots(idx, send_map, L, S, pairs=not dedup)
    first_src, _ = _unit_positions(u_src, _row_chunks(hp, S, False).to(u_src.device), R, 1,
                                   chunk, front)
    if chunk is None:
        sl = plan_slices(R, E)
        send, recv = (hp[sl[n]].tolist() for n in (("recv_slots", "send_slots") if dedup else
                                                   ("recv_counts", "send_counts")))
    else:
        send = recv = [chunk] * R
    return SlotPlaces(first.view(-1), sum(send), first_src.view(-1), send, recv,
                      chunk is not None)


def move_slot_values(values: torch.Tensor, send_map: torch.Tensor, recv_map: torch.Tensor,
                     idx: torch.Tensor, plan: torch.Tensor, group_name: str, transport: int,
                     what: str) -> torch.Tensor:
    """The weight gradients' way back (the gradient of ``row_weight``): ``values [M] float32``
    on the expert side, one per expert-major row -> ``[T, K] float32`` on the source, 0 for
    unused and dropped slots. ``idx [T, K]``: the source's routing (dedup: the kept routing,
    :func:`kept_routing`; pairs: topk_idx). One float32 per kept slot travels
    (:func:`slot_places`; docs/design.md, wire format)."""
    hp = host_plan(plan)
    at = slot_places(hp, recv_map, send_map, idx, transport)
    vals = C.gather_slot_values(values, recv_map, at.first, at.rows)
    back = all_to_all(vals, at.send, at.recv, group_from_name(group_name),
                      "equal" if at.fixed else "ragged", at.send[0] if at.fixed else 0, what=what)
    return C.scatter_slot_values(back, send_map, idx, at.first_src, int(hp[EXPERTS]),
                                 int(hp[RANKS]), transport)


# ---- count exchange: the plan and the collective error --------------------------------------

@torch.library.custom_op("epkit::count_exchange", mutates_args=())
def count_exchange(words: torch.Tensor, group_name: str, rank: int, num_experts: int, align: int,
                   capacity: int, transport: int, exchange: int,
                   max_tokens_per_rank: int, static_shape: Optional[list[int]] = None,
                   capacity_factor: float = -1.0,
                   topk_idx: Optional[torch.Tensor] = None,
                   ranks_per_node: int = 1) -> torch.Tensor:
    """All-gather every rank's count words; return this rank's plan, or raise the group's error.

    Every rank computes the same error from the same gathered words, so bad input on any rank
    raises the same :class:`epkit.InputError` on all of them, before any token moves.
    dedup: when the plan shows that capacity dropped a slot anywhere (``DROPPED_ANY``, the same
    on every rank), one more all-gather of every rank's kept token rows (R words, from
    ``topk_idx`` [T, K], this rank's routing) and the plan again (:func:`token_rows_gather`);
    without drops, none.
    On CUDA the plan stays on the device with its host mirror attached (``epkit/device.py``;
    ``static_shape`` = ``[H, K, x dtype code, payload]`` sizes the static exchange's mirror).
    ``capacity_factor > 0`` replaces ``capacity`` by ``capacity_from_factor(S, E, factor)``, ``S``
    the used slots of the gathered words (on CUDA reading ``S`` is one host wait).
    ``ranks_per_node`` (agreed in the call header) is written into the plan
    (:func:`stamp_ranks_per_node`): combine and the dispatch backward sum in its order.
    """
    return stamp_ranks_per_node(_count_exchange(
        words, group_name, rank, num_experts, align, capacity, transport, exchange,
        max_tokens_per_rank, static_shape, capacity_factor, topk_idx), ranks_per_node)


def _count_exchange(words, group_name, rank, num_experts, align, capacity, transport, exchange,
                    max_tokens_per_rank, static_shape, capacity_factor, topk_idx):
    import torch.distributed as dist

    group = group_from_name(group_name)
    if words.is_cuda:
        from . import device

        if capacity_factor > 0:  # the gathered counts decide the capacity: read them once
            R = dist.get_world_size(group)
            gathered = words.new_empty((R * words.shape[0],))
            all_gather(gathered, words.contiguous(), group, "epkit.dispatch (count exchange)")
            capacity = _factor_capacity(gathered.view(R, -1).cpu(), num_experts, capacity_factor)
        return device.count_exchange(words, group, rank, num_experts, align, capacity, transport,
                                     exchange, max_tokens_per_rank, static_shape, topk_idx)
    R = dist.get_world_size(group)
    gathered = words.new_empty((R * words.shape[0],))  # gloo wants a flat output
    all_gather(gathered, words.contiguous(), group, "epkit.dispatch (count exchange)")
    if capacity_factor > 0:
        capacity = _factor_capacity(gathered.view(R, -1), num_experts, capacity_factor)
    args = (rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank)
    plan = C.plan(gathered.view(R, -1), *args)
    code = int(plan[ERR_CODE])
    if code:
        raise error(int(plan[ERR_RANK]), code, int(plan[ERR_A]), int(plan[ERR_B]))
    if transport == DEDUP and int(plan[DROPPED_ANY]):  # the token rows that really travel
        plan = C.plan(token_rows_gather(gathered, plan, topk_idx, group, R, num_experts), *args)
    return plan


def _factor_capacity(gathered: torch.Tensor, num_experts: int, factor: float) -> int:
    """The capacity of ``factor`` from the gathered words ``[R, 8 + E + R]`` (host memory)."""
    from epkit.reference.capacity import capacity_from_factor

    from epkit.reference.errors import MAX_CAPACITY

    used = int(gathered[:, WORD_HEADER:WORD_HEADER + num_experts].sum())
    return min(capacity_from_factor(used, num_experts, factor), MAX_CAPACITY)  # huge: keeps all


@count_exchange.register_fake
def _(words, group_name, rank, num_experts, align, capacity, transport, exchange,
      max_tokens_per_rank, static_shape=None, capacity_factor=-1.0, topk_idx=None,
      ranks_per_node=1):
    import torch.distributed as dist

    R = dist.get_world_size(group_from_name(group_name))
    return words.new_empty((plan_size(R, num_experts),))


# ---- dispatch ---------------------------------------------------------------------------------

@torch.library.custom_op("epkit::dispatch_tokens", mutates_args=())
def dispatch_tokens(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    plan: torch.Tensor, group_name: str, transport: int, exchange: int,
                    send_bytes: int, recv_rows: int, expert_rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack, exchange, unpack: ``(expert_x, row_src, row_weight, send_map, recv_map)``."""
    send, send_map = C.pack(x, topk_idx, topk_weights, plan, transport,
                            int(host_plan(plan)[RANKS]), send_bytes)
    recv = _move_dispatch(send, plan, group_name)
    del send  # exchanged: freed before unpack allocates expert_x (a lower peak per step)
    expert_x, row_src, row_weight, recv_map = C.unpack(
        recv, plan, transport, x.shape[1], x.dtype, topk_idx.shape[1], recv_rows, expert_rows)
    return expert_x, row_src, row_weight, send_map, recv_map


@dispatch_tokens.register_fake
def _(x, topk_idx, topk_weights, plan, group_name, transport, exchange, send_bytes, recv_rows,
      expert_rows):
    import torch.distributed as dist

    R = dist.get_world_size(group_from_name(group_name))
    T, K = topk_idx.shape
    cols = K if transport == PAIRS else R
    return (x.new_empty((expert_rows, x.shape[1])),
            x.new_empty((expert_rows, 3), dtype=torch.int64),
            x.new_empty((expert_rows,), dtype=torch.float32),
            x.new_empty((T, cols), dtype=torch.int64),
            x.new_empty((recv_rows, 1 if transport == PAIRS else K), dtype=torch.int64))


# ---- the fused prepare-and-dispatch (the eager path) -----------------------------------------

@torch.library.custom_op("epkit::prepare_dispatch", mutates_args=())
def prepare_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     group_name: str, rank: int, num_experts: int, align: int, capacity: int,
                     transport: int, exchange: int, pre_error: list[int], payload: int,
                     capacity_factor: float = -1.0, ranks_per_node: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]:
    """Layout, count exchange, allocation and token exchange in one call.

    Returns ``(expert_x, row_src, row_weight, send_map, recv_map, plan)``. The received sizes
    are read from the plan inside the op (host memory on CPU), so the caller makes no host read
    at all. Its fake kernel declares the two routing-dependent sizes as unbacked (new, not
    guessed); under torch.compile the split ops (prepare / count_exchange / dispatch_tokens) are
    used instead, with the sizes passed in as SymInts.
    """
    words = C.prepare(x, topk_idx, topk_weights, num_experts,
                      _world(group_name), pre_error, payload)
    plan = count_exchange(words, group_name, rank, num_experts, align, capacity, transport,
                          exchange, -1, None, capacity_factor, topk_idx, ranks_per_node)
    hp = host_plan(plan)  # on CUDA the pinned mirror count_exchange made: no second host wait
    if exchange == abi.EXCHANGE_CODES["equal"] and not int(hp[UNIFORM]):
        raise error(int(hp[NONUNIFORM_RANK]), Reason.EQUAL_NONUNIFORM)
    SB, N, M = hp[[SEND_BYTES, RECV_ROWS, EXPERT_ROWS]].tolist()
    return (*dispatch_tokens(x, topk_idx, topk_weights, plan, group_name, transport, exchange,
                             SB, N, M), plan)


def _world(group_name: str) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group_from_name(group_name))


@prepare_dispatch.register_fake
def _(x, topk_idx, topk_weights, group_name, rank, num_experts, align, capacity, transport,
      exchange, pre_error, payload, capacity_factor=-1.0, ranks_per_node=1):
    ctx = torch.library.get_ctx()
    N, M = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    R = _world(group_name)
    T, K = topk_idx.shape
    return (x.new_empty((M, x.shape[1])), x.new_empty((M, 3), dtype=torch.int64),
            x.new_empty((M,), dtype=torch.float32),
            x.new_empty((T, K if transport == PAIRS else R), dtype=torch.int64),
            x.new_empty((N, 1 if transport == PAIRS else K), dtype=torch.int64),
            x.new_empty((plan_size(R, num_experts),), dtype=torch.int64))


def _fused_setup(ctx, inputs, output):
    x, topk_idx, _, group_name, _, _, _, _, transport, exchange, *_ = inputs
    _, _, _, send_map, recv_map, plan = output
    ctx.save_for_backward(send_map, recv_map, topk_idx, plan)
    ctx.meta = (group_name, transport, exchange, x.dtype)


def _fused_backward(ctx, grad_expert_x, _gs, grad_row_weight, *_):
    grad_x, _, grad_w, *_rest = _dispatch_backward(ctx, grad_expert_x, None, grad_row_weight,
                                                    None, None)
    return grad_x, None, grad_w, *([None] * 11)


def _agree_backward(group_name: str, op: int, grad: torch.Tensor, what: str) -> None:
    """A backward pass's call header (epkit/agree.py): every rank is in the same pass, and the
    gradient rows that share its exchange have one dtype. (Its weight-gradient exchange runs on
    every rank: autograd hands a zero gradient for an unused row_weight, never None.)"""
    agree(group_from_name(group_name), header(op, NO_OPTIONS, (0, 0, 0), dtype_code(grad.dtype)),
          f"{what} (call header)")


@torch.library.custom_op("epkit::dispatch_tokens_backward", mutates_args=())
def dispatch_tokens_backward(grad_expert_x: torch.Tensor, grad_row_weight: Optional[torch.Tensor],
                             send_map: torch.Tensor, recv_map: torch.Tensor,
                             topk_idx: torch.Tensor, plan: torch.Tensor, group_name: str,
                             transport: int, exchange: int, x_dtype: torch.dtype
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x [T, H] x dtype, grad_topk_weights [T, K] float32)``.

    grad_x[t] is combine's sum (k ascending per rank, the ranks' partials into node partials
    and those over nodes ascending, ``ranks_per_node`` from the plan) of its slots' gradient
    rows, unweighted; the weight gradient of each slot travels back as one float32.
    """
    _agree_backward(group_name, DISPATCH_BACKWARD, grad_expert_x, "epkit.dispatch backward")
    R, E = int(host_plan(plan)[RANKS]), int(host_plan(plan)[EXPERTS])
    empty_w = grad_expert_x.new_zeros((0,), dtype=torch.float32)
    back, idx = move_back(grad_expert_x, empty_w, topk_idx, send_map, recv_map, plan, group_name,
                          transport, False, what="epkit.dispatch backward")
    grad_x = C.reduce_tokens(back, send_map, idx, empty_w, E, R, transport, False, x_dtype,
                             ranks_per_node(plan))
    if grad_row_weight is None:
        return grad_x, torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
    return grad_x, move_slot_values(grad_row_weight.contiguous(), send_map, recv_map, idx, plan,
                                    group_name, transport,
                                    "epkit.dispatch backward (weight gradients)")


@dispatch_tokens_backward.register_fake
def _(grad_expert_x, grad_row_weight, send_map, recv_map, topk_idx, plan, group_name, transport,
      exchange, x_dtype):
    T, K = topk_idx.shape
    return (grad_expert_x.new_empty((T, grad_expert_x.shape[1]), dtype=x_dtype),
            grad_expert_x.new_empty((T, K), dtype=torch.float32))


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_weights, plan, group_name, transport, exchange, *_ = inputs
    _, _, _, send_map, recv_map = output
    ctx.save_for_backward(send_map, recv_map, topk_idx, plan)
    ctx.meta = (group_name, transport, exchange, x.dtype)


def _dispatch_backward(ctx, grad_expert_x, _grad_src, grad_row_weight, _gs, _gr):
    send_map, recv_map, topk_idx, plan = ctx.saved_tensors
    group_name, transport, exchange, x_dtype = ctx.meta
    grad_x, grad_w = dispatch_tokens_backward(
        grad_expert_x.contiguous(), grad_row_weight, send_map, recv_map, topk_idx, plan,
        group_name, transport, exchange, x_dtype)
    return grad_x, None, grad_w, *([None] * 7)


dispatch_tokens.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
prepare_dispatch.register_autograd(_fused_backward, setup_context=_fused_setup)


# ---- combine ----------------------------------------------------------------------------------

@torch.library.custom_op("epkit::combine_tokens", mutates_args=())
def combine_tokens(expert_y: torch.Tensor, row_weight: torch.Tensor, topk_idx: torch.Tensor,
                   topk_weights: torch.Tensor, send_map: torch.Tensor, recv_map: torch.Tensor,
                   plan: torch.Tensor, group_name: str, transport: int, exchange: int,
                   weighted: bool, out_dtype: torch.dtype, check: list[int]) -> torch.Tensor:
    """``out [T, H]`` in x's dtype: the fixed-order weighted (or plain) sum of expert rows.

    dedup: per token row with n kept slots the expert side sends its n rows of expert_y when
    ``n * itemsize <= 4``, else the float32 partial P_d(t) it forms; pairs: each slot's row. The
    source forms the partials of the raw rows (with its own copy of the weights,
    bit-identical to ``row_weight``) and adds them over d ascending, into node partials first
    when the plan's ``ranks_per_node`` is above 1 (arith.grouped_total_sum).

    ``check`` is this rank's call header (epkit/agree.py) when the ranks agree inside the op
    (under torch.compile, so no data-dependent branch is traced); empty when the caller
    agreed already (the eager path).
    """
    if check:
        agree(group_from_name(group_name), check, "epkit.combine (call header)")
    R, E = int(host_plan(plan)[RANKS]), int(host_plan(plan)[EXPERTS])
    back, idx = move_back(expert_y.contiguous(), row_weight, topk_idx, send_map, recv_map, plan,
                          group_name, transport, weighted)
    return C.reduce_tokens(back, send_map, idx, topk_weights, E, R, transport, weighted,
                           out_dtype, ranks_per_node(plan))


@combine_tokens.register_fake
def _(expert_y, row_weight, topk_idx, topk_weights, send_map, recv_map, plan, group_name,
      transport, exchange, weighted, out_dtype, check):
    return expert_y.new_empty((topk_idx.shape[0], expert_y.shape[1]), dtype=out_dtype)


@torch.library.custom_op("epkit::combine_tokens_backward", mutates_args=())
def combine_tokens_backward(grad_out: torch.Tensor, expert_y: torch.Tensor,
                            row_weight: torch.Tensor, send_map: torch.Tensor,
                            recv_map: torch.Tensor, plan: torch.Tensor, group_name: str,
                            exchange: int, weighted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_expert_y [M, H] y dtype, grad_row_weight [M] float32)``.

    grad_out rows travel the dispatch way (per slot for pairs, per token and rank for dedup);
    the expert side forms ``cast(c * g)`` and ``<g, y>`` for every row; padding rows get 0.
    """
    _agree_backward(group_name, COMBINE_BACKWARD, grad_out, "epkit.combine backward")
    recv_rows = C.scatter_rows(grad_out.contiguous(), send_map, int(host_plan(plan)[SEND_ROWS]))
    recv = _move(recv_rows, plan, group_name, reverse=False, what="epkit.combine backward")
    del recv_rows  # exchanged: freed before combine_backward_dest allocates grad_y
    return C.combine_backward_dest(recv, recv_map, row_weight, expert_y.contiguous(), weighted)


@combine_tokens_backward.register_fake
def _(grad_out, expert_y, row_weight, send_map, recv_map, plan, group_name, exchange, weighted):
    return torch.empty_like(expert_y), expert_y.new_empty((expert_y.shape[0],), dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    expert_y, row_weight, _, _, send_map, recv_map, plan, group_name, _, exchange, weighted, *_ = inputs
    ctx.save_for_backward(expert_y, row_weight, send_map, recv_map, plan)
    ctx.meta = (group_name, exchange, weighted)


def _combine_backward(ctx, grad_out):
    expert_y, row_weight, send_map, recv_map, plan = ctx.saved_tensors
    group_name, exchange, weighted = ctx.meta
    grad_y, grad_w = combine_tokens_backward(grad_out, expert_y, row_weight, send_map, recv_map,
                                             plan, group_name, exchange, weighted)
    return grad_y, (grad_w if weighted else None), *([None] * 11)


combine_tokens.register_autograd(_combine_backward, setup_context=_combine_setup)
