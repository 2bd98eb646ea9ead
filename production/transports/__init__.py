"""The transport table of production: what each transport's rows look like to the ops, one row
per transport, one module each (the mirror of ``epkit.reference.transports``).

    base.py     Transport: the facts every row states (the interface the rest of production asks)
    pairs.py    PAIRS: a row per kept slot
    dedup.py    DEDUP: token rows and slot rows (a token once per destination rank)
    hier.py     HIER: node-aware, two dedup stages (inter-node, then intra-node)

The ops and their fakes ask a row's facts, never its name:

===========  ===========================  ==============  ===================  ===========
transport    send_map [T, cols]           recv_map cols   rows on return path  carried by
===========  ===========================  ==============  ===================  ===========
pairs        K (one row per kept slot)    1               expert_y's dtype     direct.py
dedup        R (one row per destination)  K               float32 partials     direct.py
hier         as dedup, per stage          K               float32 partials     hier.py
===========  ===========================  ==============  ===================  ===========

Adding a transport: a module here with a subclass of :class:`Transport`, its row in ``TABLE``,
its code in reference/abi.py, and its counterpart in the reference (docs/design.md, "Adding a
transport").
"""

from __future__ import annotations

from typing import Optional

from epkit.reference import abi

from .base import Transport
from .dedup import DEDUP
from .hier import HIER
from .pairs import PAIRS

__all__ = ["Transport", "TABLE", "TABLE_BY_CODE", "of", "by_code"]

# The default transport first: the order epkit verify lists its modes in.
TABLE = {t.name: t for t in (DEDUP, PAIRS, HIER)}
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
