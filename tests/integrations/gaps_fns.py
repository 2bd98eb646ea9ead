"""Rank functions for test_epkit_gaps.py: what framework glue needs from epkit itself."""

from __future__ import annotations

import torch

import epkit


def routing(rank, T, E, K, seed):
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, 8, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def padded_lengths(group, rank, T, E, K, align):
    x, idx, w = routing(rank, T, E, K, 1)
    d = epkit.dispatch(x, idx, w, num_experts=E, group=group, align=align)
    return d.tokens_per_expert, d.padded_tokens_per_expert, d.expert_offsets, d.num_rows


def narrow_weights(group, rank, dtype_name):
    """The same routing as float32 weights and as bfloat16 / float16 ones (their values exactly):
    dispatch, weighted combine and both gradients."""
    x, idx, w = routing(rank, 6, 4, 2, 2)
    narrow = w.to(getattr(torch, dtype_name))
    out = {}
    for name, weights in (("wide", narrow.float()), ("narrow", narrow.clone())):
        xx = x.clone().requires_grad_(True)
        ww = weights.clone().requires_grad_(True)
        d = epkit.dispatch(xx, idx, ww, num_experts=4, group=group)
        y = d.expert_x * 1.5
        res = epkit.combine(y, d)
        res.backward(torch.ones_like(res))
        out[name] = (d.expert_x.detach(), d.row_weight.detach(), res.detach(), xx.grad, ww.grad)
    return out


def one_rank_group(group, rank):
    """epkit.group_of_one: a group of this rank alone, every expert local, the same group on a
    second call; a dispatch over it keeps every token here."""
    one = epkit.group_of_one()
    assert one is epkit.group_of_one()
    x, idx, w = routing(rank, 5, 4, 2, 3)
    d = epkit.dispatch(x, idx, w, num_experts=4, group=one)
    return one.size(), d.row_src[:, 0].unique().tolist(), d.tokens_per_expert


def drop_and_pad(group, rank, routing_map, probs, E):
    idx, w = epkit.topk_from_routing_map(routing_map, probs, topk=E)
    d = epkit.dispatch(torch.randn(routing_map.shape[0], 8), idx, w, num_experts=E, group=group)
    return d.tokens_per_expert, d.row_weight, d.row_src
