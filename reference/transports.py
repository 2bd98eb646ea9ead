"""The transport table: which module carries each transport out, byte for byte.

A transport decides what rows travel (exchange.py moves them). Each module in the table has
the same three passes, and its own byte accounting (``dispatch_bytes_of`` /
``combine_bytes_of`` on its plan):

    dispatch(group, xs, idx, ws, kept, rank_major) -> R DispatchResult (with their ``wire``)
    reduce_back(res, ys, weighted)                 -> (R float32 [T_s, H] sums, bytes moved)
    combine_backward(res, grad_outs, ys, weighted) -> (grad_ys, grad_ws, bytes moved)

``reduce_back`` serves the combine and, unweighted, the dispatch backward. Adding a transport
is one module with these functions, one entry here, its name in common.TRANSPORTS and its code
in abi.py, and its counterpart in production.
"""

from __future__ import annotations

from types import ModuleType

from . import hier, transport

TABLE = {"pairs": transport, "dedup": transport, "hier": hier}


def of(name: str) -> ModuleType:
    """The module that carries out transport ``name``."""
    return TABLE[name]


def of_results(res) -> ModuleType | None:
    """The module a transport dispatch's results came through; None for the canonical
    computation (no transport, no wire)."""
    r = res[0]
    return None if r.transport is None or r.wire is None else TABLE[r.transport]
