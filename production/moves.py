"""The exchanges inside the ops: the dispatch's token exchange, the return path of combine and the
dispatch backward (pairs' rows; dedup's raw rows or float32 partials, moved as only the rows
used), dedup's kept routing and the count exchange's second all-gather, and the weight
gradients' return path (one float32 per kept slot). Collective calls go through
:func:`epkit.collectives.all_to_all` (the variant table); sizes come from the plan's host
words (``plan_host``, the ops' argument: on the device path the mirror count_exchange made),
so nothing here waits for the device."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _build, workspace
from .collectives import all_gather, all_to_all, group_from_name, variant_of
from .memory import device_path
from .plan import (_F, DEDUP, DROPPED_ANY, EXPERTS, LOCAL_EXPERTS, MAX_CHUNK, RANKS, SEND_ROWS,
                   SLOT_CAP, STATIC_CAP, TOK_CAP, WORD_HEADER, plan_slices, ranks_per_node)
from .transports import by_code
from epkit.reference.capacity import kept_slots

_build.load()
C = torch.ops.epkit  # the kernel bench swaps this module's C to record the calls

# ---- the exchange inside the ops ----------------------------------------------------------

def move_rows(buf: torch.Tensor, plan_host: torch.Tensor, group_name: str, reverse: bool,
              async_op: bool = False, what: str = "epkit", alloc=None):
    """All-to-all of row-space ``buf`` (combine, the backward passes) along the counts of
    ``plan_host`` (the plan's host words: no host wait); ``reverse``: expert side -> source
    side. With ``async_op``, returns a callable that waits and returns the rows. ``alloc``: the
    receive buffer's workspace (production/workspace.py)."""
    R = int(plan_host[RANKS])
    v = variant_of(plan_host)
    variant = v.name
    if v.header_rows:  # fixed chunks of header + cap rows, counts in-band
        send = recv = [v.header_rows + int(plan_host[STATIC_CAP])] * R
        variant = v.packed
    else:
        sl = plan_slices(R, int(plan_host[EXPERTS]))
        send = plan_host[sl["send_counts"]].tolist()
        recv = plan_host[sl["recv_counts"]].tolist()
        if reverse:
            send, recv = recv, send
    return all_to_all(buf, send, recv, group_from_name(group_name), variant,
                      int(plan_host[MAX_CHUNK]), async_op=async_op, what=what, alloc=alloc)


def move_dispatch(buf: torch.Tensor, plan_host: torch.Tensor, group_name: str,
                  async_op: bool = False, alloc=None):
    """The dispatch exchange: ``buf`` holds this rank's chunks back to back as bytes, already in
    the variant's layout (pack pads), so only ragged needs split sizes; ``plan_host``: the plan's
    host words. ``alloc``: the receive buffer's workspace."""
    R = int(plan_host[RANKS])
    sl = plan_slices(R, int(plan_host[EXPERTS]))
    send = plan_host[sl["send_bytes"]].tolist()
    recv = plan_host[sl["recv_bytes"]].tolist()
    return all_to_all(buf, send, recv, group_from_name(group_name), variant_of(plan_host).packed,
                      send[0] if R else 0,
                      async_op=async_op, what="epkit.dispatch (token exchange)", alloc=alloc)


# ---- dedup: the kept routing, and the return path of raw rows or partials -----------------------

def may_drop(plan_host: torch.Tensor) -> bool:
    """Whether capacity may have dropped a slot of this plan: its host words' ``DROPPED_ANY``, 1
    (dropped) or -1 (a routing-free template with a capacity set: maybe;
    production/count_exchange.py)."""
    return int(plan_host[DROPPED_ANY]) != 0


def kept_routing(topk_idx: torch.Tensor, plan: torch.Tensor,
                 plan_host: torch.Tensor) -> torch.Tensor:
    """``topk_idx [T, K]`` as int64 with the slots capacity dropped set to -1 (``topk_idx``
    itself, as int64, when the plan dropped nothing). The rule is pack's: of this rank's slots to
    expert ``e`` in token order, the first ``own_kept[e]`` are kept (the reference's lines,
    ``capacity.kept_slots``, run on torch tensors). Torch ops on the plan's
    device, no host read (:func:`may_drop` reads ``plan_host``); values outside ``[0, E)``
    count as unused."""
    hp = plan_host
    return kept_routing_of(topk_idx, plan, int(hp[RANKS]), int(hp[EXPERTS]), may_drop(hp))


def kept_routing_of(topk_idx: torch.Tensor, plan: torch.Tensor, R: int, E: int,
                    drops: bool) -> torch.Tensor:
    """:func:`kept_routing` without the host words: ``drops``, whether capacity may have
    dropped a slot (a capacity is set); ``R`` ranks, ``E`` experts."""
    idx = topk_idx.to(torch.int64)
    if not drops:
        return idx
    own_kept = plan[plan_slices(R, E)["own_kept"]].to(idx.device)
    flat = idx.reshape(-1)
    e = torch.where((flat >= 0) & (flat < E), flat, E)             # E: not a kept candidate
    keep = kept_slots(torch, e, torch.cat([own_kept, own_kept.new_zeros(1)]))
    return torch.where(keep, flat, -1).view(idx.shape)


def kept_token_rows(topk_idx: torch.Tensor, plan: torch.Tensor,
                    plan_host: torch.Tensor) -> torch.Tensor:
    """``[R] int64``: this rank's tokens with a kept slot on each rank (dedup's token rows, what
    the count exchange's second all-gather carries)."""
    R, L = int(plan_host[RANKS]), int(plan_host[LOCAL_EXPERTS])
    kept = kept_routing(topk_idx, plan, plan_host)
    T = kept.shape[0]
    t = torch.arange(T, device=kept.device).unsqueeze(1).expand_as(kept)
    at = torch.where(kept >= 0, t * R + kept // L, T * R)          # T * R: no row
    hit = torch.zeros(T * R + 1, dtype=torch.int64, device=kept.device).index_add_(
        0, at.reshape(-1), torch.ones_like(at).reshape(-1))
    return (hit[:T * R].view(T, R) > 0).sum(0)


def token_rows_gather(gathered: torch.Tensor, plan: torch.Tensor, plan_host: torch.Tensor,
                      topk_idx, group, R: int, num_experts: int) -> torch.Tensor:
    """The count exchange's second all-gather (dedup, when capacity dropped a slot anywhere):
    every rank's kept token rows (R words) replace the words' tokens_per_rank, so the plan made
    from the result has the token rows that really travel. Returns the new words ``[R, W]``.
    A rank without its routing contributes -1 words, and every rank then raises."""
    rows = (kept_token_rows(topk_idx, plan, plan_host) if topk_idx is not None else
            torch.full((R,), -1, dtype=torch.int64, device=gathered.device))
    got = gathered.new_empty((R * R,))
    all_gather(got, rows.to(gathered.device).contiguous(), group,
               "epkit.dispatch (count exchange: token rows)")
    if not device_path(got):  # (on the device a host read; there the plan kernel sees the
        # negative words)
        if bool((got < 0).any()):
            raise ValueError("epkit.count_exchange: capacity dropped slots and a rank gave no "
                             "topk_idx, which the dedup transport's token rows need")
    words = gathered.view(R, -1).clone()
    words[:, WORD_HEADER + num_experts:] = got.view(R, R)
    return words


def _back_layout(hp, per: int):
    """dedup's return path: ``(chunk rows, header rows)`` of a fixed-chunk variant (padded and
    equal: ``min(max slots, per * max token rows)``; static: ``1 + min(slot cap, per * token
    cap)``),
    ``(None, 0)`` for ragged. Caps from the plan alone, never above pairs' chunk."""
    v = variant_of(hp)
    if not v.fixed_chunks:
        return None, 0
    tok, slot, h = int(hp[TOK_CAP]), int(hp[SLOT_CAP]), v.header_rows  # the caps count h
    return h + min(slot - h, per * (tok - h)), h


def _ragged_bounds(hp, per: int) -> list:
    """dedup's ragged return path on the device path: ``[send, recv]`` rows per peer from the
    plan's host words alone, ``min(slot rows, per * token rows)`` of each chunk (the expert
    side sends to s what it received from s; the source receives from d what it sent d). Exact
    for ``per = 1`` (float32: a unit per token row) and whenever no token row has more than
    ``per`` kept slots; else a bound, the rest of the chunk unread padding. The exact counts
    (``min(n, per)`` summed) live only on the device: reading them is a host wait per combine
    and backward pass, which this avoids."""
    sl = plan_slices(int(hp[RANKS]), int(hp[EXPERTS]))

    def chunks(rows, slots):
        return [min(s, per * r) for r, s in zip(hp[sl[rows]].tolist(), hp[sl[slots]].tolist())]

    return [chunks("recv_counts", "recv_slots"), chunks("send_counts", "send_slots")]


def _row_chunks(hp, plan: torch.Tensor, n: int, recv: bool) -> torch.Tensor:
    """``[n] int64`` on ``plan``'s device: the peer (chunk) of each row of the dispatch's row
    space (``recv``: the received rows, else the sent ones): compact along the plan's counts, or
    static chunks. Built on the device from the device plan (a table built on the host would be
    a host-to-device copy: a wait on CUDA, and not allowed in a CUDA-graph capture); ``hp``,
    the host mirror, gives only sizes."""
    R = int(hp[RANKS])
    ar = torch.arange(n if int(hp[STATIC_CAP]) >= 0 else R, device=plan.device)
    if int(hp[STATIC_CAP]) >= 0:
        return ar // (1 + int(hp[STATIC_CAP]))
    counts = plan[plan_slices(R, int(hp[EXPERTS]))["recv_counts" if recv else "send_counts"]]
    return torch.repeat_interleave(ar, counts, output_size=n)


def _unit_positions(u: torch.Tensor, chunk_of: torch.Tensor, R: int, per: int, chunk, hdr: int):
    """Where the return path puts each token row's rows. ``u [n]``: rows of each token row (row
    space order, chunk-major), ``chunk_of [n]``: its peer; ``chunk``: None (compact) or the
    rows of every chunk (fixed chunks). The torch form (the C++ path's); the device path's is
    one launch (:func:`_device_sides`). Returns ``(pos [n, per] int64``: the way-back row of
    its i-th row, -1 past ``u``; ``per_chunk [R]`` rows per peer)."""
    per_chunk = torch.zeros(R, dtype=torch.int64, device=u.device).index_add_(0, chunk_of, u)
    base = torch.cumsum(u, 0) - u                                    # compact: rows before it
    if chunk is not None:                                            # fixed chunks
        first = torch.cumsum(per_chunk, 0) - per_chunk
        start = chunk_of * chunk
        base = start + hdr + base - first[chunk_of]
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


class Back(NamedTuple):
    """What the return path delivers to the source (:func:`move_back`), the arguments of
    :func:`reduce_back`. rows: pairs' ``[S, H]`` slot rows; dedup's received units ``[U, H]`` in
    y's dtype (a token row's ``min(n, per)`` units: its n rows, or its float32 partial's bytes).
    idx ``[T, K]``: dedup's kept routing, pairs' topk_idx. first ``[S] int64``: dedup, where send
    row r's units start in ``rows`` (-1: none); None for pairs."""
    rows: torch.Tensor
    idx: torch.Tensor
    first: Optional[torch.Tensor]


def _dedup_move_back(expert_y: torch.Tensor, row_weight: torch.Tensor, weighted: bool,
                     recv_map: torch.Tensor, send_map: torch.Tensor, kept_idx: torch.Tensor,
                     plan: torch.Tensor, hp: torch.Tensor, group_name: str, async_op: bool,
                     what: str, ws: int):
    """dedup's return path: gather_units writes the units the exchange sends (a token row with n
    kept slots: its n rows of y when ``n <= per = 4 / itemsize``, else its float32 partial, as
    ``min(n, per)`` units of H elements), placed along the variant's chunks; the source reads
    the received buffer in place. Both buffers from workspace ``ws``. Returns a :class:`Back`
    (or, with ``async_op``, a callable that waits and returns it)."""
    R, L = int(hp[RANKS]), int(hp[LOCAL_EXPERTS])
    per = 4 // expert_y.dtype.itemsize
    N, S = recv_map.shape[0], int(hp[SEND_ROWS])
    chunk, hdr = _back_layout(hp, per)
    if device_path(expert_y):
        # each peer's chunk from the plan's host words (no host read); the places and the
        # units' map in one launch a side (triton/places.py)
        bounds = _ragged_bounds(hp, per) if chunk is None else None
        total = R * chunk if chunk is not None else sum(bounds[0])
        first, umap, at = _device_sides(recv_map, plan, hp, per, chunk, hdr,
                                        umap_units=total, M=expert_y.shape[0],
                                        send_map=send_map, idx=kept_idx)
        buf = workspace.empty(workspace.allocator(ws, workspace.SEND),
                              (total, expert_y.shape[1]), expert_y.dtype, expert_y)
        from .triton import combine as kernels

        kernels.units(expert_y, umap, recv_map, row_weight, True, weighted, buf)
        sizes = [[chunk] * R] * 2 if chunk is not None else bounds
    else:
        # expert side: each received token row's first unit, laid out for the variant
        u = (recv_map >= 0).sum(1).clamp(max=per)
        first, send = _unit_positions(u, _row_chunks(hp, plan, N, True), R, 1, chunk, hdr)
        total = R * chunk if chunk is not None else int(send.sum())
        buf = workspace.empty(workspace.allocator(ws, workspace.SEND),
                              (total, expert_y.shape[1]), expert_y.dtype, expert_y)
        C.gather_units(expert_y, recv_map, row_weight, DEDUP, weighted, first.view(-1), buf)
        # source side: where each of its token rows' units arrive
        u_row = _send_row_slots(kept_idx, send_map, L, S).clamp(max=per)
        at, recv = _unit_positions(u_row, _row_chunks(hp, plan, S, False), R, 1, chunk, hdr)
        sizes = [[chunk] * R] * 2 if chunk is not None else [send.tolist(), recv.tolist()]
    move = all_to_all(buf, *sizes, group_from_name(group_name),
                      "ragged" if chunk is None else "equal", chunk or 0, async_op=async_op,
                      what=what, alloc=workspace.allocator(ws, workspace.RECV))
    if async_op:
        return lambda: Back(move(), kept_idx, at.view(-1))
    return Back(move, kept_idx, at.view(-1))


DENSE = 2  # triton/places.py's DENSE: one unit a data row (a name the C++ path can import)


def _device_sides(recv_map: torch.Tensor, plan: torch.Tensor, hp, ucap: int, chunk, hdr: int,
                  compact: Optional[tuple] = None, umap_units: int = -1, M: int = 0,
                  slot_values: Optional[torch.Tensor] = None,
                  send_map: Optional[torch.Tensor] = None, idx: Optional[torch.Tensor] = None):
    """:func:`_unit_positions` of the device path for both sides in one launch
    (triton/places.py): the first unit of each received row (its units ``recv_map``'s entries
    >= 0) and of each sent row (dedup, ``send_map`` and ``idx`` given: its token's kept slots on
    the row's rank; pairs: one a data row), at most ``ucap`` a row. Chunks: ``chunk`` units
    each after ``hdr`` header units; else each peer's bound ``min(slots, ucap * rows)`` from the
    plan (:func:`_ragged_bounds`), or, with ``compact`` = (the received side's, the sent side's)
    word sections, the plan's exact counts. Returns ``(first, umap or None, first_src)``
    (``umap_units >= 0``: dedup's units map too, or with ``slot_values`` the weight gradients'
    values laid out over that many places)."""
    from .triton import places

    R, E = int(hp[RANKS]), int(hp[EXPERTS])
    sl = plan_slices(R, E)
    recv_sizes, send_sizes = compact or ("recv_slots", "send_slots")
    mode = (places.FIXED if chunk is not None else places.COMPACT if compact is not None
            else places.BOUNDED)
    return places.sides(recv_map, plan, R, ucap=ucap, mode=mode,
                        recv_counts_off=sl["recv_counts"].start,
                        recv_sizes_off=sl[recv_sizes].start,
                        send_counts_off=sl["send_counts"].start,
                        send_sizes_off=sl[send_sizes].start, S=int(hp[SEND_ROWS]),
                        static_cap=int(hp[STATIC_CAP]), chunk=chunk or 0, hdr=hdr,
                        umap_units=umap_units,
                        per=ucap if umap_units >= 0 and slot_values is None else 1, M=M,
                        slot_values=slot_values, send_map=send_map, idx=idx, E=E)


def move_back(expert_y: torch.Tensor, row_weight: torch.Tensor, topk_idx: torch.Tensor,
              send_map: torch.Tensor, recv_map: torch.Tensor, plan: torch.Tensor,
              plan_host: torch.Tensor, group_name: str, transport: int, weighted: bool,
              async_op: bool = False, what: str = "epkit.combine", ws: int = -1):
    """The return path of combine (``expert_y``) or dispatch backward (gradient rows, unweighted):
    gather_units on the expert side and the exchange. Returns a :class:`Back` for
    :func:`reduce_back`, or with ``async_op`` a callable that waits and returns it. ``ws``:
    the Dispatcher's workspace key (-1: none; the lazy schedule, ``async_op``, takes none: its
    buffers may be in flight together)."""
    if async_op:
        ws = -1
    if not by_code(transport).returns_units:  # each slot's row, as it is
        rows = workspace.empty(workspace.allocator(ws, workspace.SEND),
                               (recv_map.shape[0], expert_y.shape[1]), expert_y.dtype, expert_y)
        C.gather_units(expert_y, recv_map, row_weight, transport, weighted, None, rows)
        moved = move_rows(rows, plan_host, group_name, reverse=True, async_op=async_op,
                          what=what, alloc=workspace.allocator(ws, workspace.RECV))
        if async_op:
            return lambda: Back(moved(), topk_idx, None)
        return Back(moved, topk_idx, None)
    return _dedup_move_back(expert_y, row_weight, weighted, recv_map, send_map,
                            kept_routing(topk_idx, plan, plan_host), plan, plan_host, group_name,
                            async_op, what, ws)


def reduce_back(back: Back, send_map: torch.Tensor, topk_weights: torch.Tensor,
                plan_host: torch.Tensor, transport: int, weighted: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The source side of the return path: ``[T, H] out_dtype``, each token's sum in the spec's
    order (reduce_tokens; ``ranks_per_node`` from the plan). ``topk_weights [T, K] float32``:
    the source's weights (unread unweighted); ``plan_host``: the plan's host words."""
    return C.reduce_tokens(back.rows, send_map, back.idx, topk_weights, int(plan_host[EXPERTS]),
                           int(plan_host[RANKS]), transport, weighted, out_dtype,
                           ranks_per_node(plan_host), back.first)


# ---- the weight gradients' return path: one float32 per kept slot -------------------------------

class SlotPlaces(NamedTuple):
    """Where the weight gradients' return path puts each value (:func:`slot_places`).

    first [N] int64: the place of received row n's first value in the expert side's buffer (-1:
    none); rows: that buffer's length; first_src [S] int64: the place of send row r's first value
    in what the source gets back; send / recv: rows to / from each peer; fixed: the chunks are
    of one size (moved split-free); values: on the device path, the expert side's values laid
    out along ``first`` (what gather_slot_values gives), made in the same launch."""
    first: torch.Tensor
    rows: int
    first_src: torch.Tensor
    send: list
    recv: list
    fixed: bool
    values: Optional[torch.Tensor] = None


def slot_places(hp, recv_map: torch.Tensor, send_map: torch.Tensor, idx: torch.Tensor,
                transport: int, plan: Optional[torch.Tensor] = None,
                values: Optional[torch.Tensor] = None) -> SlotPlaces:
    """The weight gradients' return path along the dispatch's slot section (pairs' rows, dedup's
    slot rows), transposed: one float32 per kept slot, in slot-row order (dedup: a token row's n
    values k ascending). Ragged: chunks of the plan's slot counts; padded and equal: the section's
    chunk (its largest count); static: its ``1 + cap`` rows, the first a zero row; so pairs' own
    chunks. Each side counts the values of its rows itself (the expert side its received rows'
    kept slots, ``recv_map >= 0``; the source its kept routing's ``idx``): sizes from the host
    plan ``hp``, places as device tensors built from ``plan`` (the device plan; ``hp`` when
    None), nothing read back and nothing copied over."""
    plan = hp if plan is None else plan
    R, E, L, S = (int(hp[f]) for f in (RANKS, EXPERTS, LOCAL_EXPERTS, SEND_ROWS))
    tr = by_code(transport)
    many = tr.rows_hold_many_slots
    v = variant_of(hp)
    chunk = int(hp[_F[tr.slot_cap_field]]) if v.fixed_chunks else None
    front = v.header_rows
    sl = plan_slices(R, E)
    if chunk is None:
        send, recv = (hp[sl[n]].tolist() for n in tr.slot_sections)
    else:
        send = recv = [chunk] * R
    sent = None  # the expert side's values, laid out (the device path, given values)
    if device_path(recv_map):  # one launch a side (triton/places.py); ragged: exact counts
        every = 1 << 40  # a row's kept slots, uncapped
        # a token row carries its token's kept slots; a slot row one (every data row of a chunk)
        first, sent, first_src = _device_sides(
            recv_map, plan, hp, every, chunk, front, compact=tr.slot_sections,
            umap_units=sum(send) if values is not None else -1, slot_values=values,
            send_map=send_map if many else None, idx=idx if many else None)
    else:
        u_src = _send_row_slots(idx, send_map, L, S, pairs=not many)
        u = (recv_map >= 0).sum(1)
        first, _ = _unit_positions(u, _row_chunks(hp, plan, recv_map.shape[0], True), R, 1,
                                   chunk, front)
        first_src, _ = _unit_positions(u_src, _row_chunks(hp, plan, S, False), R, 1,
                                       chunk, front)
    return SlotPlaces(first.view(-1), sum(send), first_src.view(-1), send, recv,
                      chunk is not None, sent)


def move_slot_values(values: torch.Tensor, send_map: torch.Tensor, recv_map: torch.Tensor,
                     idx: torch.Tensor, plan: torch.Tensor, plan_host: torch.Tensor,
                     group_name: str, transport: int, what: str) -> torch.Tensor:
    """The weight gradients' return path (the gradient of ``row_weight``): ``values [M] float32``
    on the expert side, one per expert-major row -> ``[T, K] float32`` on the source, 0 for
    unused and dropped slots. ``idx [T, K]``: the source's routing (dedup: the kept routing,
    :func:`kept_routing`; pairs: topk_idx). One float32 per kept slot travels
    (:func:`slot_places`; docs/design.md, wire format)."""
    hp = plan_host
    at = slot_places(hp, recv_map, send_map, idx, transport, plan, values)
    vals = (at.values if at.values is not None else
            C.gather_slot_values(values, recv_map, at.first, at.rows))
    back = all_to_all(vals, at.send, at.recv, group_from_name(group_name),
                      "equal" if at.fixed else "ragged", at.send[0] if at.fixed else 0, what=what)
    return C.scatter_slot_values(back, send_map, idx, at.first_src, int(hp[EXPERTS]),
                                 int(hp[RANKS]), transport)


