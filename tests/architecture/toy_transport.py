"""A toy fourth transport, built from docs/design.md's recipe ("Adding a transport") alone, to
show that the recipe is the whole of it: a code, one module per tier, one row per table.

``toy`` sends the rows pairs sends (a row per kept slot) and runs pairs' kernel path, with
every exchange and payload. Nothing in epkit names it: this module is its every
tier, and :func:`register` adds its rows. Not shipped; ``epkit verify --impl
tests/architecture/toy_transport.py:factory`` runs it through the conformance suite (the module
registers itself on import, in the harness and in each rank's process).
"""

from __future__ import annotations

import os

from epkit.reference import abi
from epkit.reference import transports as reference_transports
from epkit.reference.transports.pairs import Pairs as ReferencePairs

NAME, CODE = "toy", 3  # the next free code of abi.TRANSPORT_CODES


# --- the reference tier: a class behind reference/transports/base.py's Transport -------------
class ReferenceToy(ReferencePairs):
    """The toy's rows are pairs' rows, so its body is pairs': only its name is its own."""

    name = NAME


# --- production: a row behind production/transports/base.py's Transport ----------------------
def _production_row():
    from epkit.transports.pairs import Pairs

    class Toy(Pairs):
        name = NAME

        @property
        def path(self) -> int:
            """Its rows are slot rows: pairs' kernel path (``TOY_PATH``, a planted fault for the
            test that the suite sees a wrong row: another path)."""
            return abi.TRANSPORT_CODES[os.environ.get("TOY_PATH", "pairs")]

    return Toy()


def register() -> None:
    """Add the toy's code and its row to every tier's table (idempotent)."""
    from epkit import transports

    if NAME in abi.TRANSPORT_CODES:
        return
    assert CODE not in abi.TRANSPORT_CODES.values(), f"code {CODE} is taken: pick a free one"
    abi.TRANSPORT_CODES[NAME] = CODE
    reference_transports.TABLE[NAME] = ReferenceToy()
    row = _production_row()
    transports.TABLE[NAME] = row
    transports.TABLE_BY_CODE[CODE] = row


def unregister() -> None:
    """Take the toy's rows out again."""
    from epkit import transports

    for table, key in ((abi.TRANSPORT_CODES, NAME), (reference_transports.TABLE, NAME),
                       (transports.TABLE, NAME), (transports.TABLE_BY_CODE, CODE)):
        table.pop(key, None)


# --- the conformance suite: epkit's own adapter, in the modes the table now lists --------------
register()


def factory(group=None, **options):
    from epkit.verify.adapters import epkit_factory

    return epkit_factory(group, **options)


def _modes():
    from epkit.verify.adapters import epkit_factory, epkit_modes

    factory.capabilities = epkit_factory.capabilities
    return [m for m in epkit_modes() if m.name.split("/")[0] == NAME]


factory.modes = _modes()
