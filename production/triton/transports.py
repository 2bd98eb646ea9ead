"""The transport paths of the Triton kernels: the table from a transport code to the module that
holds what its path does differently, and ``path_of``, the one place a code is checked and
resolved.

The kernels split by transport path as DeepEP splits its kernels into intranode and internode
ones: ``pairs.py`` (a row per kept slot) and ``dedup.py`` (token rows and slot rows). The ops
keep their schema's integer ``transport`` (shared with the C++ kernels and the fakes); each op
resolves it once, where checks.h checks the code (so the errors keep checks.h's order), and
asks the path afterwards, never the code. Every path module has the same names:

- the wire format: ``NAME``, ``CODE``, ``META_BYTES`` (a first-section row's bytes after the
  payload), ``TOKEN_ROWS`` (a row per (token, destination) rather than per slot),
  ``SLOT_SECTIONS`` (slot sections per chunk), ``ROW_SLOT`` (a first-section row's metadata
  is its one slot, which unpack's row space launch places), ``MAX_TOPK``, ``MAX_LOCAL`` (what a row can
  encode), ``send_map_cols(K, R)``, ``recv_map_cols(K)``, ``back_dtype(y_dtype)``,
  ``units_per_row(itemsize)``;
- the argument checks where checks.h asks the transport: ``check_pack_topk``,
  ``check_local_experts``, ``check_gather``, ``check_units``, ``check_first``, ``check_back``,
  and the texts ``SEND_MAP``, ``UNMATCHED_SLOT``;
- pack: ``pack_rows(ix)`` (send_map and what the first section's row writer takes),
  ``pack_slots(ix)`` (the slot section);
- unpack: ``unpack_slots(rs)`` (each received slot's expert row, and its launches' status
  words);
- combine and the backward passes: ``unit_map`` (the expert side's units), ``slot_rows``,
  ``bad_rows``, ``reduce_units`` (the source side's steps), ``slot_places``,
  ``send_map_entry``.

Adding a transport path is one module with these names and its row here.
"""

from __future__ import annotations

from epkit.reference import abi

from . import dedup, pairs
from .wirechecks import check_transport

__all__ = ["PATHS", "INTERFACE", "path_of"]

# The names above, what every path module defines (the ops ask nothing else of a path).
INTERFACE = (
    "NAME", "CODE", "META_BYTES", "TOKEN_ROWS", "SLOT_SECTIONS", "ROW_SLOT", "MAX_TOPK",
    "MAX_LOCAL",
    "SEND_MAP", "UNMATCHED_SLOT", "send_map_cols", "recv_map_cols", "back_dtype",
    "units_per_row", "check_pack_topk", "check_local_experts", "check_gather", "check_units",
    "check_first", "check_back", "pack_rows", "pack_slots", "unpack_slots", "unit_map",
    "slot_rows", "bad_rows", "reduce_units", "slot_places", "send_map_entry",
)
PATHS = {abi.TRANSPORT_CODES["pairs"]: pairs, abi.TRANSPORT_CODES["dedup"]: dedup}
assert all(hasattr(path, name) for path in PATHS.values() for name in INTERFACE), \
    "a path module without a name of the interface"
def path_of(op: str, transport: int):
    """The path module of ``transport``; raises checks.h check_transport's error for a code
    that names none (wirechecks.check_transport: the transports whose rows are a kernel path)."""
    check_transport(op, transport)
    return PATHS[transport]
