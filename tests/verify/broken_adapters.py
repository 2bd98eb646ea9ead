"""Deliberately broken dispatchers: the harness must catch every one of them.

Each factory wraps the plain-torch baseline (which passes) and breaks one thing the way a real
implementation gets it wrong. Workers load this file by path (``--impl path.py:factory``).
"""

from __future__ import annotations

import dataclasses

import torch

from epkit.baselines.plain_torch import PlainTorchDispatcher


def _segments(d):
    """(start, rows) of every local expert's unpadded segment."""
    off = d.expert_offsets.tolist()
    return [(off[j], n) for j, n in enumerate(d.tokens_per_expert.tolist())]


class RowsOutOfOrder(PlainTorchDispatcher):
    """The first expert with two or more rows gets its first two rows swapped (a receive-side
    chunk sort that orders by token before source, say)."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        for start, n in _segments(d):
            if n >= 2:
                perm = torch.arange(d.expert_x.shape[0])
                perm[start], perm[start + 1] = start + 1, start
                return dataclasses.replace(d, expert_x=d.expert_x[perm],
                                           row_src=d.row_src[perm], row_weight=d.row_weight[perm])
        return d


class PaddingNotZero(PlainTorchDispatcher):
    """Padding rows are left uninitialized (here: they hold 1.0)."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        ex = d.expert_x.clone()
        off = d.expert_offsets.tolist()
        for j, (start, n) in enumerate(_segments(d)):
            if n and off[j + 1] > start + n:
                ex[start + n:off[j + 1]] = 1.0
        return dataclasses.replace(d, expert_x=ex)


class SlotsReversed(PlainTorchDispatcher):
    """Combine sums a token's slots on one rank in descending k."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        steps = dispatched.plan.k_steps
        # the first step writes instead of adding: keep it first, reverse the rest
        plan = dataclasses.replace(dispatched.plan, k_steps=steps[:1] + steps[1:][::-1])
        return super().combine(expert_y, dataclasses.replace(dispatched, plan=plan),
                               weighted=weighted)


class FlatIndexAdd(PlainTorchDispatcher):
    """Megatron's unpermute: one flat ``index_add`` over the slots in expert order (no
    per-rank partial sums, slots in expert order rather than k order). Gradients are the
    baseline's (only the forward sum is wrong)."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        right = super().combine(expert_y, dispatched, weighted=weighted)
        plan = dispatched.plan
        rows = plan.to_sources(expert_y.detach()[plan.dest]).to(torch.float32)
        if weighted:
            rows = rows * dispatched.topk_weights.detach()[plan.send_t, plan.send_k][:, None]
        flat = torch.zeros((plan.T, plan.H), dtype=torch.float32)
        flat = flat.index_add(0, plan.send_t, rows).to(right.dtype)
        return right + (flat - right).detach()


class WeightTwice(PlainTorchDispatcher):
    """The expert side scales its output by the routing weight, and the source does too."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        if weighted:
            expert_y = (expert_y.float() * dispatched.row_weight[:, None]).to(expert_y.dtype)
        return super().combine(expert_y, dispatched, weighted=weighted)


class DroppedSlotLeaks(PlainTorchDispatcher):
    """A slot dropped by capacity passes its token through (``c_k * x[t]``) instead of
    contributing nothing."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        d.leak = (x.detach(), topk_idx.long())
        return d

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = super().combine(expert_y, dispatched, weighted=weighted)
        x, idx = dispatched.leak
        plan = dispatched.plan
        kept = torch.zeros(idx.shape, dtype=torch.bool)
        kept[plan.send_t, plan.send_k] = True
        dropped = (idx >= 0) & ~kept
        if not dropped.any():
            return out
        w = dispatched.topk_weights.detach() if weighted else torch.ones(idx.shape)
        extra = (w * dropped).sum(dim=1, keepdim=True) * x.float()
        return (out.float() + extra).to(out.dtype)


class WrongWeightGrad(PlainTorchDispatcher):
    """The routing weights' gradient comes out twice as large (forward unchanged)."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        w = dispatched.topk_weights
        w2 = w.detach() + 2.0 * (w - w.detach())
        return super().combine(expert_y, dataclasses.replace(dispatched, topk_weights=w2),
                               weighted=weighted)


class DenseCombine(PlainTorchDispatcher):
    """Combine as a dense matmul over all rows of expert_y: padding rows get weight 0, and
    ``0 * NaN`` leaks into the output."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = super().combine(expert_y, dispatched, weighted=weighted)
        pad = dispatched.row_src[:, 0] < 0
        leak = (expert_y.float()[pad] * 0.0).sum(dim=0)
        return (out.float() + leak).to(out.dtype) if out.shape[0] else out


# factories: factory(group) -> adapter (a class is one)
rows_out_of_order = RowsOutOfOrder
padding_not_zero = PaddingNotZero
slots_reversed = SlotsReversed
flat_index_add = FlatIndexAdd
weight_twice = WeightTwice
dropped_slot_leaks = DroppedSlotLeaks
wrong_weight_grad = WrongWeightGrad
dense_combine = DenseCombine



class GarbageOutputs(PlainTorchDispatcher):
    """Outputs of the wrong kind: int32 row_src with two columns, float counts, a combine that
    returns a list. The harness must report these, not crash on them."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        return dataclasses.replace(d, row_src=d.row_src[:, :2].int(),
                                   tokens_per_expert=d.tokens_per_expert.float(),
                                   expert_offsets=d.expert_offsets[:-1])

    def combine(self, expert_y, dispatched, *, weighted=True):
        return [1, 2, 3]


class NoFields:
    def __init__(self, group):
        pass

    def dispatch(self, x, *a, **kw):
        return object()

    def combine(self, *a, **kw):
        return None


garbage_outputs = GarbageOutputs
no_fields = NoFields


# factory name -> the property that must fail
EXPECTED = {
    "rows_out_of_order": "dispatch",
    "padding_not_zero": "dispatch",
    "slots_reversed": "combine",
    "flat_index_add": "combine",
    "weight_twice": "combine",
    "dropped_slot_leaks": "combine",
    "wrong_weight_grad": "weight_grad",
    "dense_combine": "combine",
    "garbage_outputs": "dispatch",
    "no_fields": "dispatch",
}
