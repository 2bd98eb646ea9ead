"""A plain-torch expert-parallel dispatcher, written the way Megatron / torchtitan do it.

The baseline the harness proves (and the benchmarks time): no extension, no custom kernels,
only torch ops and ``torch.distributed``:

1. count exchange: every rank all-gathers its per-expert slot counts (one host read of an
   ``[R, E]`` matrix, like Megatron's ``.tolist()`` of the splits); capacity, split sizes and the
   expert-major layout all follow from it on the host;
2. permute: ``argsort`` the used slots by expert (stable, so tokens stay ascending), keep the
   first ``capacity`` of each expert group-wide, gather one row per kept slot;
3. one ``all_to_all_single`` with split sizes moves ``row | t, k, weight`` as raw bytes;
4. chunk sort: the receive buffer is ``(source, local expert, token)``; one scatter puts every
   row at its expert-major place (``(local expert, source, token)``), padded to ``align``;
5. combine: the reverse all-to-all brings every expert row back to its source, which sums in
   the spec's order: per destination rank over ``k`` ascending, then over ranks ascending, each
   product and sum one rounded float32 operation. Every step of that sum touches each output row
   at most once (the indices of one step are unique), so the result is bit-exact and
   deterministic on any device, which Megatron's ``index_add`` / ``scatter_add`` combine is not.

Autograd: two hand-written ``torch.autograd.Function`` s (as Megatron's ``_AllToAll``);
dispatch's backward is the same two-level sum, unweighted; combine's backward sends
``cast(c_k * grad_out[t])`` to the experts and computes the weight gradient at the source.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["PlainTorchDispatcher", "PlainDispatch"]

_META = 12  # bytes of (int32 t, int32 k, float32 w) appended to every row on the wire


def _a2a_bytes(rows: torch.Tensor, out_rows: int, out_splits, in_splits, group,
               chunk: int | None = None) -> torch.Tensor:
    """One ``all_to_all_single`` of ``rows`` (any dtype, [n, ...]) as bytes: with split sizes,
    or (``chunk``: the group-wide largest split) every chunk padded to ``chunk`` rows and an
    equal-length all-to-all, for a backend without split sizes."""
    send = rows.contiguous()
    shape = send.shape[1:]
    width = shape.numel() * send.element_size()
    b = send.view(torch.uint8).reshape(send.shape[0], width)
    if chunk is None:
        recv = torch.empty((out_rows, width), dtype=torch.uint8, device=b.device)
        dist.all_to_all_single(recv, b, list(out_splits), list(in_splits), group=group)
    else:
        R = len(in_splits)
        padded = b.new_zeros((R * chunk, width))
        padded[_chunk_rows(in_splits, chunk, b.device)] = b
        full = torch.empty_like(padded)
        dist.all_to_all_single(full, padded, group=group)
        recv = full[_chunk_rows(out_splits, chunk, b.device)]
    return recv.view(rows.dtype).reshape(out_rows, *shape)


def _chunk_rows(splits, chunk: int, device) -> torch.Tensor:
    """Rows of the padded buffer that hold data: chunk q's first ``splits[q]`` rows."""
    n = torch.as_tensor(list(splits), dtype=torch.int64)
    total = int(n.sum())
    starts = torch.cumsum(n, 0) - n
    pos = torch.arange(total) - torch.repeat_interleave(starts, n, output_size=total)
    base = torch.repeat_interleave(torch.arange(len(n)) * chunk, n, output_size=total)
    return (base + pos).to(device)


@dataclass
class _Plan:
    """Everything routing-dependent, computed once per dispatch and reused by the backward
    passes and by combine."""

    group: object
    R: int
    T: int
    H: int
    M: int
    send_splits: list  # rows this rank sends to each rank
    recv_splits: list  # rows this rank receives from each rank
    send_t: torch.Tensor  # [n_send] token of each kept slot, in send order
    send_k: torch.Tensor  # [n_send] top-k position
    dest: torch.Tensor  # [n_recv] expert-major row of each received row
    # the two-level sum at the source (see _two_level_sum)
    k_order: torch.Tensor  # [n_send] slots sorted by k (stable)
    k_steps: list  # per k present: (start, end, pair ids) over k_order; pair ids unique
    pair_t: torch.Tensor  # [P] token of each (token, rank) pair; pairs ordered by (m, t)
    m_steps: list  # per ordinal m (a token's m-th rank): (start, end) over the pairs
    chunk: int | None = None  # the padded exchange's chunk (group-wide largest split)

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Slot rows in send order -> this rank's received rows (the dispatch direction)."""
        return _a2a_bytes(rows, sum(self.recv_splits), self.recv_splits, self.send_splits,
                          self.group, self.chunk)

    def to_sources(self, rows: torch.Tensor) -> torch.Tensor:
        """Received rows -> slot rows in send order, back at their source (combine)."""
        return _a2a_bytes(rows, sum(self.send_splits), self.send_splits, self.recv_splits,
                          self.group, self.chunk)


@dataclass
class PlainDispatch:
    expert_x: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    row_src: torch.Tensor
    row_weight: torch.Tensor
    dropped_per_expert: torch.Tensor
    plan: _Plan
    topk_weights: torch.Tensor
    x_dtype: torch.dtype


def _two_level_sum(rows: torch.Tensor, plan: _Plan, coef: torch.Tensor | None) -> torch.Tensor:
    """[n_send, H] rows in send order -> [T, H] float32: for every token, per destination rank
    the sum over k ascending of ``coef * row`` (float32, from +0), then the sum of those partials
    over ranks ascending (from +0).

    Vectorized by step: step k adds every slot with that k to its (token, rank) partial, step m
    adds every token's m-th partial to its output. Within a step the targets are unique, so each
    element gets exactly one rounded add per step, in the spec's order; rows are pre-sorted so a
    step reads a contiguous slice. (The first step of each level writes ``v + 0.0``: the same
    bits as ``+0 + v``, without reading the zeros.)"""
    z = rows.index_select(0, plan.k_order).to(torch.float32)
    if coef is not None:
        z = z * coef.index_select(0, plan.k_order)[:, None]
    partial = torch.zeros((plan.pair_t.shape[0], plan.H), dtype=torch.float32,
                          device=rows.device)
    for i, (a, b, p) in enumerate(plan.k_steps):
        add = z[a:b] + 0.0 if i == 0 else partial.index_select(0, p).add_(z[a:b])
        partial.index_copy_(0, p, add)
    out = torch.zeros((plan.T, plan.H), dtype=torch.float32, device=rows.device)
    for i, (a, b) in enumerate(plan.m_steps):
        t = plan.pair_t[a:b]
        add = partial[a:b] + 0.0 if i == 0 else out.index_select(0, t).add_(partial[a:b])
        out.index_copy_(0, t, add)
    return out


def _steps(counts) -> list:
    """(start, end) of every non-empty run, for runs of the given lengths laid end to end."""
    ends = np.cumsum(counts, dtype=np.int64).tolist()
    return [(e - c, e) for c, e in zip(counts, ends) if c]


@dataclass
class _Counts:
    """What the count exchange tells this rank (NumPy, host): ``cnt``/``kept`` [R, E] used and
    kept slots per (source, expert); ``recv_c`` [R, L] kept slots each source sends to this
    rank's experts; split sizes, the padded chunk, ``tpe`` [L], ``offsets`` [L + 1], ``M``."""
    rank: int
    cnt: np.ndarray
    kept: np.ndarray
    send_splits: list
    recv_splits: list
    recv_c: np.ndarray
    tpe: np.ndarray
    offsets: np.ndarray
    M: int
    dropped: np.ndarray
    chunk: int | None


def _count_exchange(flat, group, R, me, E, align, capacity, padded) -> _Counts:
    """1. all-gather of every rank's per-expert counts; the one host read. The capacity rule
    is written out here (not imported from the reference): this baseline is the harness's
    second, independent implementation."""
    L = E // R
    used = flat >= 0
    counts = torch.bincount(flat[used], minlength=E)
    gathered = [torch.empty_like(counts) for _ in range(R)]
    dist.all_gather(gathered, counts, group=group)
    cnt = torch.stack(gathered).cpu().numpy()  # [R, E]
    if capacity is None:
        kept = cnt
    else:
        before = np.cumsum(cnt, axis=0) - cnt  # slots from lower ranks
        kept = np.clip(capacity - before, 0, cnt)
    rows = kept.reshape(R, R, L).sum(axis=2)  # [source, destination] rows on the wire
    recv_c = kept[:, me * L:(me + 1) * L]
    tpe = recv_c.sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(-(-tpe // align) * align)])
    return _Counts(me, cnt, kept, rows[me].tolist(), recv_c.sum(axis=1).tolist(), recv_c, tpe,
                   offsets, int(offsets[-1]), cnt[:, me * L:(me + 1) * L].sum(axis=0) - tpe,
                   int(rows.max(initial=0)) if padded else None)


def _permute(flat, topk_weights, c: _Counts, K, L):
    """2. used slots sorted by expert (stable: token ascending), the first ``kept[me, e]`` of
    each kept: their token, k, destination, and the 12 metadata bytes ``t | k | w``."""
    E, dev = c.cnt.shape[1], flat.device
    used = flat >= 0
    key = torch.where(used, flat, E)
    order = torch.argsort(key, stable=True)[: int(used.sum())]
    e_sorted = flat[order]
    mine = c.cnt[c.rank]
    start = torch.as_tensor(np.cumsum(mine) - mine, device=dev)
    pos = torch.arange(order.shape[0], device=dev) - start[e_sorted]
    keep = pos < torch.as_tensor(c.kept[c.rank], device=dev)[e_sorted]
    slots = order[keep]
    send_t, send_k = slots // K, slots % K
    w_send = topk_weights.detach()[send_t, send_k].to(torch.float32)
    meta = torch.stack([send_t.to(torch.int32), send_k.to(torch.int32),
                        w_send.view(torch.int32)], dim=1).view(torch.uint8)
    return send_t, send_k, flat[slots] // L, meta


def _chunk_sort(c: _Counts, R, dev):
    """3./4. the received chunks come in order (s, j, t); ``dest`` [n_recv]: each received
    row's expert-major row (j, s, t order, padded); ``src_rank`` [n_recv]: its source."""
    n = c.recv_c.reshape(-1)  # chunks in receive order (s, j)
    in_start = np.cumsum(n) - n
    out_start = (c.offsets[:-1][None, :] + np.cumsum(c.recv_c, axis=0) - c.recv_c).reshape(-1)
    n_recv = int(n.sum())
    dest = (torch.repeat_interleave(torch.as_tensor(out_start - in_start, device=dev),
                                    torch.as_tensor(n, device=dev), output_size=n_recv)
            + torch.arange(n_recv, device=dev))
    src_rank = torch.repeat_interleave(torch.arange(R, device=dev),
                                       torch.as_tensor(c.recv_splits, device=dev),
                                       output_size=n_recv)
    return dest, src_rank


def _sum_plan(send_t, send_k, send_d, R, K):
    """The source side of the two-level sum: (token, rank) pairs ordered by (m, t), m the
    pair's ordinal among its token's ranks, and the slots ordered by k (see _two_level_sum)."""
    dev = send_t.device
    pair_keys, pair_of_slot = torch.unique(send_t * R + send_d, sorted=True, return_inverse=True)
    pair_t = pair_keys // R
    m = torch.arange(pair_t.shape[0], device=dev) - torch.searchsorted(pair_t, pair_t)
    by_m = torch.argsort(m, stable=True)
    new_id = torch.empty_like(by_m)
    new_id[by_m] = torch.arange(by_m.shape[0], device=dev)
    m_steps = _steps(torch.bincount(m, minlength=1).tolist() if m.numel() else [])
    k_order = torch.argsort(send_k, stable=True)
    p_sorted = new_id[pair_of_slot][k_order]
    k_steps = [(a, b, p_sorted[a:b])
               for a, b in _steps(torch.bincount(send_k, minlength=K).tolist())]
    return k_order, k_steps, pair_t[by_m], m_steps


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_meta, plan: _Plan):
        ctx.plan = plan
        ctx.x_dtype = x.dtype
        payload = x.index_select(0, plan.send_t)
        nbytes = plan.H * payload.element_size()
        send = torch.cat([payload.view(torch.uint8).reshape(payload.shape[0], nbytes),
                          send_meta], dim=1)
        recv = plan.to_experts(send)
        expert_x = x.new_zeros((plan.M, plan.H))
        expert_x.index_copy_(0, plan.dest, recv[:, :nbytes].contiguous().view(x.dtype))
        # fresh, dense storage: 4-byte aligned, so it can be viewed as int32
        recv_meta = torch.empty((recv.shape[0], _META), dtype=torch.uint8, device=recv.device)
        recv_meta.copy_(recv[:, nbytes:])
        ctx.mark_non_differentiable(recv_meta)
        return expert_x, recv_meta

    @staticmethod
    def backward(ctx, grad_expert_x, _grad_meta):
        plan: _Plan = ctx.plan
        if grad_expert_x is None:
            grad_expert_x = torch.zeros((plan.M, plan.H), dtype=ctx.x_dtype)
        rows = grad_expert_x.to(ctx.x_dtype).index_select(0, plan.dest)
        back = plan.to_sources(rows)
        return _two_level_sum(back, plan, None).to(ctx.x_dtype), None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_y, topk_weights, plan: _Plan, weighted: bool, x_dtype):
        back = plan.to_sources(expert_y.index_select(0, plan.dest))
        coef = topk_weights[plan.send_t, plan.send_k] if weighted else None
        ctx.plan, ctx.weighted, ctx.y_dtype = plan, weighted, expert_y.dtype
        ctx.w_shape = topk_weights.shape
        ctx.save_for_backward(back if weighted else None, coef)
        return _two_level_sum(back, plan, coef).to(x_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        plan: _Plan = ctx.plan
        y_rows, coef = ctx.saved_tensors
        g = grad_out.to(torch.float32).index_select(0, plan.send_t)
        gy = (g * coef[:, None] if ctx.weighted else g).to(ctx.y_dtype)
        recv = plan.to_experts(gy)
        grad_y = torch.zeros((plan.M, plan.H), dtype=ctx.y_dtype, device=grad_out.device)
        grad_y.index_copy_(0, plan.dest, recv)
        grad_w = None
        if ctx.weighted and ctx.needs_input_grad[1]:
            grad_w = torch.zeros(ctx.w_shape, dtype=torch.float32, device=grad_out.device)
            grad_w[plan.send_t, plan.send_k] = (g * y_rows.to(torch.float32)).sum(dim=1)
        return grad_y, grad_w, None, None, None


class PlainTorchDispatcher:
    """``factory(group)`` -> this; the adapter protocol of :mod:`epkit.verify.adapters`."""

    # The exchange variants this baseline carries out: whether the chunks are padded to one
    # length (the group-wide largest split), for a backend without split sizes.
    PADDED = {"ragged": False, "padded": True}

    def __init__(self, group=None, exchange: str = "ragged"):
        if exchange not in self.PADDED:
            raise ValueError(f"plain_torch: exchange must be one of {', '.join(self.PADDED)}, "
                             f"got {exchange!r}")
        self.group = group
        self.exchange = exchange
        self.padded = self.PADDED[exchange]

    # -- dispatch -------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align=1, capacity=None):
        """The four steps of a Megatron / torchtitan-style dispatch, one helper each: count
        exchange, permute, all-to-all with a chunk sort into expert-major, and the source's
        plan of the two-level combine sum."""
        group = self.group
        R, me, E = dist.get_world_size(group), dist.get_rank(group), int(num_experts)
        if E < 1 or E % R or align < 1 or (capacity is not None and capacity < 0):
            raise ValueError("plain_torch: bad num_experts / align / capacity")
        T, K = topk_idx.shape
        flat = topk_idx.reshape(-1).to(torch.int64)
        c = _count_exchange(flat, group, R, me, E, align, capacity, self.padded)
        send_t, send_k, send_d, meta = _permute(flat, topk_weights, c, K, E // R)
        dest, src_rank = _chunk_sort(c, R, x.device)
        k_order, k_steps, pair_t, m_steps = _sum_plan(send_t, send_k, send_d, R, K)
        plan = _Plan(group=group, R=R, T=T, H=x.shape[1], M=c.M, send_splits=c.send_splits,
                     recv_splits=c.recv_splits, send_t=send_t, send_k=send_k, dest=dest,
                     k_order=k_order, k_steps=k_steps, pair_t=pair_t, m_steps=m_steps,
                     chunk=c.chunk)
        expert_x, recv_meta = _DispatchFn.apply(x, meta, plan)
        recv_meta = recv_meta.view(torch.int32)
        dev = x.device
        row_src = torch.full((c.M, 3), -1, dtype=torch.int64, device=dev)
        row_src[dest] = torch.stack([src_rank, recv_meta[:, 0].long(), recv_meta[:, 1].long()],
                                    dim=1)
        row_weight = torch.zeros(c.M, dtype=torch.float32, device=dev)
        row_weight[dest] = recv_meta[:, 2].contiguous().view(torch.float32)
        i64 = dict(dtype=torch.int64, device=dev)
        return PlainDispatch(
            expert_x=expert_x,
            tokens_per_expert=torch.as_tensor(c.tpe, **i64),
            expert_offsets=torch.as_tensor(c.offsets, **i64),
            row_src=row_src,
            row_weight=row_weight,
            dropped_per_expert=torch.as_tensor(c.dropped, **i64),
            plan=plan,
            topk_weights=topk_weights,
            x_dtype=x.dtype,
        )

    # -- combine --------------------------------------------------------------------------
    def combine(self, expert_y, dispatched: PlainDispatch, *, weighted=True):
        plan = dispatched.plan
        if tuple(expert_y.shape) != (plan.M, plan.H):
            raise ValueError(f"expert_y has shape {tuple(expert_y.shape)}, the dispatch "
                             f"produced [{plan.M}, {plan.H}]")
        return _CombineFn.apply(expert_y, dispatched.topk_weights, plan, weighted,
                                dispatched.x_dtype)
