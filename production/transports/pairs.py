"""pairs: a row per kept slot, ``payload | int32 t | int32 k | int32 j | float32 w``, returned
as that slot's row of expert_y (the mirror of ``epkit.reference.transports.pairs``). Carried out
by ``direct.py``; its kernel path is ``csrc/pairs.h`` + ``cpu/pairs.cpp`` and
``triton/pairs.py``."""

from __future__ import annotations

import torch

from epkit.reference import abi

from .base import Transport

__all__ = ["Pairs", "PAIRS"]


class Pairs(Transport):
    name = "pairs"
    module = "direct"
    meta_bytes = abi.PAIRS_META_BYTES
    replans_after_drops = False     # the count words count the kept slots: the rows themselves
    slot_sections = ("recv_counts", "send_counts")  # its one section: every row is a slot
    slot_cap_field = "tok_cap"
    rows_hold_many_slots = False
    returns_units = False           # each slot's row comes back as it is

    def send_map_cols(self, K: int, R: int) -> int:
        """A row per slot."""
        return K

    def recv_map_cols(self, K: int) -> int:
        """A received row is one slot."""
        return 1

    def back_dtype(self, y_dtype: torch.dtype) -> torch.dtype:
        """expert_y's own rows return."""
        return y_dtype

    def chunk_bytes(self, P: int, rows: int, slots: int) -> int:
        """Slot rows of ``P + 16`` bytes (docs/design.md wire format)."""
        return rows * (P + self.meta_bytes)

    def static_rows(self, max_tokens: int, per: int) -> int:
        """A row per slot: ``per = min(K, L)`` a token at most."""
        return max_tokens * per


PAIRS = Pairs()
