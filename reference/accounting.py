"""Byte accounting: what a dispatch and a combine move between every pair of ranks, without
moving anything (``dispatch_bytes``, ``combine_bytes``), for the one-stage transports.

The numbers are each transport's own accounting (transports/: ``dispatch_bytes_of`` /
``combine_bytes_of`` on the plan its run derives), so they equal the ``bytes_sent`` of a real
run bit for bit. They know pairs and dedup; under hier they give dedup's plan from the count
words alone (``Transport.accounting``; hier's two stages: transports.hier.dispatch_bytes_of).
The functions on a plan below take the transport from ``group.transport`` the same way
(``epkit simulate`` and the tests call them with count words they drew).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from . import transports
from .capacity import kept_mask
from .dtypes import FLOAT_DTYPES, dtype_code
from .errors import Reason, error
from .exchange import is_static, split_option
from .payloads import get as get_payload
from .records import Group, resolve_options
from .transports.direct import Plan
from .validate import check_layout, check_options


def _of(group: Group):
    """The one-stage transport whose accounting serves ``group.transport``."""
    return transports.of(group.transport).accounting


def plan(group: Group, words: np.ndarray, token_rows: Optional[np.ndarray] = None,
         single: Optional[np.ndarray] = None) -> Plan:
    """The plan from the gathered count words (transports.direct.Direct.plan)."""
    return _of(group).plan(group, words, token_rows, single)


def wire_plan(group: Group, idx, kept, words: Optional[np.ndarray] = None) -> Plan:
    """The plan a run derives from the group's routing and kept masks."""
    return _of(group).wire_plan(group, idx, kept, words)


def dispatch_bytes_of(group: Group, p: Plan) -> np.ndarray:
    return _of(group).dispatch_bytes_of(group, p)


def combine_bytes_of(group: Group, p: Plan) -> np.ndarray:
    return _of(group).combine_bytes_of(group, p)


def combine_backward_bytes_of(group: Group, p: Plan, weighted: bool) -> List[np.ndarray]:
    return _of(group).combine_backward_bytes_of(group, p, weighted)


def bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity, payload,
                max_tokens_per_rank):
    """Validate the byte-accounting arguments; return ``(Group, idx int64 list)``."""
    transport, exchange = resolve_options(transport or "dedup", exchange)
    exchange = split_option(exchange)[0]  # lazy runs its variant, auto
    R = len(topk_idx)
    check_options(R, align=1, capacity=capacity, num_experts=num_experts, transport=transport,
                  exchange=exchange, payload=payload, max_tokens_per_rank=max_tokens_per_rank)
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise error(0, Reason.X_DTYPE, dtype_code(dtype))
    idx = check_layout(topk_idx, num_experts)
    for r in range(1, R):
        if idx[r].shape[1] != idx[0].shape[1]:
            raise error(r, Reason.TOPK_MISMATCH, idx[r].shape[1], idx[0].shape[1])
    code, a, b = get_payload(payload).hidden_triple(int(hidden))
    if code != Reason.OK:
        raise error(0, code, a, b)
    if is_static(exchange):
        for r in range(R):
            if idx[r].shape[0] > max_tokens_per_rank:
                raise error(r, Reason.STATIC_OVERFLOW, idx[r].shape[0], max_tokens_per_rank)
    group = Group(R, int(num_experts), int(hidden), idx[0].shape[1], dtype, 1,
                  None if capacity is None else int(capacity), payload, transport, exchange,
                  None if max_tokens_per_rank is None else int(max_tokens_per_rank))
    return group, idx


def dispatch_bytes(topk_idx, num_experts, hidden, dtype="bfloat16", transport="dedup",
                   exchange="ragged", capacity=None, payload=None, max_tokens_per_rank=None):
    """Bytes rank s sends to rank d in a dispatch ([R, R] int64; diagonal = the local copy).

    pairs: ``P + 16`` per kept slot; dedup: ``P + 8`` per token row (a token with a kept slot on
    d) plus 8 per slot row (a kept slot on d); each section as its exchange variant moves it
    (padding and in-band header rows included).

    Args: topk_idx: R arrays [T_r, K] integer; hidden: H; dtype: x's dtype; the rest as
    ``dispatch``. Checks (raising ``InputError``): options, dtype, routing per rank, K agreement,
    ``H % block`` under a quantized payload, ``T_r <= max_tokens_per_rank`` under the static
    exchange, and a uniform plan for ``exchange="equal"``.
    """
    group, idx = bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity,
                             payload, max_tokens_per_rank)
    p = wire_plan(group, idx, kept_mask(idx, group.num_experts, group.capacity))
    return dispatch_bytes_of(group, p)


def combine_bytes(topk_idx, num_experts, hidden, dtype="bfloat16", transport="dedup",
                  exchange="ragged", capacity=None, payload=None, max_tokens_per_rank=None):
    """Bytes rank a sends to rank b in the combine ([R, R] int64), ``dtype`` = expert_y's dtype.

    pairs: ``H * itemsize(dtype)`` per kept slot; dedup: ``min(n * itemsize(dtype), 4) * H``
    per token row with n kept slots (its raw rows, or a float32 partial sum), padded / equal /
    static to the caps of ``transports.dedup.back_exchange``. The counts are the dispatch's,
    transposed. ``payload`` does not change the combine (it travels unquantized); it is
    checked like in ``dispatch_bytes``.
    """
    group, idx = bytes_group(topk_idx, num_experts, hidden, dtype, transport, exchange, capacity,
                             payload, max_tokens_per_rank)
    p = wire_plan(group, idx, kept_mask(idx, group.num_experts, group.capacity))
    return combine_bytes_of(group, p)
