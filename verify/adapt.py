"""Helpers for writing an adapter around a dispatcher epkit did not write (docs/verify.md).

- :func:`row_src_from_slots`: ``row_src`` / ``row_weight`` from each row's source rank and
  source slot id (``t * K + k``), when the receiver knows them;
- :func:`exchange_row_src`: the same for a permutation-based dispatcher (Megatron, torchtitan):
  the permutation's slot ids and weights travel through one all-to-all with the dispatcher's own
  split sizes, and the receive-side reordering is applied;
- :class:`FullTopK`: a shim for dispatchers that always route ``K`` experts per token (no
  ``-1`` slots): unused slots are routed to an expert the token does not use, and the rows that
  come of it are turned into padding rows (zeros, ``row_src`` -1) in dispatch and ignored in
  combine. The result is not the canonical layout: check it under ``--contract reordered`` or
  ``bounded``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

__all__ = ["FullTopK", "exchange_row_src", "offsets_of", "row_src_from_slots"]


def row_src_from_slots(src_rank, slot_ids, topk: int, weights=None):
    """``(row_src [M, 3] int64, row_weight [M] float32)`` from per-row source ranks and source
    slot ids ``t * K + k`` (``-1`` = a padding row). ``weights``: the rows' routing weights (as
    received), else zeros."""
    slot = torch.as_tensor(slot_ids).long().reshape(-1)
    src = torch.as_tensor(src_rank).long().reshape(-1).expand_as(slot)
    pad = slot < 0
    row_src = torch.stack([src, torch.div(slot, topk, rounding_mode="floor"), slot % topk], 1)
    row_src = torch.where(pad[:, None], torch.full_like(row_src, -1), row_src)
    if weights is None:
        row_weight = torch.zeros(slot.shape, dtype=torch.float32)
    else:
        w = torch.as_tensor(weights).detach().float().reshape(-1)
        row_weight = torch.where(pad, torch.zeros_like(w), w)
    return row_src.cpu(), row_weight.cpu()


def exchange_row_src(perm, topk: int, topk_weights, input_splits, output_splits, group=None,
                     order=None):
    """``row_src`` / ``row_weight`` of a permutation-based dispatcher's expert rows.

    ``perm`` [N]: the flat slot id (``t * K + k``) of every row this rank sends, in send order
    (e.g. ``argsort`` of the flattened routing); ``input_splits`` / ``output_splits``: the split
    sizes of the dispatcher's token all-to-all; ``order`` [M]: the receive-side reordering (row
    ``m`` of the layout is received row ``order[m]``; ``-1`` = a padding row), or None when the
    rows stay in receive order. Runs one all-to-all of the slot ids and weights."""
    perm = torch.as_tensor(perm).long().reshape(-1).cpu()
    w = topk_weights.detach().float().reshape(-1).cpu()[perm]
    send = torch.stack([perm, w.view(torch.int32).long()], 1)
    ins, outs = [int(n) for n in input_splits], [int(n) for n in output_splits]
    recv = torch.empty((sum(outs), 2), dtype=torch.int64)
    dist.all_to_all_single(recv, send, outs, ins, group=group)
    src = torch.repeat_interleave(torch.arange(len(outs)), torch.tensor(outs, dtype=torch.long))
    slot = recv[:, 0]
    weight = recv[:, 1].int().view(torch.float32)
    if order is not None:
        order = torch.as_tensor(order).long().reshape(-1).cpu()
        pad = order < 0
        take = torch.where(pad, len(slot), order)  # a padding row reads an appended dummy
        src = torch.cat([src, src.new_full((1,), -1)])[take]
        slot = torch.where(pad, -1, torch.cat([slot, slot.new_full((1,), -1)])[take])
        weight = torch.cat([weight, weight.new_zeros(1)])[take]
    return row_src_from_slots(src, slot, topk, weight)


def offsets_of(tokens_per_expert, align: int = 1):
    """``expert_offsets`` [L+1] int64 of segments holding ``tokens_per_expert`` rows each,
    padded to a multiple of ``align``."""
    n = torch.as_tensor(tokens_per_expert).long().cpu()
    padded = torch.div(n + align - 1, align, rounding_mode="floor") * align
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])


class FullTopK:
    """Wrap an adapter (or an adapter factory's product) whose dispatcher needs ``K`` used
    experts per token. Every ``-1`` slot is routed to the lowest expert the token does not use
    (its weight is kept, its row contributes zeros); the rows of such slots become padding rows
    (zeros, ``row_src`` -1, ``row_weight`` 0, not counted in ``tokens_per_expert``), and combine
    feeds them zeros. One ``all_gather_object`` per dispatch tells every rank which slots were
    filled. ``capacity`` with ``-1`` slots is refused (filled slots would take capacity)."""

    def __init__(self, inner, group=None):
        self.inner = inner
        self.group = group if group is not None else getattr(inner, "group", None)

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        unused = topk_idx < 0
        masks = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(masks, unused.cpu(), group=self.group)
        if not any(bool(m.any()) for m in masks):
            return self.inner.dispatch(x, topk_idx, topk_weights, num_experts=num_experts,
                                       align=align, capacity=capacity)
        if capacity is not None:
            raise NotImplementedError("FullTopK: -1 slots together with capacity")
        if topk_idx.shape[1] > num_experts:
            raise NotImplementedError("FullTopK: -1 slots with top-k > num_experts")
        filled = topk_idx.clone().long()
        for t in torch.nonzero(unused.any(1)).reshape(-1).tolist():
            free = [e for e in range(num_experts) if e not in set(filled[t].tolist())]
            for k in torch.nonzero(unused[t]).reshape(-1).tolist():
                filled[t, k] = free.pop(0)
        # a filled slot's weight gets no gradient (the spec's 0 for an unused slot), not
        # 0 * <g, 0>, which is NaN where grad_out holds an infinity
        weights = torch.where(unused, topk_weights.detach(), topk_weights)
        d = self.inner.dispatch(x, filled.to(topk_idx.dtype), weights,
                                num_experts=num_experts, align=align, capacity=capacity)
        d = d.wait() if hasattr(d, "wait") and not hasattr(d, "expert_x") else d
        src = d.row_src.cpu().long()
        real = src[:, 0] >= 0
        fake = torch.zeros(len(src), dtype=torch.bool)
        for m in torch.nonzero(real).reshape(-1).tolist():
            s, t, k = src[m].tolist()
            fake[m] = bool(masks[s][t, k])
        off = d.expert_offsets.cpu().long()
        expert_of = torch.repeat_interleave(torch.arange(len(off) - 1), off[1:] - off[:-1])
        tpe = d.tokens_per_expert.cpu().long().clone()
        tpe -= torch.bincount(expert_of[fake[: len(expert_of)]], minlength=len(tpe))
        dev = d.expert_x.device
        keep = (~fake).to(dev)[:, None]
        return SimpleNamespace(
            expert_x=torch.where(keep, d.expert_x, torch.zeros_like(d.expert_x)),
            tokens_per_expert=tpe, expert_offsets=off,
            row_src=torch.where(fake[:, None], torch.full_like(src, -1), src),
            row_weight=torch.where(fake, torch.zeros(()), d.row_weight.cpu().float()),
            inner=d, keep=keep)

    def combine(self, expert_y, dispatched, *, weighted):
        inner = getattr(dispatched, "inner", None)
        if inner is None:
            return self.inner.combine(expert_y, dispatched, weighted=weighted)
        y = torch.where(dispatched.keep, expert_y, torch.zeros_like(expert_y))
        return self.inner.combine(y, inner, weighted=weighted)
