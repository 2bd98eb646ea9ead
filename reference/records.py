"""The records of the reference: what layout returns (``Layout``), the group-wide facts of one
call (``Group``), what a dispatch returns (``DispatchResult``: the expert-major result, with its
``Source``, its optional ``RankMajor`` output and its ``Group``), and the option names.

Nothing here computes an operation. The option codes are abi.py's; the payload table is
payloads.py's (``Group.payload_of`` names a row of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import payloads
from .abi import TRANSPORT_CODES

# Option values (abi.py's codes; validate.option_triple checks a name against them, and
# reports OPTION with ``b`` -1 for a value that is none).
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


@dataclass(frozen=True)
class Group:
    """Group-wide facts of one dispatch call, the same on every rank after validation: ``R``
    ranks, ``E`` experts, ``H`` columns, top-``K``, x's dtype, and the call's options
    (``transport`` and ``exchange`` both None: the canonical computation, records.resolve_options).
    Every ``DispatchResult`` of the call carries it (``group``)."""

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

    def result(self, rank: int, *, topk_idx, topk_weights, kept, recv_x=None, recv_scale=None,
               recv_topk_idx=None, recv_topk_weights=None, recv_src=None, **arrays
               ) -> "DispatchResult":
        """A rank's ``DispatchResult`` from its arrays (the expert-major ones and ``wire`` named
        as the record's fields; the source's and the rank-major ones as their records' fields,
        the rank-major record only when ``recv_x`` is given)."""
        rank_major = None if recv_x is None else RankMajor(recv_x, recv_scale, recv_topk_idx,
                                                           recv_topk_weights, recv_src)
        return DispatchResult(rank=rank, group=self, source=Source(topk_idx, topk_weights, kept),
                              rank_major=rank_major, **arrays)


@dataclass
class Source:
    """One rank's own tokens as dispatched (the rank as a *source*, ``T = num_tokens``): what
    combine, the backward passes and the transports' return paths read of the source side.

    topk_idx      [T, K] int64     the routing as validated (-1 = unused slot)
    topk_weights  [T, K] float32   the routing weights
    kept          [T, K] bool      slot (this rank, t, k) is used and kept by the capacity
    """

    topk_idx: np.ndarray
    topk_weights: np.ndarray
    kept: np.ndarray

    @property
    def num_tokens(self) -> int:
        """``T``, this rank's token count."""
        return int(self.topk_idx.shape[0])


@dataclass
class RankMajor:
    """One rank's rank-major output (``rank_major=True``; rankmajor.py): the dedup transport's
    receive buffer. ``N`` rows: the tokens (s, t) with a *kept* slot on this rank, ordered by s,
    then t.

    recv_x             [N, H] x dtype (E4M3 under a    x_s[t]
                       quantized payload)
    recv_scale         [N, H/block] or None            the payload's scales of x_s[t]
    recv_topk_idx      [N, K] int64     local expert id of slot k if used, kept and on this
                                        rank; else -1
    recv_topk_weights  [N, K] float32   topk_weights_s[t, k] where the id is >= 0; else 0.0
    recv_src           [N, 2] int64     (s, t)
    """

    recv_x: np.ndarray
    recv_scale: Optional[np.ndarray]
    recv_topk_idx: np.ndarray
    recv_topk_weights: np.ndarray
    recv_src: np.ndarray


@dataclass
class DispatchResult:
    """One rank's dispatch result: rank ``rank`` as destination (the expert-major fields, the
    names of production's ``Dispatch``) and as source (``source``).

    Expert-major, ``M`` rows: segments of local experts 0..L-1 in order, each expert's rows in
    canonical order (source rank, then token), each segment zero-padded to a multiple of
    ``group.align`` (an expert with no rows gets none):
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
    Transport runs only:
        bytes_sent          [R] int64    bytes this rank sent to each peer in the dispatch
                                         (diagonal = the local copy), padding and in-band
                                         headers included
    And:
        group       the call's group-wide facts (``Group``: R, E, H, K, x's dtype, the options)
        source      this rank's own tokens as dispatched (``Source``: routing and kept mask)
        rank_major  the rank-major output (``RankMajor``), None unless ``rank_major=True``
        wire        what a simulated transport keeps between dispatch and combine
                    (transports/); None for canonical runs and for the vectorized tier
    """

    rank: int
    group: Group
    expert_x: np.ndarray
    tokens_per_expert: np.ndarray
    expert_offsets: np.ndarray
    row_src: np.ndarray
    row_weight: np.ndarray
    dropped_per_expert: np.ndarray
    source: Source
    expert_scale: Optional[np.ndarray] = None
    bytes_sent: Optional[np.ndarray] = None
    rank_major: Optional[RankMajor] = None
    wire: Any = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.group.num_local_experts

    @property
    def num_rows(self) -> int:
        return int(self.expert_x.shape[0])

    @property
    def padded_tokens_per_expert(self) -> np.ndarray:
        """``[L]`` int64, each segment's length with its padding (``tokens_per_expert`` rounded
        up to ``align``): the lengths a grouped GEMM given lengths, not offsets, needs."""
        return np.diff(self.expert_offsets)


def resolve_options(transport, exchange):
    """``transport=None, exchange=None``: the canonical computation. Otherwise the production
    defaults fill in what is missing: transport ``"dedup"``, exchange ``"auto"``."""
    if transport is None and exchange is None:
        return None, None
    return ("dedup" if transport is None else transport), ("auto" if exchange is None else exchange)
