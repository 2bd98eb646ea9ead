"""Dispatchers for the gate tests: refusals, and broken variants of the docs' permute +
all-to-all + index_add dispatcher (epkit.baselines.megatron_style) that must fail ``bounded``.
Workers load this file by path (``--impl path.py:factory``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from epkit.verify import example_adapter
from epkit.verify.adapt import FullTopK
from epkit.baselines.megatron_style import A2ADispatcher
from epkit.baselines.plain_torch import PlainTorchDispatcher


# -- refusals ----------------------------------------------------------------------------------
class RefusesCapacity(PlainTorchDispatcher):
    """A correct dispatcher that refuses capacity (as most do)."""

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        if capacity is not None:
            raise NotImplementedError("capacity is not supported")
        return super().dispatch(x, topk_idx, topk_weights, num_experts=num_experts,
                                align=align, capacity=capacity)


class FalseGreen(RefusesCapacity):
    """Refuses capacity, and halves every combine output: it must never pass."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        return super().combine(expert_y, dispatched, weighted=weighted) * 0.5


refuses_capacity = RefusesCapacity
false_green = FalseGreen


# -- the docs' dispatcher, broken ----------------------------------------------------------------
def _variant(dispatcher_cls, adapter_hook=None):
    """A factory like example_adapter.make, with another dispatcher class (and a hook that may
    damage the dispatch result)."""

    class Adapter(example_adapter.Adapter):
        def dispatch(self, x, topk_idx, topk_weights, **kw):
            saved = example_adapter.A2ADispatcher
            example_adapter.A2ADispatcher = dispatcher_cls
            try:
                d = super().dispatch(x, topk_idx, topk_weights, **kw)
            finally:
                example_adapter.A2ADispatcher = saved
            return adapter_hook(d) if adapter_hook else d

    def make(group):
        return FullTopK(Adapter(group), group)

    make.capabilities = example_adapter.make.capabilities
    return make


class OneTokenOff(A2ADispatcher):
    """Token 0's sum comes out larger by a relative 2**-9."""

    def combine(self, expert_y, h, weighted=True):
        out = super().combine(expert_y, h, weighted).float()
        if out.shape[0]:
            out = torch.cat([out[:1] * (1 + 2.0**-9), out[1:]])
        return out.to(h.x_dtype)


class MissingWeight(A2ADispatcher):
    """The weight of slot k = 0 is not applied."""

    def combine(self, expert_y, h, weighted=True):
        if not weighted:
            return super().combine(expert_y, h, weighted)
        w = h.topk_weights
        w2 = torch.cat([torch.ones_like(w[:, :1]), w[:, 1:]], 1)
        return super().combine(expert_y, _with(h, topk_weights=w2), weighted)


class DroppedChunk(A2ADispatcher):
    """Combine loses the chunk of rows received from the first source rank that sent any."""

    def combine(self, expert_y, h, weighted=True):
        n = next((c for c in h.output_splits if c), 0)  # that chunk: received rows [0, n)
        lost = (h.sort_idx < n)[:, None]
        return super().combine(torch.where(lost, torch.zeros_like(expert_y), expert_y), h,
                               weighted)


class WrongExpertMap(A2ADispatcher):
    """Experts are placed on ranks round-robin (expert e on rank e % R) instead of in blocks."""

    def dispatch(self, x, topk_idx, topk_weights):
        mapped = (topk_idx % self.R) * self.L + topk_idx // self.R
        return super().dispatch(x, torch.where(topk_idx < 0, topk_idx, mapped), topk_weights)


class UnscaledGradient(A2ADispatcher):
    """The gradient of expert_y is not scaled by the routing weight (forward right)."""

    def combine(self, expert_y, h, weighted=True):
        if not weighted:
            return super().combine(expert_y, h, weighted)
        K = h.topk_weights.shape[1]
        back = torch.empty_like(expert_y).index_copy(0, h.sort_idx, expert_y)
        y = self._a2a(back, h.input_splits, h.output_splits).float()
        w = h.topk_weights.reshape(-1)[h.perm][:, None]
        y = y.detach() * w + (y - y.detach())
        out = torch.zeros((h.tokens, y.shape[1]), dtype=torch.float32)
        return out.index_add(0, h.perm // K, y).to(h.x_dtype)


def _with(h, **kw):
    import dataclasses

    return dataclasses.replace(h, **kw)


def _mislabel(d):
    """Two rows of one expert with different tokens swap their row_src."""
    src = d.row_src.clone()
    off = d.expert_offsets.tolist()
    for j in range(len(off) - 1):
        seg = list(range(off[j], off[j + 1]))
        for a in seg:
            for b in seg:
                if a < b and src[a, 0] >= 0 and src[b, 0] >= 0 and \
                        src[a, :2].tolist() != src[b, :2].tolist():
                    src[[a, b]] = src[[b, a]]
                    d.row_src = src
                    return d
    return d


docs_dispatcher = example_adapter.make
mislabelled_row_src = _variant(A2ADispatcher, _mislabel)
one_token_off = _variant(OneTokenOff)
missing_weight = _variant(MissingWeight)
dropped_chunk = _variant(DroppedChunk)
wrong_expert_map = _variant(WrongExpertMap)
unscaled_gradient = _variant(UnscaledGradient)

# factory name -> a property that must fail under bounded
BROKEN_BOUNDED = {
    "mislabelled_row_src": "dispatch",
    "one_token_off": "combine",
    "missing_weight": "combine",
    "dropped_chunk": "combine",
    "wrong_expert_map": "dispatch",
    "unscaled_gradient": "combine_backward",
}


# -- a rank-major dispatcher (DeepEP's normal-mode layout) -----------------------------------------
class RankMajor:
    """One row per token and destination rank, with the token's local expert ids there
    (``recv_x``, ``recv_topk_idx``, ``recv_topk_weights``, ``recv_src``); combine sums each
    token's rows over ranks ascending. No capacity."""

    def __init__(self, group, *, reverse_rows=False):
        self.group = group
        self.reverse_rows = reverse_rows

    def _a2a(self, t, out_splits, in_splits):
        import torch.distributed.nn.functional as dnn

        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        return dnn.all_to_all_single(out, t.contiguous(), out_splits, in_splits,
                                     group=self.group)

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        import torch.distributed as dist

        if capacity is not None:
            raise NotImplementedError("capacity is not supported")
        R = dist.get_world_size(self.group)
        L = num_experts // R
        idx = topk_idx.long()
        rank_of = torch.where(idx >= 0, torch.div(idx, L, rounding_mode="floor"), -1)
        sends, ids, wts, splits = [], [], [], []
        for d in range(R):
            on_d = rank_of == d
            t = torch.nonzero(on_d.any(1)).reshape(-1)
            sends.append(t)
            ids.append(torch.where(on_d[t], idx[t] - d * L, -1))
            wts.append(torch.where(on_d[t], topk_weights.detach()[t], 0.0))
            splits.append(len(t))
        t_all = torch.cat(sends)
        me = dist.get_rank(self.group)
        counts = torch.tensor(splits)
        allc = [torch.empty_like(counts) for _ in range(R)]
        dist.all_gather(allc, counts, group=self.group)
        recv_splits = [int(c[me]) for c in allc]
        rows = self._a2a(x.float()[t_all].to(x.dtype), recv_splits, splits)
        meta = torch.cat([torch.cat(ids), torch.cat(wts).view(torch.int32).long(),
                          t_all[:, None]], 1)
        meta = self._a2a(meta, recv_splits, splits)
        K = topk_idx.shape[1]
        src = torch.stack([torch.repeat_interleave(torch.arange(R), torch.tensor(recv_splits)),
                           meta[:, 2 * K]], 1)
        order = torch.arange(len(src))
        if self.reverse_rows:
            order = order.flip(0)
        return SimpleNamespace(
            recv_x=rows[order], recv_topk_idx=meta[order, :K],
            recv_topk_weights=meta[order, K:2 * K].int().view(torch.float32),
            recv_src=src[order], order=order, splits=splits, recv_splits=recv_splits,
            t_all=t_all, T=x.shape[0], x_dtype=x.dtype)

    def combine(self, expert_y, d, *, weighted):
        back = torch.empty_like(expert_y).index_copy(0, d.order, expert_y)
        y = self._a2a(back, d.splits, d.recv_splits).float()
        out = torch.zeros((d.T, y.shape[1]), dtype=torch.float32)
        return out.index_add(0, d.t_all, y).to(d.x_dtype)



def rank_major(group):
    return RankMajor(group)


def rank_major_reordered(group):
    return RankMajor(group, reverse_rows=True)


rank_major.capabilities = rank_major_reordered.capabilities = {"capacity": False}


class RankMajorGlobalIds(RankMajor):
    """Returns global expert ids where the layout has local ones."""

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        import torch.distributed as dist

        d = super().dispatch(x, topk_idx, topk_weights, num_experts=num_experts, align=align,
                             capacity=capacity)
        L = num_experts // dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        d.recv_topk_idx = torch.where(d.recv_topk_idx >= 0, d.recv_topk_idx + me * L, -1)
        return d


class RankMajorLastRankLost(RankMajor):
    """Combine drops the rows that come back from the highest rank."""

    def combine(self, expert_y, d, *, weighted):
        import torch.distributed as dist

        if dist.get_rank(self.group) == dist.get_world_size(self.group) - 1:
            expert_y = expert_y * 0
        return super().combine(expert_y, d, weighted=weighted)


def rank_major_global_ids(group):
    return RankMajorGlobalIds(group)


def rank_major_last_rank_lost(group):
    return RankMajorLastRankLost(group)


rank_major_global_ids.capabilities = rank_major_last_rank_lost.capabilities = {"capacity": False}
