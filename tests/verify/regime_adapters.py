"""Dispatchers with a bug that lives in one regime the harness must reach (issue 34), and the
valid variants that must keep passing. Each wraps the validating plain-torch baseline of
escape_adapters.py and changes one thing the way a real dispatcher does. Workers load this file
by path (``--impl path.py:factory``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from epkit.verify.adapters import load_factory

# by path: workers have no tests/verify on sys.path
_ESCAPES = str(Path(__file__).resolve().with_name("escape_adapters.py"))
Validating = load_factory(_ESCAPES + ":Validating")


# -- untouched inputs -----------------------------------------------------------------------------
class WritesTopkIdx(Validating):
    """Writes a sentinel (``num_experts``) into the caller's ``topk_idx`` for its unused
    slots, in place, and routes from that (treating the sentinel as unused): every result is
    right, the caller's routing is not."""

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, num_experts=num_experts, **kw)
        topk_idx.masked_fill_(topk_idx < 0, num_experts)
        return d


class ZeroesPaddingOfExpertY(Validating):
    """Clears the padding rows of the caller's ``expert_y`` in place before summing (their
    values are ignored anyway, so every result is right)."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        with torch.no_grad():
            expert_y[dispatched.row_src[:, 0] < 0] = 0
        return super().combine(expert_y, dispatched, weighted=weighted)


class _ScalesGradInPlace(torch.autograd.Function):
    """Identity forward; the backward halves its incoming gradient in place and doubles it
    back out of place (a fused kernel reusing its input buffer as scratch)."""

    @staticmethod
    def forward(ctx, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        grad.mul_(0.5)
        return grad * 2


class CombineBackwardWritesGrad(Validating):
    """Combine's backward uses the gradient it is handed as scratch (scales it in place)."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        return _ScalesGradInPlace.apply(super().combine(expert_y, dispatched, weighted=weighted))


# -- corners -----------------------------------------------------------------------------------
_OtherSum = load_factory(_ESCAPES + ":_OtherSum")


class Float16SumsInFloat16(_OtherSum):
    """Sums a float16 token's slots in float16 (float32 and bfloat16 in float32)."""

    def sum_rows(self, rows, c, plan):
        acc = torch.float16 if rows.dtype == torch.float16 else torch.float32
        rows = rows.to(acc) * (c.to(acc)[:, None] if c is not None else 1.0)
        return torch.zeros((plan.T, plan.H), dtype=acc).index_add(0, plan.send_t, rows)


class StagesRowsThrough4KiB(Validating):
    """Moves each row through a 4 KiB staging buffer: bytes past 4096 of a row are lost
    (zeros arrive)."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        keep = 4096 // d.expert_x.element_size()
        if d.expert_x.shape[1] > keep:
            ex = d.expert_x.clone()
            with torch.no_grad():
                ex[:, keep:] = 0
            d = dataclasses.replace(d, expert_x=d.expert_x + (ex - d.expert_x).detach())
        return d


class Counts16Bit(Validating):
    """Keeps tokens_per_expert (and the offsets built from it) in 16 bits."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        tpe = d.tokens_per_expert % 65536
        off = torch.cat([d.expert_offsets[:1], (d.expert_offsets[1:] % 65536)])
        return dataclasses.replace(d, tokens_per_expert=tpe, expert_offsets=off)


class DropsLastFullBlock(Validating):
    """A 64-token block loop in combine that stops one block short when the token count is
    a multiple of 64: those tokens' outputs stay zero."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = super().combine(expert_y, dispatched, weighted=weighted)
        T = out.shape[0]
        if T and T % 64 == 0:
            out = torch.cat([out[:T - 64], out[T - 64:] * 0])
        return out


class Ids8Bit(Validating):
    """Packs expert ids in 8 bits (uint8 routing): an id past 255 wraps around."""

    def route(self, x, topk_idx, topk_weights):
        return torch.where(topk_idx >= 0, topk_idx % 256, topk_idx)


# -- order and sequences --------------------------------------------------------------------------
class CachesPlanByShape(Validating):
    """Caches its routing plan by shape: a later call with the same shapes reuses the first
    one's routing (a plan cache keyed by (T, K, H) and not by the routing)."""

    def route(self, x, topk_idx, topk_weights):
        cache = self.__dict__.setdefault("plans", {})
        key = (tuple(topk_idx.shape), x.shape[1], topk_idx.dtype)
        return cache.setdefault(key, topk_idx.clone())


class PlanOnTheLayer(Validating):
    """Keeps its plan on the layer object, not on the returned handle (the torchtitan
    ParallelStyle pattern): combine uses the latest dispatch's plan."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        self.last = super().dispatch(x, topk_idx, topk_weights, **kw)
        return self.last

    def combine(self, expert_y, dispatched, *, weighted=True):
        return super().combine(expert_y, self.last, weighted=weighted)


class _OnBackward(torch.autograd.Function):
    """Identity forward; the backward passes its gradient through ``hook`` (run then)."""

    @staticmethod
    def forward(ctx, t, hook):
        ctx.hook = hook
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.hook(grad), None


def _with_state(d, box, hook):
    """``d`` with ``box`` (state shared by its calls) on it and ``hook`` in expert_x's
    backward."""
    d = dataclasses.replace(d, expert_x=_OnBackward.apply(d.expert_x, hook))
    d.box = box
    return d


class CombineReusesDispatchState(Validating):
    """Dispatch's backward reads a buffer that combine reuses (a receive buffer, a count list
    held by reference in the autograd context): right only if dispatch's backward runs before
    combine, which training never does."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        box = {"scale": 1.0}
        return _with_state(super().dispatch(x, topk_idx, topk_weights, **kw), box,
                           lambda grad: grad * box["scale"])

    def combine(self, expert_y, dispatched, *, weighted=True):
        dispatched.box["scale"] = 0.5  # the buffer, reused
        return super().combine(expert_y, dispatched, weighted=weighted)


class BackwardFreesThePlan(Validating):
    """Dispatch's backward frees state combine still reads (here: combine then returns
    zeros): wrong only when dispatch's backward runs before combine (order ``stages``)."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        box = {"freed": False}

        def free(grad):
            box["freed"] = True
            return grad

        return _with_state(super().dispatch(x, topk_idx, topk_weights, **kw), box, free)

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = super().combine(expert_y, dispatched, weighted=weighted)
        return out * 0 if dispatched.box["freed"] else out


caches_plan_by_shape = CachesPlanByShape
plan_on_the_layer = PlanOnTheLayer
combine_reuses_dispatch_state = CombineReusesDispatchState
backward_frees_the_plan = BackwardFreesThePlan

float16_sums_in_float16 = Float16SumsInFloat16
stages_rows_through_4kib = StagesRowsThrough4KiB
counts_16bit = Counts16Bit
drops_last_full_block = DropsLastFullBlock
ids_8bit = Ids8Bit

writes_topk_idx = WritesTopkIdx
zeroes_padding_of_expert_y = ZeroesPaddingOfExpertY
combine_backward_writes_grad = CombineBackwardWritesGrad

# factory -> (the property that must fail, a text its report must hold, or texts: one of them)
BUGS = {
    "caches_plan_by_shape": ("dispatch", ("second batch (the twin)", "needs earlier cases")),
    "plan_on_the_layer": ("combine", "sequence overlap"),
    "combine_reuses_dispatch_state": ("dispatch_backward", "order training"),
    "backward_frees_the_plan": ("combine", "order stages"),
    "float16_sums_in_float16": ("combine", "float16"),
    "stages_rows_through_4kib": ("dispatch", "expert_x"),
    "counts_16bit": ("dispatch", "tokens_per_expert"),
    "drops_last_full_block": ("combine", "combine"),
    "ids_8bit": ("dispatch", "dispatch"),
    "writes_topk_idx": ("dispatch", "dispatch wrote into topk_idx"),
    "zeroes_padding_of_expert_y": ("combine", "combine wrote into expert_y"),
    "combine_backward_writes_grad": ("combine_backward", "wrote into grad_out"),
}
