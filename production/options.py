"""``epkit.DispatchOptions``: every option of a dispatch in one frozen record.

The Dispatcher resolves its keyword arguments into one once and carries it (``Dispatcher.options``;
the handle's ``config`` is the Dispatcher), and so does ``ExpertParallelMoE``
(``dispatch_options``): the eight options are written here, not repeated through every layer.
Nothing is checked here: a rank that raised alone would leave its peers waiting in their first
collective, so the options are checked, and agreed between ranks, in the call header of every
dispatch (production/agree.py, validate.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

__all__ = ["DispatchOptions", "OPTION_NAMES"]


@dataclass(frozen=True)
class DispatchOptions:
    """The options of :class:`epkit.Dispatcher` (its docstring says what each means).

    ``transport`` and ``exchange`` given as ``None`` take the defaults, ``"dedup"`` and
    ``"auto"``, as in the reference (``epkit.reference.records.resolve_options``)."""

    transport: str = "dedup"
    exchange: str = "auto"
    payload: Optional[str] = None
    align: int = 1
    capacity: Optional[int] = None
    capacity_factor: Optional[float] = None
    max_tokens_per_rank: Optional[int] = None
    ranks_per_node: Optional[int] = None

    def __post_init__(self):
        if self.transport is None:
            object.__setattr__(self, "transport", "dedup")
        if self.exchange is None:
            object.__setattr__(self, "exchange", "auto")

    def replace(self, **changes) -> "DispatchOptions":
        """A copy with ``changes`` (the lazy twin of an exchange, say)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The options as keyword arguments: ``Dispatcher(group, E, **options.as_dict())``."""
        return {f: getattr(self, f) for f in OPTION_NAMES}


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(DispatchOptions))
