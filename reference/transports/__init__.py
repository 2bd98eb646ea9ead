"""The transport table: which class carries each transport out, byte for byte.

A transport decides what rows travel (exchange.py moves them). Every transport is a subclass
of ``Transport`` (base.py: the operations every transport has, and the byte rows they share):

    base.py     Transport (the interface); byte rows, payload encode / decode
    direct.py   the one-stage transports' shared body: Plan, count_words, Wire, Direct (the plan,
                dispatch, the return path, combine backward, their byte accounting)
    pairs.py    Pairs: a row per kept slot
    dedup.py    Dedup: token rows and slot rows (a token once per destination rank)
    hier.py     Hier: node-aware, two stages (inter-node, then intra-node)

Adding a transport is one module with a subclass, one row here, its code in
abi.TRANSPORT_CODES (records.TRANSPORTS are its names), and its counterpart in production.
The byte functions ``dispatch_bytes`` / ``combine_bytes`` are accounting.py's.
"""

from __future__ import annotations

from typing import List

import numpy as np

from .base import Transport
from .dedup import DEDUP
from .direct import count_words
from .hier import HIER
from .pairs import PAIRS

TABLE = {t.name: t for t in (PAIRS, DEDUP, HIER)}

__all__ = ["Transport", "TABLE", "of", "of_results", "count_words", "reduce_back",
           "combine_backward"]


def of(name: str) -> Transport:
    """The transport ``name``."""
    return TABLE[name]


def of_results(res) -> Transport | None:
    """The transport a dispatch's results came through; None for the canonical computation
    (no transport, no wire)."""
    r = res[0]
    return None if r.group.transport is None or r.wire is None else TABLE[r.group.transport]


def reduce_back(res, ys: List[np.ndarray], weighted: bool):
    """The return path through the transport of ``res`` (Transport.reduce_back)."""
    return of_results(res).reduce_back(res, ys, weighted)


def combine_backward(res, grad_outs: List[np.ndarray], ys: List[np.ndarray], weighted: bool):
    """Combine backward through the transport of ``res`` (Transport.combine_backward)."""
    return of_results(res).combine_backward(res, grad_outs, ys, weighted)
