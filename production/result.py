"""The result of a dispatch: :class:`Dispatch` (what the caller reads) and its :class:`Handle`
(what combine and the backward passes reuse, DeepEP's ``handle``), and how both are built from
the plan and the token exchange's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from .collectives import group_name
from . import ops

__all__ = ["Dispatch", "Handle", "build", "seal_of"]


@dataclass(eq=False)
class Handle:
    """What combine and the backward passes reuse from one dispatch, and what they check it by.

    Attributes:
        topk_idx: ``[T, K]`` this rank's routing as dispatched.
        topk_weights: ``[T, K]`` float32, the routing weights (detached).
        send_map: ``[T, cols]`` int64, where each of this rank's token (or slot) rows went
            (``cols`` from the transport's row, production/transports/).
        recv_map: ``[N, cols]`` int64, the expert-major row of each received row's slots.
        plan: int64, the plan (production/plan.py), on x's device.
        plan_host: int64, its words in host memory (epkit::count_exchange's second output): what
            combine and the backward passes read on the host, so they wait for nothing. For
            the static exchange on the device path, a routing-free template's words: the
            plan's routing-independent words, which are all a static step reads on the host.
        config: the :class:`epkit.Dispatcher` that dispatched (its transport and exchange).
        x_dtype: x's dtype, the dtype combine returns.
        call_number: the call header's number of this dispatch (-1 when traced).
        rows, hidden: ``M`` and ``H`` of ``expert_x``, what ``expert_y`` must have.
        group_name: the process group's name.
        seal: identity and version of the tensors above (:func:`seal_of`).
        hier_state: ``transport="hier"``: its two stages' maps (epkit.hier.HierState).
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    send_map: Optional[torch.Tensor]
    recv_map: Optional[torch.Tensor]
    plan: torch.Tensor
    plan_host: torch.Tensor
    config: Any
    x_dtype: torch.dtype
    call_number: int
    rows: int
    hidden: int
    group_name: str
    hier_state: Any = None
    seal: tuple = field(default=(), repr=False)


@dataclass(eq=False)
class Dispatch:
    """The expert-major result of a dispatch on this rank (semantics: "Dispatch").

    Attributes:
        expert_x: ``[M, H]`` x's dtype. Segments of local experts ``0..L-1`` in order; rows of
            an expert ordered by source rank, then source token; each segment zero-padded to a
            multiple of ``align``.
        tokens_per_expert: ``[L]`` int64, rows per local expert before padding: the routed
            slots an expert received, *not* its segment's length when ``align > 1``. A grouped
            GEMM that is given lengths (torchtitan's ``cumsum`` of counts, Megatron's
            ``split``) needs ``padded_tokens_per_expert``: the unpadded counts would misplace
            every segment after the first padded one.
        expert_offsets: ``[L+1]`` int64, padded start of each segment; last entry ``M`` (the
            static exchange: the canonical rows, zero rows after it).
        padded_tokens_per_expert: ``[L]`` int64, each segment's length, padding included:
            ``expert_offsets.diff()``, ``tokens_per_expert`` rounded up to ``align``.
        row_src: ``[M, 3]`` int64, ``(source rank, token, k)`` per row; ``-1`` on padding.
        row_weight: ``[M]`` float32, the routing weight of each row; ``0`` on padding.
            Differentiable (its gradient flows to ``topk_weights``).
        dropped_per_expert: ``[L]`` int64, slots each local expert dropped under ``capacity``.
        bytes_sent: ``[R]`` int64, bytes this rank sent to each peer in the token exchange.
        expert_scale: ``[M, H // block]`` under a quantized payload, in its scale dtype
            (``"mxfp8"``: uint8 E8M0 codes, block 32; ``"fp8_block128"``: float32, block 128);
            else None. ``expert_x`` is then float8_e4m3fn.
        expert_x_hp: ``[M, H]`` float32 under a quantized payload: ``expert_x`` dequantized,
            differentiable (the gradient flows back unquantized, straight-through); else None.
        handle: what combine and the backward passes reuse (:class:`Handle`); not for reading.

    Compared by identity (``==`` is ``is``): two dispatches are never "equal" because their
    tensors are, and a Dispatch can be a dict key.
    """

    expert_x: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    row_src: torch.Tensor
    row_weight: torch.Tensor
    dropped_per_expert: torch.Tensor
    bytes_sent: torch.Tensor
    expert_scale: Optional[torch.Tensor] = None
    expert_x_hp: Optional[torch.Tensor] = None
    padded_tokens_per_expert: Optional[torch.Tensor] = None
    handle: Optional[Handle] = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        """``M``, the expert-major row count (padding included)."""
        return self.expert_x.shape[0]


def build(config, call_number: int, x, topk_idx, topk_weights, plan, plan_host, expert_x,
          row_src, row_weight, send_map, recv_map, expert_scale=None, expert_x_hp=None,
          hier_state=None, bytes_sent=None) -> Dispatch:
    """The Dispatch of one call of ``config`` (a Dispatcher): counts and offsets from the plan,
    rows from the exchange."""
    R = dist.get_world_size(config.group)
    handle = Handle(topk_idx, topk_weights.detach(), send_map, recv_map, plan, plan_host, config,
                    x.dtype, call_number, expert_x.shape[0], expert_x.shape[1],
                    group_name(config.group), hier_state)
    tpe, offsets, dropped, sent, padded = ops.dispatch_counts(plan, R, int(config.num_experts))
    d = Dispatch(
        expert_x=expert_x,
        tokens_per_expert=tpe,
        expert_offsets=offsets,
        row_src=row_src,
        row_weight=row_weight,
        dropped_per_expert=dropped,
        bytes_sent=sent if bytes_sent is None else bytes_sent,
        expert_scale=expert_scale,
        expert_x_hp=expert_x_hp,
        padded_tokens_per_expert=padded,
        handle=handle,
    )
    if not torch.compiler.is_compiling():
        handle.seal = seal_of(handle)
    return d


def seal_of(h: Handle) -> tuple:
    """What combine and the backward passes read from a dispatch besides row_weight: the plan
    and its host words, the maps, the routing and x's dtype. Each tensor by identity and version counter, so a
    field replaced, or written in place, after dispatch no longer matches (FOREIGN_DISPATCH),
    instead of sending one rank's kernels out of bounds or out of step."""
    ts = (h.plan, h.plan_host, h.recv_map, h.send_map, h.topk_idx, h.topk_weights)
    return tuple((id(t), getattr(t, "_version", None)) for t in ts) + (h.x_dtype, h.config)
