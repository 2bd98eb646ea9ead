"""A torchtitan-style dispatcher behind an adapter (written apart from the docs' one): every
expert's rows padded to a multiple of ``align`` and to at least ``align`` (empty experts too), a
fixed-size buffer whose trailing rows are padding, and a combine that weights and
``scatter_add`` s in x's dtype (so it accumulates in bfloat16 for bfloat16 tokens)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn

from epkit.verify.adapt import FullTopK, exchange_row_src

warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)


def a2a(t, outs, ins, group):
    out = t.new_empty((sum(outs), *t.shape[1:]))
    return dnn.all_to_all_single(out, t.contiguous(), outs, ins, group=group)


class Titan:
    def __init__(self, group):
        self.group = group

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        if capacity is not None:
            raise NotImplementedError("no capacity")
        if (topk_idx < 0).any():
            raise NotImplementedError("no -1")
        R, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        L = num_experts // R
        T, K = topk_idx.shape
        flat = topk_idx.reshape(-1).long()
        sorted_idx = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        g = [torch.empty_like(counts) for _ in range(R)]
        dist.all_gather(g, counts, group=self.group)
        recv = torch.stack(g)[:, me * L:(me + 1) * L]
        ins, outs = counts.view(R, L).sum(1).tolist(), recv.sum(1).tolist()
        rows = a2a(x[sorted_idx // K], outs, ins, self.group)
        N = rows.shape[0]
        tpe = recv.sum(0)
        m_sizes = ((tpe + align - 1) // align * align).clamp_min(align)
        maxlen = N + L * align + align
        pad_index = N
        perm = torch.full((maxlen,), pad_index, dtype=torch.long)
        # received order: (src, expert) chunks; expert-major with src order inside
        starts = torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)
        pos = 0
        for j in range(L):
            take = []
            for s in range(R):
                c = s * L + j
                take.append(torch.arange(int(starts[c]), int(starts[c]) + int(recv[s, j])))
            take = torch.cat(take)
            perm[pos:pos + len(take)] = take
            pos += int(m_sizes[j])
        padded = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
        expert_x = padded[perm]
        order = torch.where(perm == pad_index, -1, perm)
        row_src, row_weight = exchange_row_src(sorted_idx, K, topk_weights, ins, outs,
                                               self.group, order=order)
        off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(m_sizes, 0)])
        h = SimpleNamespace(perm=perm, pad=pad_index, N=N, ins=ins, outs=outs,
                            sorted_idx=sorted_idx, T=T, K=K, w=topk_weights, dtype=x.dtype)
        return SimpleNamespace(expert_x=expert_x, tokens_per_expert=tpe, expert_offsets=off,
                               row_src=row_src, row_weight=row_weight, h=h)

    def combine(self, expert_y, d, *, weighted):
        h = d.h
        real = h.perm != h.pad
        back = expert_y.new_zeros((h.N, expert_y.shape[1]))
        back = back.index_copy(0, h.perm[real], expert_y[real])
        y = a2a(back, h.ins, h.outs, self.group).to(h.dtype)
        if weighted:
            y = (y.float() * h.w.reshape(-1)[h.sorted_idx][:, None]).to(h.dtype)
        out = torch.zeros((h.T, y.shape[1]), dtype=h.dtype)
        return out.scatter_add(0, (h.sorted_idx // h.K)[:, None].expand_as(y), y)


def make(group):
    return FullTopK(Titan(group), group)


make.capabilities = {"capacity": False, "accumulate": "native"}  # sums in the token dtype
