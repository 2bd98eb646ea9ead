"""A permute + all-to-all + ``index_add`` dispatcher, written in the style of Megatron-Core's
all-to-all token dispatcher and torchtitan's, for the adapter walk-through of docs/verify.md.

It knows nothing of epkit: every token is routed to exactly ``K`` experts (no ``-1`` slots),
no capacity, no padding; the permutation is an unstable ``argsort`` (rows inside an expert come
in any order), and combine sums with one flat ``index_add`` in float32 (not epkit's order). So
it meets the ``bounded`` contract and not ``exact``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["A2ADispatcher", "Handle"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes whose backward is the same exchange reversed: how
    Megatron-Core's token dispatcher differentiates it (its ``_AllToAll`` in
    tensor_parallel/mappings.py)."""

    @staticmethod
    def forward(ctx, group, t, out_splits, in_splits):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return None, _AllToAll.apply(ctx.group, grad, in_splits, out_splits), None, None


@dataclass
class Handle:
    perm: torch.Tensor  # [N] flat slot ids t * K + k, in send order
    input_splits: list
    output_splits: list
    sort_idx: torch.Tensor  # [N'] received row of each expert-major row
    tokens: int
    topk_weights: torch.Tensor
    x_dtype: torch.dtype


class A2ADispatcher:
    def __init__(self, group, num_experts: int):
        self.group, self.E = group, num_experts
        self.R = dist.get_world_size(group)
        self.L = num_experts // self.R

    def _a2a(self, t, out_splits, in_splits):
        return _AllToAll.apply(self.group, t, out_splits, in_splits)

    def dispatch(self, x, topk_idx, topk_weights):
        if (topk_idx < 0).any():
            raise NotImplementedError("every token needs K experts (no -1 slots)")
        T, K = topk_idx.shape
        flat = topk_idx.reshape(-1).long()
        perm = torch.argsort(flat)  # unstable: any order inside an expert
        counts = torch.bincount(flat, minlength=self.E)
        gathered = [torch.empty_like(counts) for _ in range(self.R)]
        dist.all_gather(gathered, counts, group=self.group)
        me = dist.get_rank(self.group)
        recv = torch.stack(gathered)[:, me * self.L:(me + 1) * self.L]  # [R source, L]
        in_splits = counts.view(self.R, self.L).sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        # gathered from a float32 copy, so that the backward's index_add sums in float32
        rows = self._a2a(x.float()[perm // K].to(x.dtype), out_splits, in_splits)
        # received (source, expert) chunks -> expert-major
        expert = torch.repeat_interleave(torch.arange(self.L).repeat(self.R), recv.reshape(-1))
        sort_idx = torch.argsort(expert, stable=True)
        handle = Handle(perm, in_splits, out_splits, sort_idx, T, topk_weights, x.dtype)
        return rows[sort_idx], recv.sum(0), handle

    def combine(self, expert_y, h: Handle, weighted=True):
        back = torch.empty_like(expert_y)
        back = back.index_copy(0, h.sort_idx, expert_y)  # expert-major -> receive order
        y = self._a2a(back, h.input_splits, h.output_splits).float()
        K = h.topk_weights.shape[1]
        if weighted:
            y = y * h.topk_weights.reshape(-1)[h.perm][:, None]
        out = torch.zeros((h.tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        return out.index_add(0, h.perm // K, y).to(h.x_dtype)
