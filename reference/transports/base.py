"""What every transport is: the interface (``Transport``), and the byte rows they all write.

A transport decides what rows travel; an exchange variant (exchange.py) moves them. Every row
is raw bytes (little-endian), as docs/design.md's wire format says; a token's payload (``P``
bytes: x's row, or its quantized row and scales, payloads.py) opens every token row.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from ..records import Group


class Transport:
    """One transport, carried out for real on the whole group (per-rank lists), byte for byte.

    Every transport has these operations; the return path of combine and of the dispatch backward
    is one (``reduce_back``):

        wire_plan(group, idx, kept)                    the plan: every count every rank derives
                                                       before anything moves (the count exchange)
        dispatch_bytes_of(group, plan)                 the dispatch's bytes, without moving
        combine_bytes_of(group, plan)                  the combine's bytes, without moving
        dispatch(group, xs, idx, ws, kept, rank_major) -> R DispatchResult (with their ``wire``):
                                                       send, exchange, receive
        reduce_back(res, ys, weighted)                 -> (R float32 [T_s, H] sums, bytes moved):
                                                       the combine and, unweighted, the
                                                       dispatch backward
        combine_backward(res, grad_outs, ys, weighted) -> (grad_ys, grad_ws, bytes moved): the
                                                       gradient rows out, the weight gradients back

    ``accounting``: the one-stage transport whose accounting ``dispatch_bytes`` /
    ``combine_bytes`` (accounting.py) give for this one (its own for pairs and dedup).

    Adding a transport: a module with a subclass, its row in transports.TABLE, its code in
    abi.TRANSPORT_CODES, and its counterpart in production.
    """

    name: str

    @property
    def accounting(self) -> "Transport":
        return self

    def wire_plan(self, group: Group, idx, kept, words=None):
        raise NotImplementedError

    def dispatch_bytes_of(self, group: Group, p):
        raise NotImplementedError

    def combine_bytes_of(self, group: Group, p):
        raise NotImplementedError

    def dispatch(self, group: Group, xs, idx, ws, kept, rank_major: bool):
        raise NotImplementedError

    def reduce_back(self, res, ys: List[np.ndarray], weighted: bool):
        raise NotImplementedError

    def combine_backward(self, res, grad_outs: List[np.ndarray], ys: List[np.ndarray],
                         weighted: bool):
        raise NotImplementedError


# --- byte rows -----------------------------------------------------------------------------------

def as_rows(rows: List[bytes], row_bytes: int) -> np.ndarray:
    """A list of equal-length byte strings -> uint8 [n, row_bytes]."""
    return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), row_bytes).copy()


def rows_of(arr: np.ndarray) -> np.ndarray:
    """[n, ...] -> uint8 [n, bytes per row]."""
    arr = np.ascontiguousarray(arr)
    width = int(np.prod(arr.shape[1:], dtype=np.int64))
    return arr.reshape(arr.shape[0], width).view(np.uint8).reshape(arr.shape[0], width * arr.itemsize)


def payload(group: Group, rows, scales, t: int) -> bytes:
    """Token t's payload bytes (encoded at the source: payloads.wire_rows)."""
    return group.payload_of.to_bytes(rows[t], None if scales is None else scales[t])


def unpayload(group: Group, row: np.ndarray):
    """A token row's payload bytes -> (x row [H], its scales [H/block] or None)."""
    return group.payload_of.from_bytes(row[:group.payload_bytes], group.hidden, group.x_dtype)


def chunk_bounds(counts) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each source's rows in a concatenation with these counts."""
    start = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(int(start[i]), int(start[i + 1])) for i in range(len(counts))]
