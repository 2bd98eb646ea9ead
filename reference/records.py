"""The records of the reference: what a dispatch returns (``DispatchResult``), what layout
returns (``Layout``), the group-wide facts of one call (``Group``), and the option names.

Nothing here computes an operation. The option codes are abi.py's; the payload table is
payloads.py's (``Group.payload_of`` names a row of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import payloads
from .abi import TRANSPORT_CODES

# Option values (abi.py's codes). The OPTION reason's detail ``b`` is -1 for a value not in
# these tables; the exchange names are exchange.NAMES, the payload names payloads.NAMES.
TRANSPORTS = tuple(TRANSPORT_CODES)


@dataclass
class Layout:
    """What one rank learns in the prepare step (``layout``). All counts are pre-capacity.

    tokens_per_expert       [E] int64      used slots of this rank per expert
    tokens_per_rank         [R] int64      tokens of this rank with a used slot on each rank
    slots_per_rank          [R] int64      used slots of this rank per destination rank
    is_token_in_rank        [T, R] bool    token t has a used slot on rank d
    recv_tokens_per_expert  [R, L] int64   row s: used slots rank s sends to each local expert
                                           of this rank (the count exchange's result)
    """

    rank: int
    tokens_per_expert: np.ndarray
    tokens_per_rank: np.ndarray
    slots_per_rank: np.ndarray
    is_token_in_rank: np.ndarray
    recv_tokens_per_expert: np.ndarray


@dataclass
class DispatchResult:
    """One rank's dispatch result (rank ``rank`` as destination *and* as source).

    As destination (expert-major, ``M`` rows):
        expert_x            [M, H] x dtype (E4M3 under a          segments of experts 0..L-1, padded
                            quantized payload)
        expert_scale        [M, H/block] or None                 the payload's scales, in its
                                                                 scale dtype (0 on padding)
        tokens_per_expert   [L] int64                            kept rows per local expert
        padded_tokens_per_expert  [L] int64 (a property)         segment lengths, padding included
        expert_offsets      [L+1] int64                          padded segment starts; last is M
        row_src             [M, 3] int64                         (s, t, k); (-1, -1, -1) on padding
        row_weight          [M] float32                          topk_weights_s[t, k]; 0 on padding
        dropped_per_expert  [L] int64                            slots each local expert dropped
    Rank-major (only with ``rank_major=True``, ``N`` rows):
        recv_x [N, H], recv_scale [N, H/block] (quantized payloads), recv_topk_idx [N, K] int64,
        recv_topk_weights [N, K] float32, recv_src [N, 2] int64
    As source (this rank's own tokens, ``T = num_tokens``):
        topk_idx [T, K] int64, topk_weights [T, K] float32, kept [T, K] bool
    Transport runs only:
        bytes_sent [R] int64    bytes this rank sent to each peer in the dispatch (diagonal =
                                the local copy), padding and in-band headers included
    """

    rank: int
    num_ranks: int
    num_experts: int
    hidden: int
    topk: int
    num_tokens: int
    x_dtype: np.dtype
    align: int
    capacity: Optional[int]
    payload: Optional[str]
    transport: Optional[str]
    exchange: Optional[str]
    expert_x: np.ndarray
    tokens_per_expert: np.ndarray
    expert_offsets: np.ndarray
    row_src: np.ndarray
    row_weight: np.ndarray
    dropped_per_expert: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    kept: np.ndarray
    expert_scale: Optional[np.ndarray] = None
    recv_x: Optional[np.ndarray] = None
    recv_scale: Optional[np.ndarray] = None
    recv_topk_idx: Optional[np.ndarray] = None
    recv_topk_weights: Optional[np.ndarray] = None
    recv_src: Optional[np.ndarray] = None
    bytes_sent: Optional[np.ndarray] = None
    max_tokens_per_rank: Optional[int] = None
    # The nodes of the combine's summation order (arith.grouped_total_sum); 1: rank by rank.
    ranks_per_node: int = 1
    # What a simulated transport keeps between dispatch and combine (transports/); None for
    # canonical runs and for the vectorized tier.
    wire: Any = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_rows(self) -> int:
        return int(self.expert_x.shape[0])

    @property
    def padded_tokens_per_expert(self) -> np.ndarray:
        """``[L]`` int64, each segment's length with its padding (``tokens_per_expert`` rounded
        up to ``align``): the lengths a grouped GEMM given lengths, not offsets, needs."""
        return np.diff(self.expert_offsets)


@dataclass(frozen=True)
class Group:
    """Group-wide facts of one dispatch call, the same on every rank after validation."""

    num_ranks: int
    num_experts: int
    hidden: int
    topk: int
    x_dtype: np.dtype
    align: int = 1
    capacity: Optional[int] = None
    payload: Optional[str] = None
    transport: Optional[str] = None
    exchange: Optional[str] = None
    max_tokens_per_rank: Optional[int] = None
    ranks_per_node: int = 1     # nodes of the summation order (and of the hier transport)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def payload_of(self) -> payloads.Payload:
        """This call's entry of the payload table (payloads.py)."""
        return payloads.get(self.payload)

    @property
    def row_dtype(self) -> np.dtype:
        """dtype of dispatched rows: x's, or E4M3 under a quantized payload."""
        return self.payload_of.row_dtype(self.x_dtype)

    @property
    def payload_bytes(self) -> int:
        """``P``: bytes of one token's payload on the wire."""
        return self.payload_of.row_bytes(self.hidden, self.x_dtype)

    def result(self, rank: int, *, topk_idx, topk_weights, kept, **arrays) -> DispatchResult:
        """A rank's ``DispatchResult`` from its arrays (names as the record's fields)."""
        return DispatchResult(
            rank=rank, num_ranks=self.num_ranks, num_experts=self.num_experts, hidden=self.hidden,
            topk=self.topk, num_tokens=int(topk_idx.shape[0]), x_dtype=self.x_dtype, align=self.align,
            capacity=self.capacity, payload=self.payload, transport=self.transport,
            exchange=self.exchange, max_tokens_per_rank=self.max_tokens_per_rank,
            ranks_per_node=self.ranks_per_node,
            topk_idx=topk_idx, topk_weights=topk_weights, kept=kept, **arrays)


def resolve_options(transport, exchange):
    """``transport=None, exchange=None``: the canonical computation. Otherwise the production
    defaults fill in what is missing: transport ``"dedup"``, exchange ``"auto"``."""
    if transport is None and exchange is None:
        return None, None
    return ("dedup" if transport is None else transport), ("auto" if exchange is None else exchange)
