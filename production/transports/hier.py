"""hier: node-aware, two stages (the mirror of ``epkit.reference.transports.hier``). Stage 1
sends a token once per destination node over the inter-node group, stage 2 spreads it on the
node; each stage is a dedup exchange, so its rows are dedup's (token rows and slot rows) and
the kernels are dedup's. Carried out by ``epkit.hier`` (its stages moved in Python, over the
two subgroups)."""

from __future__ import annotations

from epkit.reference import abi
from epkit.reference.errors import Reason

from .dedup import Dedup

__all__ = ["Hier", "HIER"]


class Hier(Dedup):
    name = "hier"
    module = "hier"
    stages = 2                  # the inter-node stage, then the intra-node stage
    exchanges = ("auto", "ragged", "padded", "equal")
    quantized = False
    compiles = False            # its stages are autograd Functions, without fake kernels
    # Its facts are dedup's, the rows of both stages (stage 2's token rows carry the source
    # rank too: abi.HIER_TOKEN_META_BYTES, which hier.py sizes them with).

    @property
    def path(self) -> int:
        """Both stages are dedup exchanges: dedup's kernels."""
        return abi.TRANSPORT_CODES["dedup"]

    def option_error(self, L: int, G: int, exchange, payload) -> tuple:
        """dedup's limits, and stage 1's: its slot rows name an expert by its id on the
        destination node (``L * G`` of them, 24 bits)."""
        if L < abi.DEDUP_MAX_LOCAL and L * G >= abi.DEDUP_MAX_LOCAL:
            return Reason.TOO_MANY_LOCAL_EXPERTS, L * G, abi.DEDUP_MAX_LOCAL - 1
        return super().option_error(L, G, exchange, payload)


HIER = Hier()
