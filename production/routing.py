"""Converting routing from other dispatchers' conventions to epkit's (docs/migrating.md).

Megatron-Core and torchtitan describe a token's routing by a dense ``routing_map [T, E]`` bool
(which experts a token goes to) and ``probs [T, E]`` (their weights); epkit (like DeepEP) takes
``topk_idx [T, K]`` and ``topk_weights [T, K]``. These are local, pure functions: no collective.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["topk_from_routing_map", "routing_map_from_topk"]


def topk_from_routing_map(routing_map: torch.Tensor, probs: torch.Tensor,
                          topk: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, K] int64, topk_weights [T, K] float32)`` from a dense routing map.

    Args:
        routing_map: ``[T, E]`` bool, ``True`` where token ``t`` goes to expert ``e``.
        probs: ``[T, E]`` float, the weight of each (token, expert); read only where
            ``routing_map`` is set (converted to float32, exactly for float32 / bfloat16).
        topk: ``K``. Default: the most experts any row of this rank names. Pass the model's
            top-k: every rank of a group must use the same ``K``. A drop-and-pad map
            (Megatron-Core's ``moe_pad_expert_input_to_capacity``: every expert's column holds
            exactly ``capacity`` tokens, padded with tokens the router did not pick, whose
            ``probs`` are 0) may name more than top-k experts in a row: pass
            ``topk=routing_map.shape[1]`` (``E``), the most any row can name. Dispatched
            as is, with no ``capacity`` or ``align`` of epkit's, it gives every local expert
            exactly ``R * capacity`` rows (source rank, then token order, as Megatron's),
            the padding entries with weight 0.

    Slot ``k`` of a row holds the row's ``k``-th routed expert in ascending expert order;
    the remaining slots of a row with fewer than ``K`` experts are ``-1`` with weight ``0``.
    """
    if not isinstance(routing_map, torch.Tensor) or not isinstance(probs, torch.Tensor):
        raise TypeError("epkit.topk_from_routing_map: routing_map and probs must be tensors "
                        "(from NumPy: torch.from_numpy)")
    if routing_map.dim() != 2 or probs.shape != routing_map.shape:
        raise ValueError(f"epkit.topk_from_routing_map: routing_map [T, E] and probs [T, E] "
                         f"expected, got {tuple(routing_map.shape)} and {tuple(probs.shape)}")
    mask = routing_map.to(torch.bool)
    T, E = mask.shape
    per_row = mask.sum(dim=1)
    most = int(per_row.max()) if T else 0
    K = most if topk is None else int(topk)
    if K < most:
        raise ValueError(f"epkit.topk_from_routing_map: a row routes to {most} experts, more "
                         f"than topk={K}. A drop-and-pad routing map (Megatron-Core's "
                         f"moe_pad_expert_input_to_capacity) names up to E experts per row: pass "
                         f"topk=routing_map.shape[1] ({E}), the same on every rank")
    # A stable sort of "not routed" puts each row's routed experts first, ascending.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :K]
    used = torch.arange(K, device=mask.device).unsqueeze(0) < per_row.unsqueeze(1)
    topk_idx = torch.where(used, order, torch.full_like(order, -1)).to(torch.int64)
    weights = torch.gather(probs.to(torch.float32), 1, order)
    topk_weights = torch.where(used, weights, torch.zeros_like(weights))
    return topk_idx, topk_weights


def routing_map_from_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                          num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse: ``(routing_map [T, E] bool, probs [T, E] float32)``, zeros where unrouted."""
    T = topk_idx.shape[0]
    used = topk_idx >= 0
    rows = torch.arange(T, device=topk_idx.device).unsqueeze(1).expand_as(topk_idx)[used]
    cols = topk_idx[used].to(torch.int64)
    routing_map = torch.zeros(T, num_experts, dtype=torch.bool, device=topk_idx.device)
    probs = torch.zeros(T, num_experts, dtype=torch.float32, device=topk_idx.device)
    routing_map[rows, cols] = True
    probs[rows, cols] = topk_weights.to(torch.float32)[used]
    return routing_map, probs
