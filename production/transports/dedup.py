"""dedup: a token travels once per destination rank as a token row ``payload | int32 t | int32
n``, its kept slots there as slot rows ``int32 (k << 24 | j) | float32 w`` in the chunk's slot
section; on the return path a token row comes back as its n rows or its float32 partial,
whichever is smaller (the mirror of ``epkit.reference.transports.dedup``). Carried out by
``direct.py``; its kernel path is ``csrc/dedup.h`` + ``cpu/dedup.cpp`` and ``triton/dedup.py``."""

from __future__ import annotations

import torch

from epkit.reference import abi

from .base import Transport

__all__ = ["Dedup", "DEDUP"]


class Dedup(Transport):
    name = "dedup"
    module = "direct"
    meta_bytes = abi.DEDUP_TOKEN_META_BYTES
    max_topk = abi.DEDUP_MAX_TOPK     # a slot row's k: 8 bits (checked on the agreed K, after
    #                                   the ranks' agreement, so TOPK_TOO_LARGE names rank 0)
    max_local = abi.DEDUP_MAX_LOCAL   # a slot row's j: 24 bits
    # a token whose slots to a rank were all dropped sends no token row there: the count
    # exchange gathers the kept token rows and plans again
    replans_after_drops = True
    slot_sections = ("recv_slots", "send_slots")  # the slot section of every chunk
    slot_cap_field = "slot_cap"
    rows_hold_many_slots = True       # a token row: its token's kept slots on that rank
    returns_units = True              # a token row's n rows or its float32 partial, in units

    def send_map_cols(self, K: int, R: int) -> int:
        """A token's row per destination rank."""
        return R

    def recv_map_cols(self, K: int) -> int:
        """A received token row's slots."""
        return K

    def back_dtype(self, y_dtype: torch.dtype) -> torch.dtype:
        """Rows of 4H bytes: a token row's float32 partial (or its raw rows, in units)."""
        return torch.float32

    def chunk_bytes(self, P: int, rows: int, slots: int) -> int:
        """Token rows of ``P + 8`` bytes, then slot rows of 8 (docs/design.md wire format)."""
        return rows * (P + self.meta_bytes) + slots * abi.SLOT_ROW_BYTES

    def static_rows(self, max_tokens: int, per: int) -> int:
        """A row per token, none when K = 0 (a token row needs a kept slot)."""
        return min(max_tokens, max_tokens * per)


DEDUP = Dedup()
