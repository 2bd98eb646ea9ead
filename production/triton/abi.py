"""The ABI (``epkit.reference.abi``) as kernel constants: a kernel reads a plan word, a count
word or a code by one of these names, never by a literal, so the kernels cannot drift from the
ABI the C++ kernels and the reference share (tests/triton/test_kernel_abi.py refuses a literal
word offset or code in a kernel).

Generated from the ABI's tables, each a ``tl.constexpr``:

- ``PLAN_<FIELD>``: the plan's header words (``abi.PLAN_FIELDS``, upper case: ``PLAN_RANKS``,
  ``PLAN_STATIC_CAP``, ...); ``PLAN_HEADER``: where its sections begin (``send_counts``);
- ``WORD_<FIELD>``: a rank's count words (``abi.WORD_FIELDS``: ``WORD_HIDDEN``, ...);
  ``WORD_HEADER``: where its counts begin (tokens per expert, then tokens per rank);
- ``REASON_<NAME>``: the error reasons (``abi.Reason``);
- ``EXCHANGE_<NAME>``, ``VARIANT_<NAME>``, ``TRANSPORT_<NAME>``, ``PAYLOAD_<NAME>``
  (``PAYLOAD_NONE`` for None), ``DTYPE_<NAME>``: the codes;
- ``BLOCK_<PAYLOAD>`` and ``SCALE_BYTES_<PAYLOAD>``: a quantized payload's elements per scale
  and bytes per scale;
- the wire format's numbers: ``SLOT_ROW_BYTES``, ``SLOT_K_SHIFT``, ``PAIRS_META_BYTES``,
  ``DEDUP_TOKEN_META_BYTES``, ``DEDUP_MAX_TOPK``, and the int32 words of a row's metadata by name
  (``PAIRS_META_T`` ... ``PAIRS_META_W``, ``DEDUP_TOKEN_META_T``, ``DEDUP_TOKEN_META_N``).
"""

from __future__ import annotations

from epkit.reference import abi

from ._runtime import tl

__all__: list[str] = []


def _define(name: str, value: int) -> None:
    globals()[name] = tl.constexpr(int(value))
    __all__.append(name)


for _i, _f in enumerate(abi.PLAN_FIELDS):
    _define(f"PLAN_{_f.upper()}", _i)
_define("PLAN_HEADER", abi.PLAN_HEADER)
for _i, _f in enumerate(abi.WORD_FIELDS):
    _define(f"WORD_{_f.upper()}", _i)
_define("WORD_HEADER", abi.WORD_HEADER)
for _r in abi.Reason:
    _define(f"REASON_{_r.name}", _r.value)
for _prefix, _table in (("EXCHANGE", abi.EXCHANGE_CODES), ("VARIANT", abi.VARIANT_CODES),
                        ("TRANSPORT", abi.TRANSPORT_CODES), ("DTYPE", abi.DTYPE_CODES)):
    for _n, _c in _table.items():
        _define(f"{_prefix}_{_n.upper()}", _c)
for _n, _c in abi.PAYLOAD_CODES.items():
    _define(f"PAYLOAD_{(_n or 'none').upper()}", _c)
    if _n is not None:
        _define(f"BLOCK_{_n.upper()}", abi.PAYLOAD_BLOCKS[_n])
        _define(f"SCALE_BYTES_{_n.upper()}", abi.PAYLOAD_SCALE_BYTES[_n])
for _n in ("SLOT_ROW_BYTES", "SLOT_K_SHIFT", "PAIRS_META_BYTES", "DEDUP_TOKEN_META_BYTES",
           "DEDUP_MAX_TOPK"):
    _define(_n, getattr(abi, _n))
for _prefix, _words in (("PAIRS_META", abi.PAIRS_META), ("DEDUP_TOKEN_META", abi.DEDUP_TOKEN_META)):
    for _i, _w in enumerate(_words):
        _define(f"{_prefix}_{_w.upper()}", _i)
