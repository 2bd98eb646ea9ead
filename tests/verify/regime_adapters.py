"""Dispatchers with a bug that lives in one regime the harness must reach (issue 34), and the
valid variants that must keep passing. Each wraps the validating plain-torch baseline of
escape_adapters.py and changes one thing the way a real dispatcher does. Workers load this file
by path (``--impl path.py:factory``).
"""

from __future__ import annotations

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


writes_topk_idx = WritesTopkIdx
zeroes_padding_of_expert_y = ZeroesPaddingOfExpertY
combine_backward_writes_grad = CombineBackwardWritesGrad

# factory -> (the property that must fail, a text its report must hold)
BUGS = {
    "writes_topk_idx": ("dispatch", "dispatch wrote into topk_idx"),
    "zeroes_padding_of_expert_y": ("combine", "combine wrote into expert_y"),
    "combine_backward_writes_grad": ("combine_backward", "combine's backward wrote into "
                                                         "grad_out"),
}
