"""``epkit verify`` adapter for torchtitan's own ``AllToAllTokenDispatcher`` (the installed class):

    epkit verify --impl epkit.verify.torchtitan:verify_adapter --contract bounded

The harness's routing goes in as torchtitan's ``topk_scores`` / ``topk_expert_ids``; the
dispatcher's rows, counts and combine come out unchanged. ``row_src`` travels by one extra
all-to-all with the dispatcher's own split sizes (``epkit.verify.adapt.exchange_row_src``).
torchtitan routes every slot (no ``-1``; ``FullTopK`` turns unused slots into padding rows),
never pads (its ``AllToAllTokenDispatcher``; padding is the TorchAO dispatcher's, which needs
torchao), never drops, and sums the combine in the tokens' dtype.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.distributed as dist

from epkit.integrations import require

_td = require("torchtitan.models.common.token_dispatcher", "torchtitan",
              "epkit.verify.torchtitan")
_titan_dist = require("torchtitan.distributed.utils", "torchtitan", "epkit.verify.torchtitan")

from .adapt import FullTopK, exchange_row_src, offsets_of  # noqa: E402

__all__ = ["verify_adapter"]


class TitanAdapter:
    def __init__(self, group):
        from torch.distributed.device_mesh import DeviceMesh

        self.group = group
        # The default SPMD backend ("spmd_types") exchanges over the trainer's registered mesh,
        # which a dispatcher run outside the trainer has not; "partial_dtensor" (one of
        # torchtitan's parallelism.spmd_backend settings) exchanges over the wired ep mesh.
        _titan_dist.set_spmd_backend("partial_dtensor")
        device = "cpu" if dist.get_backend(group) == "gloo" else "cuda"
        self.mesh = DeviceMesh.from_group(group, device, mesh_dim_names=("ep",))
        self.dispatchers = {}

    def _dispatcher(self, num_experts, topk):
        key = (num_experts, topk)
        if key not in self.dispatchers:
            d = _td.AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=topk).build()
            d.wire_meshes(ep_mesh=self.mesh)
            self.dispatchers[key] = d
        return self.dispatchers[key]

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        if capacity is not None or align != 1:
            raise NotImplementedError("torchtitan's AllToAllTokenDispatcher neither drops nor pads")
        K = topk_idx.shape[1]
        disp = self._dispatcher(num_experts, K)
        ids = topk_idx.long()
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts)  # what its MoE passes
        rows, tokens_per_expert, meta = disp.dispatch(x, topk_weights, ids, counts)
        # Its own slot order: a stable argsort of the flattened expert ids (_local_reorder).
        perm = torch.argsort(ids.reshape(-1), stable=True)
        row_src, row_weight = exchange_row_src(perm, K, topk_weights, meta.input_splits,
                                               meta.output_splits, self.group,
                                               order=meta.permuted_indices)
        return SimpleNamespace(expert_x=rows, tokens_per_expert=tokens_per_expert,
                               expert_offsets=offsets_of(tokens_per_expert), row_src=row_src,
                               row_weight=row_weight, meta=meta, x=x, dispatcher=disp)

    def combine(self, expert_y, d, *, weighted):
        meta = d.meta
        if not weighted:  # torchtitan always scores in its combine: score by ones instead
            ones = torch.ones_like(meta.topk_scores_experts_sorted_N)
            meta = dataclasses.replace(meta, topk_scores_experts_sorted_N=ones)
        # The output takes x's dtype (torch.zeros_like(x)); expert_y's may differ.
        return d.dispatcher.combine(expert_y.to(d.x.dtype), meta, d.x)


def verify_adapter(group):
    return FullTopK(TitanAdapter(group), group)


verify_adapter.capabilities = {"capacity": False, "align": (1,), "accumulate": "native"}
