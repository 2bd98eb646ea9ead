"""epkit as torchtitan's token dispatcher (tested against torchtitan 0.3.0).

One line in the model config, before the model is built, does what torchtitan's own
``swap_token_dispatcher`` does for its dispatchers::

    epkit.integrations.torchtitan.swap_token_dispatcher(moe_config.routed_experts, align=16)

(or set ``routed_experts.token_dispatcher = TokenDispatcher.Config(num_experts=E, top_k=K,
...)``). ``RoutedExperts.parallelize`` then wires the expert-parallel mesh as for any
``BaseEPTokenDispatcher``; epkit runs over ``ep_mesh.get_group()``.

What maps to what (docs/migrating.md has the table):

- torchtitan's router gives ``topk_scores [T, K]`` and ``topk_expert_ids [T, K]``: epkit's
  ``topk_weights`` and ``topk_idx`` as they are (bfloat16 scores are widened exactly). epkit
  counts the tokens itself, so ``num_local_tokens_per_expert`` is not read.
- The experts get ``expert_x`` and the padded segment lengths (``padded_tokens_per_expert``;
  torchtitan's ``GroupedExperts`` turns them into offsets with a ``cumsum``). ``align`` is
  torchtitan's ``pad_multiple`` (TorchAO / HybridEP dispatchers, for quantized grouped GEMMs).
- The combine is weighted (torchtitan scores the experts' output in its combine).
- Expert-parallel size 1 (no ``ep`` mesh, ``wire_meshes(ep_mesh=None)``, or a model that is
  never parallelized): epkit runs over ``epkit.group_of_one()``, never the world group.
- torchtitan drops no token; epkit's ``capacity`` / ``capacity_factor`` (group-wide, first come)
  may be given and then drop, which torchtitan's own dispatcher never does.
- torchtitan's all-to-all dispatcher offers no shared-expert overlap (its MoE runs the shared
  expert after the routed ones), so neither does this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import require

_td = require("torchtitan.models.common.token_dispatcher", "torchtitan",
              "epkit.integrations.torchtitan")

from ..api import Dispatch, Dispatcher, group_of_one  # noqa: E402

__all__ = ["TokenDispatcher", "swap_token_dispatcher"]


class TokenDispatcher(_td.BaseEPTokenDispatcher):
    """A ``BaseEPTokenDispatcher`` whose exchange is ``epkit.Dispatcher``."""

    @dataclass(kw_only=True, slots=True)
    class Config(_td.BaseEPTokenDispatcher.Config):
        """torchtitan's ``num_experts`` and ``top_k``, then ``epkit.Dispatcher``'s options."""

        align: int = 1
        transport: str = "dedup"
        exchange: str = "auto"
        payload: Optional[str] = None
        max_tokens_per_rank: Optional[int] = None
        capacity: Optional[int] = None
        capacity_factor: Optional[float] = None
        ranks_per_node: Optional[int] = None
        workspace: bool = True

    def __init__(self, config: Config):
        super().__init__(config)
        self.options = dict(align=config.align, transport=config.transport,
                            exchange=config.exchange, payload=config.payload,
                            max_tokens_per_rank=config.max_tokens_per_rank,
                            capacity=config.capacity, capacity_factor=config.capacity_factor,
                            ranks_per_node=config.ranks_per_node, workspace=config.workspace)
        self.dispatcher: Optional[Dispatcher] = None

    def init_buffer(self) -> None:
        """The epkit Dispatcher over the wired mesh's group (a group of one without a mesh).
        Called by ``wire_meshes``, so on every rank together (``group_of_one`` is collective
        the first time)."""
        group = self.ep_mesh.get_group() if self.ep_mesh is not None else group_of_one()
        self.dispatcher = Dispatcher(group, self.num_experts, **self.options)

    def dispatch(self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor,
                 topk_expert_ids_TK: torch.Tensor, num_local_tokens_per_expert_E: torch.Tensor):
        """``(rows [M, D], rows per local expert [L] int64, the Dispatch)``: the padded segment
        lengths, the static exchange's trailing zero rows counted in the last one (the
        combine never reads them)."""
        del num_local_tokens_per_expert_E  # epkit counts the routing itself
        if self.dispatcher is None:  # never wired: a model that was not parallelized
            self.init_buffer()
        d = self.dispatcher.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK)
        rows = d.expert_x if d.expert_x_hp is None else d.expert_x_hp.to(x_TD.dtype)
        lengths = d.padded_tokens_per_expert.clone()
        lengths[-1] += d.num_rows - d.expert_offsets[-1]
        return rows, lengths, d

    def combine(self, routed_output_RD: torch.Tensor, metadata: Dispatch,
                x_TD: torch.Tensor) -> torch.Tensor:
        """The weighted epkit combine, ``[T, D]`` in x's dtype."""
        del x_TD
        return self.dispatcher.combine(routed_output_RD, metadata, weighted=True)


def swap_token_dispatcher(routed_experts_config, **options) -> None:
    """Set ``routed_experts_config.token_dispatcher`` (a ``RoutedExperts.Config``) to epkit's,
    keeping its ``num_experts`` and ``top_k``; ``options``: ``TokenDispatcher.Config``'s epkit
    fields (``align``, ``transport``, ``exchange``, ...). Call it before the model is built."""
    old = routed_experts_config.token_dispatcher
    routed_experts_config.token_dispatcher = TokenDispatcher.Config(
        num_experts=old.num_experts, top_k=old.top_k, **options)

