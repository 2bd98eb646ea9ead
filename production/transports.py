"""The transport table of production: what each transport's rows look like to the ops, one row
per transport (the mirror of ``epkit.reference.transports``).

A transport decides what rows travel; the ops and their fakes ask its row, never its name:

===========  ===========  ===========================  ==============  ===================
transport    token_rows   send_map [T, cols]           recv_map cols   rows on the return path
===========  ===========  ===========================  ==============  ===================
pairs        no           K (one row per kept slot)    1               expert_y's dtype
dedup        yes          R (one row per destination)  K               float32 partials
hier         yes          (its own module, hier.py; stage 1 and 2 are dedup exchanges)
===========  ===========  ===========================  ==============  ===================

``module`` names the module that carries the transport out behind the two-function interface
``dispatch(dispatcher, seq, x, topk_idx, topk_weights, local, G) -> Dispatch`` and
``combine(dispatcher, expert_y, d, weighted, check) -> out`` (``direct.py`` for the one-stage
transports, ``hier.py`` for the node-aware one; the Dispatcher looks it up, api.py). Codes come
from reference/abi.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from epkit.reference import abi
from epkit.reference.errors import Reason

__all__ = ["Transport", "TABLE", "TABLE_BY_CODE", "of", "by_code"]


@dataclass(frozen=True)
class Transport:
    name: str
    module: str            # the module that carries it out (see the module docstring)
    token_rows: bool       # one row per (token, destination rank) and slot rows; else per slot
    stages: int = 1        # exchanges per direction: hier's inter-node then intra-node stage
    # the exchange options it runs (None: every one) and whether a quantized payload travels
    exchanges: Optional[tuple] = None
    quantized: bool = True

    def runs(self, exchange, payload=None) -> bool:
        """Whether this transport runs ``exchange`` with ``payload``."""
        return ((self.exchanges is None or exchange in self.exchanges)
                and (self.quantized or payload is None))

    @property
    def code(self) -> int:
        return abi.TRANSPORT_CODES[self.name]

    def send_map_cols(self, K: int, R: int) -> int:
        """Columns of ``send_map``: a token's row per destination rank, or per slot."""
        return R if self.token_rows else K

    def recv_map_cols(self, K: int) -> int:
        """Columns of ``recv_map``: a token row's slots, or the one slot of a slot row."""
        return K if self.token_rows else 1

    def back_dtype(self, y_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the rows on the return path: a token row's float32 partial, or expert_y's
        own row."""
        return torch.float32 if self.token_rows else y_dtype

    def chunk_bytes(self, P: int, rows: int, slots: int) -> int:
        """Bytes of one dispatch chunk (docs/design.md wire format): slot rows of ``P + 16``;
        token rows of ``P + 8`` plus slot rows of 8."""
        if not self.token_rows:
            return rows * (P + abi.PAIRS_META_BYTES)
        return rows * (P + abi.DEDUP_TOKEN_META_BYTES) + slots * abi.SLOT_ROW_BYTES

    def option_error(self, L: int, G: int, exchange, payload) -> tuple:
        """What this transport cannot encode or run, for ``L`` local experts and ``G`` ranks per
        node (the options' own checks passed): ``(code, a, b)``."""
        if self.token_rows and L >= abi.DEDUP_MAX_LOCAL:  # a slot row's j: 24 bits
            return Reason.TOO_MANY_LOCAL_EXPERTS, L, abi.DEDUP_MAX_LOCAL - 1
        if self.stages > 1:
            if L * G >= abi.DEDUP_MAX_LOCAL:  # stage 1's j: the expert's id on its node
                return Reason.TOO_MANY_LOCAL_EXPERTS, L * G, abi.DEDUP_MAX_LOCAL - 1
        if not self.runs(exchange, payload):  # a = 1 lazy, 2 static, 3 a quantized payload
            return Reason.HIER_UNSUPPORTED, {"lazy": 1, "static": 2}.get(exchange, 3), 0
        return Reason.OK, 0, 0

    @property
    def replans_after_drops(self) -> bool:
        """Whether a capacity drop changes which rows travel beyond what the count words say: a
        token whose slots to a rank were all dropped sends no token row there (dedup, hier), so
        the count exchange gathers the kept token rows and plans again."""
        return self.token_rows

    def static_rows(self, max_tokens: int, per: int) -> int:
        """A static chunk's data rows in its first section, ``per = min(K, L)`` slots a token at
        most: a row per token (a token row needs a kept slot, so none when K = 0) or per slot."""
        return min(max_tokens, max_tokens * per) if self.token_rows else max_tokens * per

    @property
    def slot_sections(self) -> tuple:
        """The plan sections ``(received, sent)`` counting the rows of the section that carries
        the slots (the weight gradients' return path runs along it): dedup's slot section,
        pairs' first section (each of its rows is a slot)."""
        return ("recv_slots", "send_slots") if self.token_rows else ("recv_counts", "send_counts")

    @property
    def slot_cap_field(self) -> str:
        """The plan field of that section's rows in a fixed chunk (abi.PLAN_FIELDS)."""
        return "slot_cap" if self.token_rows else "tok_cap"

    @property
    def rows_hold_many_slots(self) -> bool:
        """Whether a sent row carries several slots (a token row: its token's kept slots on that
        rank) rather than one."""
        return self.token_rows

    @property
    def returns_units(self) -> bool:
        """Whether the return path sends a token row's units (its ``n`` kept rows or one
        float32 partial, whichever is smaller, cut into units of an ``expert_y`` row: dedup)
        rather than each slot's row as it is (pairs)."""
        return self.token_rows

    @property
    def max_topk(self) -> Optional[int]:
        """The largest top-k its rows encode (a slot row's ``k`` is 8 bits); None: any. The
        group's agreed ``K`` is checked against it after the ranks' agreement (the plan, and the
        header of a static dispatch on the device path), so ``TOPK_TOO_LARGE`` names rank 0."""
        return abi.DEDUP_MAX_TOPK if self.token_rows else None


# The default transport first: the order epkit verify lists its modes in.
TABLE = {t.name: t for t in (Transport("dedup", "direct", token_rows=True),
                             Transport("pairs", "direct", token_rows=False),
                             Transport("hier", "hier", token_rows=True, stages=2,
                                       exchanges=("auto", "ragged", "padded", "equal"),
                                       quantized=False))}
TABLE_BY_CODE = {t.code: t for t in TABLE.values()}
assert set(TABLE) == set(abi.TRANSPORT_CODES), "a transport without a row (or a row without a code)"


def of(name) -> Optional[Transport]:
    """The row of transport ``name``; None for a name that is not one (its error travels)."""
    try:
        return TABLE.get(name)
    except TypeError:
        return None


def by_code(code: int) -> Transport:
    """The row of a transport code (the ops' integer argument)."""
    return TABLE_BY_CODE[int(code)]
