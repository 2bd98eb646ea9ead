"""``epkit verify`` adapter for Megatron-Core's own ``MoEAlltoAllTokenDispatcher`` (the installed
class):

    epkit verify --impl epkit.verify.megatron:verify_adapter --contract bounded

The harness's ``topk_idx`` / ``topk_weights`` go in as Megatron's ``routing_map`` / ``probs``
(``epkit.routing_map_from_topk``), through the dispatcher's six steps; ``row_src`` travels by
one extra all-to-all with the dispatcher's own split sizes, reordered by its own
``sort_chunks_by_idxs``. Megatron applies ``probs`` inside its experts and combines unweighted,
so a weighted combine multiplies the rows by the dispatched probs first, in the rows' dtype, as
its experts do. Its capacity is the router's (per source rank), not the dispatcher's; it never
pads; its combine sums in the rows' dtype.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

from epkit.integrations import require

# megatron-core warns, on import and per config, of what a CPU machine lacks (Transformer
# Engine, Apex) and of defaults it applies; none of it concerns the dispatcher.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

_td = require("megatron.core.transformer.moe.token_dispatcher", "megatron-core",
              "epkit.verify.megatron")
_moe_utils = require("megatron.core.transformer.moe.moe_utils", "megatron-core",
                     "epkit.verify.megatron")
_config = require("megatron.core.transformer.transformer_config", "megatron-core",
                  "epkit.verify.megatron")

from epkit.routing import routing_map_from_topk  # noqa: E402
from .adapt import exchange_row_src, offsets_of  # noqa: E402

__all__ = ["verify_adapter"]


def _host_split_sizes(self, point, tokens_per_expert=None):
    """The dispatcher's device-to-host copy of its split sizes, for CPU tensors: they are host
    memory already; the all-to-all takes them as host sequences, as the copy makes them."""
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.numpy())
    return tokens_per_expert


class _Dispatcher(_td.MoEAlltoAllTokenDispatcher):
    """Megatron's class, counting the rows a routing map sends. A dropless map is taken to hold
    exactly top-k experts a token (``num_out_tokens = T * K``, which megatron-core 0.19's
    permute sizes its output by); the harness's maps leave slots unused (``-1``), which
    Megatron's router never does, so the count is the map's."""

    def preprocess(self, routing_map):
        out = super().preprocess(routing_map)
        if not self.drop_and_pad and self.config.moe_expert_capacity_factor is None:
            self.num_out_tokens = routing_map.sum()
        return out


class _CPUDispatcher(_Dispatcher):
    """Megatron's class on a machine without CUDA: its constructor makes a CUDA stream for the
    device-to-host copies, which run on that stream. Nothing else differs."""

    _maybe_dtoh_and_synchronize = _host_split_sizes

    def __init__(self, *args, **kwargs):
        saved, _td.torch.cuda.Stream = _td.torch.cuda.Stream, lambda *a, **k: None
        try:
            super().__init__(*args, **kwargs)
        finally:
            _td.torch.cuda.Stream = saved



class MegatronAdapter:
    def __init__(self, group):
        self.group = group
        self.configs = {}
        self.cls = _Dispatcher if torch.cuda.is_available() else _CPUDispatcher
        if not torch.cuda.is_available():
            # Megatron's all-to-all and all-gather (forward and backward) allocate their output
            # on torch.cuda.current_device(), which raises without CUDA; "cpu" is a device
            # string those allocations take. Nothing that could run here is changed.
            torch.cuda.current_device = lambda: "cpu"

    def _dispatcher(self, num_experts, topk, hidden):
        R, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        key = (num_experts, topk, hidden)
        if key not in self.configs:
            self.configs[key] = _config.TransformerConfig(
                num_layers=1, hidden_size=hidden, num_attention_heads=1,
                num_moe_experts=num_experts, moe_router_topk=topk,
                moe_token_dispatcher_type="alltoall", add_bias_linear=False,
                expert_model_parallel_size=R, moe_router_load_balancing_type="none",
                moe_router_pre_softmax=True)  # a router setting (required at top-1), unused here
        L = num_experts // R
        # expt_tp None: a group of one to Megatron (get_pg_size(None) == 1); EP only.
        groups = SimpleNamespace(ep=self.group, expt_tp=None, tp_ep=self.group)
        return self.cls(L, list(range(me * L, (me + 1) * L)), self.configs[key], groups)

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align, capacity):
        if capacity is not None or align != 1:
            raise NotImplementedError("Megatron's dispatcher neither drops (its router does) "
                                      "nor pads")
        T, K = topk_idx.shape
        disp = self._dispatcher(num_experts, K, x.shape[1])  # one per dispatch: it keeps state
        routing_map, probs = routing_map_from_topk(topk_idx, topk_weights, num_experts)
        tokens, p = disp.dispatch_preprocess(x, routing_map, probs)
        tokens, p = disp.token_dispatch(tokens, p)
        rows, tokens_per_expert, row_probs = disp.dispatch_postprocess(tokens, p)
        # Megatron's send order: expert-major, then token (permute's masked_select of map.T).
        ids = torch.where(topk_idx < 0, num_experts, topk_idx.long()).reshape(-1)
        perm = torch.argsort(ids, stable=True)[: int((topk_idx >= 0).sum())]
        # Its split sizes (None at expert-parallel size 1: everything stays here).
        ins = disp.input_splits if disp.input_splits is not None else [len(perm)]
        outs = disp.output_splits if disp.output_splits is not None else [len(perm)]
        order = None
        if disp.num_local_experts > 1:  # its receive-side sort, applied to row numbers
            received = torch.arange(int(sum(outs)))
            order, _ = _moe_utils.sort_chunks_by_idxs(
                received, disp.num_global_tokens_per_local_expert.ravel(),
                disp.sort_input_by_local_experts)
        row_src, row_weight = exchange_row_src(perm, K, topk_weights, ins, outs, self.group,
                                               order=order)
        return SimpleNamespace(expert_x=rows, tokens_per_expert=tokens_per_expert,
                               expert_offsets=offsets_of(tokens_per_expert), row_src=row_src,
                               row_weight=row_weight, dispatcher=disp, row_probs=row_probs,
                               x_dtype=x.dtype)

    def combine(self, expert_y, d, *, weighted):
        y = expert_y
        if weighted:  # what Megatron's experts do with the probs, in the rows' dtype
            y = y * d.row_probs.to(y.dtype).unsqueeze(-1)
        disp = d.dispatcher
        out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))
        return out.to(d.x_dtype)


def verify_adapter(group):
    return MegatronAdapter(group)


verify_adapter.capabilities = {"capacity": False, "align": (1,), "accumulate": "native"}
