"""epkit as Megatron-Core's token dispatcher (tested against megatron-core 0.19.2 and 0.16.1).

One line puts it into a built ``MoELayer`` (any ``moe_token_dispatcher_type``)::

    epkit.integrations.megatron.install(moe_layer)          # epkit options as keywords

or build it like Megatron's ``MoEAlltoAllTokenDispatcher``:
``TokenDispatcher(num_local_experts, local_expert_indices, config, pg_collection, **options)``.

What maps to what (docs/migrating.md has the table):

- Megatron's router gives ``routing_map [T, E]`` bool and ``probs [T, E]``; they become epkit's
  ``topk_idx`` / ``topk_weights`` (``epkit.topk_from_routing_map``) with ``K`` the router's
  top-k, or ``E`` under ``moe_pad_expert_input_to_capacity`` (a drop-and-pad map names up to
  ``E`` experts in a row; every expert then gets exactly ``EP * capacity`` rows, as Megatron's).
  The router's drops (``moe_expert_capacity_factor``, ``moe_token_drop_policy``) are already in
  the map, so no epkit ``capacity`` is needed; one given applies epkit's group-wide policy on
  top.
- Megatron applies ``probs`` inside the experts, so the experts get ``row_weight`` (in the
  probs' dtype, exactly) and the combine is unweighted (``combine(weighted=False)``).
- The experts split rows by the padded segment lengths (``padded_tokens_per_expert``, plus the
  static exchange's trailing zero rows on the last expert), never ``tokens_per_expert``.
- Groups: epkit runs over ``pg_collection.ep``. Expert tensor parallelism
  (``expert_tensor_parallel_size > 1``: Megatron all-gathers the dispatched rows over
  ``expt_tp`` and reduce-scatters the experts' output) has no counterpart and is refused; the
  attention's tensor / sequence parallelism is untouched (the layer's input is this rank's
  sequence shard, which is what epkit dispatches).
- Shared-expert overlap (``moe_shared_expert_overlap``): the shared expert's steps run where
  Megatron's all-to-all dispatcher runs them (its all-gather before the dispatch, fc1 after
  it, fc2 and its output after the combine).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import torch

from . import require

_td = require("megatron.core.transformer.moe.token_dispatcher", "megatron-core",
              "epkit.integrations.megatron")

from ..api import Dispatcher  # noqa: E402
from ..routing import topk_from_routing_map  # noqa: E402

__all__ = ["TokenDispatcher", "install"]


class TokenDispatcher(_td.MoETokenDispatcher):
    """A ``MoETokenDispatcher`` whose exchange is ``epkit.Dispatcher`` over ``pg_collection.ep``.

    Args:
        num_local_experts, local_expert_indices, config, pg_collection: as Megatron's
            ``MoEAlltoAllTokenDispatcher``.
        **options: ``epkit.Dispatcher``'s keywords (``align``, ``transport``, ``exchange``,
            ``payload``, ``max_tokens_per_rank``, ``capacity`` / ``capacity_factor``,
            ``ranks_per_node``, ``workspace``); ``group`` and ``num_experts`` come from Megatron.
            A quantized ``payload`` hands the experts ``expert_x_hp`` (dequantized) in the
            tokens' dtype.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None, **options):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise NotImplementedError(
                "epkit.integrations.megatron: expert tensor parallelism (expt_tp size "
                f"{self.tp_size}) has no counterpart in epkit; set expert_tensor_parallel_size=1 "
                "(attention tensor / sequence parallelism is fine)")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        # A drop-and-pad map names up to E experts in a row (topk_from_routing_map).
        self.topk = self.num_experts if self.drop_and_pad else config.moe_router_topk
        self.dispatcher = Dispatcher(self.ep_group, self.num_experts, **options)
        self.handle = None  # the epkit Dispatch of the step in flight

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        """``hidden_states [S, B, H]`` (or ``[T, H]``), ``routing_map [T, E]`` bool,
        ``probs [T, E]``: the tokens as ``[T, H]`` and ``probs`` unchanged; the routing is
        kept as ``topk_idx`` / ``topk_weights`` for ``token_dispatch``."""
        self.hidden_shape = hidden_states.shape
        self.probs_dtype = probs.dtype
        self.topk_idx, self.topk_weights = topk_from_routing_map(routing_map, probs,
                                                                 topk=self.topk)
        if self.shared_experts is not None:  # where Megatron's all-to-all dispatcher starts it
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The epkit dispatch: ``(rows [M, H], row weights [M] in probs' dtype)``."""
        d = self.dispatcher.dispatch(hidden_states, self.topk_idx, self.topk_weights)
        self.handle = d
        self.topk_idx = self.topk_weights = None
        rows = d.expert_x if d.expert_x_hp is None else d.expert_x_hp.to(hidden_states.dtype)
        # row_weight holds the probs' values exactly (widened), so this cast is exact.
        return rows, d.row_weight.to(self.probs_dtype)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``(rows, rows per local expert [L] int64 on the host, row weights)``: the padded
        segment lengths, the static exchange's trailing zero rows counted in the last one
        (their weight is 0, and the combine never reads them)."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(hidden_states)
        d = self.handle
        lengths = d.padded_tokens_per_expert.to("cpu", copy=True)
        lengths[-1] += d.num_rows - int(lengths.sum())
        return hidden_states, lengths, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """The epkit combine, unweighted: Megatron's experts applied the probs already."""
        d, self.handle = self.handle, None
        return self.dispatcher.combine(hidden_states, d, weighted=False)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


def install(moe_layer, **options) -> TokenDispatcher:
    """Replace ``moe_layer.token_dispatcher`` by an epkit ``TokenDispatcher`` over the same
    groups (and the same shared expert, under ``moe_shared_expert_overlap``); returns it.
    ``options``: ``epkit.Dispatcher``'s keywords."""
    old = moe_layer.token_dispatcher
    groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
    new = TokenDispatcher(moe_layer.num_local_experts, moe_layer.local_expert_indices,
                          moe_layer.config, groups, **options)
    if getattr(old, "shared_experts", None) is not None:
        new.set_shared_experts(old.shared_experts)
    moe_layer.token_dispatcher = new
    return new

