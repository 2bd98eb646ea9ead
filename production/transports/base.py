"""What every transport is to production's Python (the mirror of
``epkit.reference.transports.base``): the facts the ops, their fakes, the count exchange and the
return path ask a transport's row, never its name.

A transport decides what rows travel; its row here describes them. One module a transport
(``pairs.py``, ``dedup.py``, ``hier.py``) subclasses :class:`Transport` and states every fact
below; nothing outside this package tests which transport it is. The body that carries a
transport out is named by ``module`` (``direct.py`` for the one-stage transports, ``hier.py``
for the node-aware one) behind two functions::

    dispatch(dispatcher, seq, x, topk_idx, topk_weights, local, G) -> Dispatch
    combine(dispatcher, expert_y, d, weighted, check) -> out

and its kernels by its ``path`` (the code of the kernel path its rows take, which the ops get:
``csrc/transports.h``'s ``with_transport``, ``triton/transports.py``'s ``PATHS``). Its facts are
those of that path's rows (tests/architecture/test_tables.py). Codes come from reference/abi.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from epkit.reference import abi
from epkit.reference.errors import UNSUPPORTED_CODES, Reason

__all__ = ["Transport"]


class Transport:
    """One transport's row: its facts.

    name, module, stages      its name (abi.TRANSPORT_CODES), the module that carries it out,
                              its exchanges per direction
    path                      the code of the kernel path its rows take (the ops' integer
                              ``transport``: pairs' slot rows or dedup's token rows; a
                              transport whose rows are one of these runs its kernels)
    exchanges, quantized      the exchange options it runs (None: every one), whether a
                              quantized payload travels
    compiles                  whether it runs under torch.compile (its ops have fakes)
    meta_bytes                a first-section row's bytes after the payload
    max_topk, max_local       the largest top-k and local-expert count its rows encode (None:
                              any)
    replans_after_drops       whether a capacity drop changes which rows travel beyond what the
                              count words say (the count exchange gathers the kept rows and
                              plans again)
    slot_sections             the plan sections (received, sent) whose rows carry the slots
    slot_cap_field            the plan field of those rows in a fixed chunk (abi.PLAN_FIELDS)
    rows_hold_many_slots      whether a sent row carries several slots rather than one
    returns_units             whether the return path sends a row's units rather than each
                              slot's row as it is
    send_map_cols(K, R)       columns of ``send_map``
    recv_map_cols(K)          columns of ``recv_map``
    back_dtype(y_dtype)       the dtype of the rows on the return path
    chunk_bytes(P, rows, slots)   bytes of one dispatch chunk
    static_rows(T, per)       a static chunk's rows in its first section
    option_error(L, G, exchange, payload)   what it cannot encode or run
    """

    name: str
    module: str
    stages: int = 1
    exchanges: Optional[tuple] = None
    quantized: bool = True
    compiles: bool = True
    meta_bytes: int
    max_topk: Optional[int] = None
    max_local: Optional[int] = None
    replans_after_drops: bool
    slot_sections: tuple
    slot_cap_field: str
    rows_hold_many_slots: bool
    returns_units: bool

    @property
    def code(self) -> int:
        """Its code: what the call header carries, so that the ranks agree on it."""
        return abi.TRANSPORT_CODES[self.name]

    @property
    def path(self) -> int:
        """The kernel path its rows take: its own code, unless a subclass runs another's."""
        return self.code

    def runs(self, exchange, payload=None) -> bool:
        """Whether this transport runs ``exchange`` with ``payload``."""
        return ((self.exchanges is None or exchange in self.exchanges)
                and (self.quantized or payload is None))

    def send_map_cols(self, K: int, R: int) -> int:
        raise NotImplementedError

    def recv_map_cols(self, K: int) -> int:
        raise NotImplementedError

    def back_dtype(self, y_dtype: torch.dtype) -> torch.dtype:
        raise NotImplementedError

    def chunk_bytes(self, P: int, rows: int, slots: int) -> int:
        raise NotImplementedError

    def static_rows(self, max_tokens: int, per: int) -> int:
        raise NotImplementedError

    def option_error(self, L: int, G: int, exchange, payload) -> tuple:
        """What this transport cannot encode or run, for ``L`` local experts and ``G`` ranks per
        node (the options' own checks passed): ``(code, a, b)``, ``Reason.OK`` if nothing."""
        if self.max_local is not None and L >= self.max_local:
            return Reason.TOO_MANY_LOCAL_EXPERTS, L, self.max_local - 1
        if not self.runs(exchange, payload):  # the exchange it refuses, else the payload
            what = UNSUPPORTED_CODES.get(exchange, UNSUPPORTED_CODES["payload"])
            return Reason.UNSUPPORTED, what, self.code
        return Reason.OK, 0, 0

    def __repr__(self) -> str:
        return f"<transport {self.name}>"
