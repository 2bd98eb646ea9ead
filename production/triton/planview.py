"""The plan as a row pass reads it: the device plan (the kernels read its routing-dependent
words themselves) and the host words the pass sizes its launches from (the op's ``plan_host``:
on the device path the mirror count_exchange made). Shared by pack's index pass (pack.Slots) and
unpack's row space (unpack.RowSpace)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import plan as W

__all__ = ["PlanView"]


@dataclass(frozen=True)
class PlanView:
    tensor: torch.Tensor   # [n] int64, the device plan
    sections: dict         # its sections by name (abi.plan_slices): section -> slice
    ranks: int             # R
    experts: int           # E
    local_experts: int     # L = E / R
    static_cap: int        # rows of a static chunk's section, -1: not the static exchange
    token_cap: int         # first-section rows of a fixed chunk, -1: ragged
    slot_cap: int          # slot-section rows of a fixed chunk, -1: ragged (or no slot section)

    @classmethod
    def of(cls, plan: torch.Tensor, p: list) -> "PlanView":
        """From the device plan and its host words ``p`` (a list)."""
        R, E = p[W.RANKS], p[W.EXPERTS]
        return cls(plan, W.plan_slices(R, E), R, E, p[W.LOCAL_EXPERTS], p[W.STATIC_CAP],
                   p[W.TOK_CAP], p[W.SLOT_CAP])

    @property
    def header_rows(self) -> int:
        """1 when each section opens with its header row (the static exchange), else 0."""
        return 1 if self.static_cap >= 0 else 0

    def start(self, section: str) -> int:
        """Where ``section`` begins in the plan (a kernel argument)."""
        return self.sections[section].start
