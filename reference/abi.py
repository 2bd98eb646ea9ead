"""The interface between Python and the C++ / CUDA kernels, defined once: every name and code
table of epkit lives here, so that nothing types one twice (a second copy could drift).

Everything both sides must agree on: the reason codes (``Reason``; errors.py formats their
messages), the dtype codes, the option codes (transports, exchanges, payloads), the count-word
and plan layouts, the wire format's row layouts and limits. This module is the leaf of the
reference: it imports nothing of epkit. Python imports these names; the kernels include
``production/csrc/abi.h``, which :func:`render_header` generates from this module
(production/_build.py rewrites it before a build when it differs; tests/reference/test_abi.py
fails if the checked-in copy drifts, or if a kernel source types one of these numbers by hand).
"""

from __future__ import annotations

import enum


# ---- reasons: why an input is bad (errors.py formats the messages) --------------------------
class Reason(enum.IntEnum):
    """Why an input is bad. Values are part of the wire format: never renumber."""

    OK = 0
    INDEX_OUT_OF_RANGE = 1     # a: the value, b: num_experts
    DUPLICATE_EXPERT = 2       # a: row, b: expert
    INDEX_DTYPE = 3            # a: dtype code
    X_NOT_2D = 4               # a: ndim
    IDX_SHAPE = 5              # a: topk_idx rows, b: x rows
    WEIGHTS_SHAPE = 6          # a: weights rows, b: weights cols
    HIDDEN_MISMATCH = 7        # a: this rank's H, b: rank 0's H
    DTYPE_MISMATCH = 8         # a: this rank's dtype code, b: rank 0's
    TOPK_MISMATCH = 9          # a: this rank's K, b: rank 0's K
    EXPERTS_NOT_DIVISIBLE = 10  # a: num_experts, b: group size
    ALIGN = 11                 # a: align
    CAPACITY = 12              # a: capacity
    NONFINITE_WEIGHT = 13      # a: row
    NONFINITE_PAYLOAD = 14     # a: row, b: payload code (errors.option_names)
    HIDDEN_NOT_MULT32 = 15     # a: H, b: payload code (the name is historical: H % block)
    EXPERT_Y_ROWS = 16         # a: expert_y rows, b: dispatch rows
    EXPERT_Y_HIDDEN = 17       # a: expert_y H, b: dispatch H
    X_DTYPE = 18               # a: dtype code
    WEIGHTS_DTYPE = 19         # a: dtype code
    STATIC_OVERFLOW = 20       # a: tokens, b: max_tokens_per_rank
    EQUAL_NONUNIFORM = 21      # (no details)
    NUM_EXPERTS = 22           # a: num_experts
    EXPERT_Y_DTYPE = 23        # a: dtype code
    OPTION = 24                # a: option id (errors._OPTIONS), b: value id
    IDX_NOT_2D = 25            # a: ndim
    WEIGHTS_NOT_2D = 26        # a: ndim
    GRAD_ROWS = 27             # a: gradient rows, b: expected rows
    GRAD_HIDDEN = 28           # a: gradient H, b: expected H
    GRAD_DTYPE = 29            # a: dtype code
    STATIC_MAX = 30            # a: max_tokens_per_rank (-1 when missing)
    ROWS_DTYPE_MISMATCH = 31   # a: this rank's expert_y / gradient dtype code, b: rank 0's
    TOPK_TOO_LARGE = 32        # a: K, b: the dedup transport's limit (255)
    # Production only (a multi-process group can disagree; the reference's one call cannot).
    # They come from the call header every rank agrees on first (production/agree.py).
    NOT_A_TENSOR = 33          # a: argument id (errors.ARGUMENTS)
    DEVICE = 34                # a: argument id, b: device code (errors.DEVICES)
    CALL_MISMATCH = 35         # a: this rank's operation (errors.OPERATIONS), b: rank 0's
    CALL_SEQUENCE = 36         # a: this rank's call number on the group, b: rank 0's
    NUM_EXPERTS_MISMATCH = 37  # a: this rank's value, b: rank 0's
    ALIGN_MISMATCH = 38        # a, b: as above
    CAPACITY_MISMATCH = 39     # a, b: as above (-1: None)
    TRANSPORT_MISMATCH = 40    # a, b: option codes (errors.option_names)
    EXCHANGE_MISMATCH = 41     # a, b: option codes
    PAYLOAD_MISMATCH = 42      # a, b: option codes
    MAX_TOKENS_MISMATCH = 43   # a, b: values (-1: None)
    DISPATCH_MISMATCH = 44     # a: call number of the dispatch this rank combines, b: rank 0's
    FOREIGN_DISPATCH = 45      # a: why (errors.FOREIGN), b: detail
    TOO_MANY_LOCAL_EXPERTS = 46  # a: experts per rank, b: the dedup limit (2**24 - 1)
    SEND_COUNTS = 47           # a: entries, b: group size (epkit.exchange)
    SEND_COUNTS_SUM = 48       # a: x rows, b: the sum of send_counts
    SEND_COUNTS_NEGATIVE = 49  # a: the count
    ROW_WIDTH_MISMATCH = 50    # a: elements per row on this rank, b: rank 0's
    CAPACITY_FACTOR = 51       # a: the factor's float64 bits (-1: not a number)
    CAPACITY_AND_FACTOR = 52   # (no details)
    CAPACITY_FACTOR_MISMATCH = 53  # a, b: float64 bits (-1: None)
    CALL_FLAGS_MISMATCH = 54   # a: this rank's call flags (errors.CALL_FLAGS), b: rank 0's
    BAD_ARGUMENT = 55          # a: argument id (ARGUMENTS; 0: an option) that raised when read
    BAD_GROUP = 56             # (no details)
    RANKS_PER_NODE = 57        # a: ranks_per_node, b: group size
    RANKS_PER_NODE_MISMATCH = 58  # a: this rank's ranks_per_node, b: rank 0's (production only)
    UNSUPPORTED = 59           # a: what (errors.UNSUPPORTED_WHAT), b: transport (production only)

# ---- dtypes ------------------------------------------------------------------------------------
# dtype codes carried as integers in the count-exchange header (torch and NumPy names alike).
DTYPE_CODES = {
    "float32": 1, "bfloat16": 2, "float16": 3, "float64": 4,
    "int8": 5, "int16": 6, "int32": 7, "int64": 8, "uint8": 9, "bool": 10,
    "float8_e4m3fn": 11, "uint16": 12, "uint32": 13, "uint64": 14, "float8_e5m2": 15,
    "complex64": 16, "complex128": 17, "float8_e8m0fnu": 18,
}


# ---- options -------------------------------------------------------------------------------
TRANSPORT_CODES = {"pairs": 0, "dedup": 1, "hier": 2}
# The exchange a caller asks for, and the variant that runs (the plan's VARIANT word).
EXCHANGE_CODES = {"ragged": 0, "padded": 1, "equal": 2, "auto": 3, "lazy": 4, "static": 5}
VARIANT_CODES = {"ragged": 0, "padded": 1, "equal": 2, "static": 3}
PAYLOAD_CODES = {None: 0, "mxfp8": 1, "fp8_block128": 2}

# ---- the count words: one row per rank after the all-gather -----------------------------------
# [WORD_HEADER fields | tokens_per_expert (E) | tokens_per_rank (R)]
WORD_FIELDS = ("error_code", "error_a", "error_b", "tokens", "hidden", "topk", "x_dtype",
               "payload")
WORD_HEADER = len(WORD_FIELDS)
# ``prepare``'s pre_error argument: the local error Python found, and what the kernel needs
# beside the tensors (max_tokens: -1 unless the exchange is static).
PRE_ERROR_FIELDS = ("code", "a", "b", "x_dtype", "max_tokens")

# ---- the plan: an int64 vector, identical on every rank up to its rank-local parts --------------
PLAN_FIELDS = (
    "err_code", "err_a", "err_b", "err_rank",
    "send_rows", "recv_rows", "expert_rows", "uniform", "max_chunk",
    "ranks", "local_experts", "experts", "transport", "capacity", "align", "topk",
    "static_cap",       # rows per chunk of the static exchange (-1: not static)
    "variant",          # the exchange that runs (VARIANT_CODES)
    "payload_bytes",    # P: bytes of one token's payload
    "tok_cap",          # fixed-layout chunks: rows of the token (pairs: slot) section
    "slot_cap",         # ... rows of the dedup slot section (-1 when ragged)
    "send_bytes", "recv_bytes",  # the dispatch exchange, in bytes
    "nonuniform_rank",  # lowest source rank with a count unlike rank 0's first (-1: uniform)
    "dropped_any",      # 1: capacity dropped a slot somewhere in the group (dedup: the count
                        # exchange gathers the token rows once more and plans again); -1 in
                        # production's routing-free template mirror: "maybe" (a capacity is set)
    "ranks_per_node",   # G: the nodes of the combine's summation order (arith.py); written by
                        # epkit.count_exchange, 0 read as 1
)
PLAN_HEADER = len(PLAN_FIELDS)
def plan_sections(R: int, E: int) -> tuple:
    """The sections after the plan's header, in order, with their lengths (``L = E / R``)."""
    L = E // R
    return (("send_counts", R), ("recv_counts", R), ("tokens_per_expert", L), ("dropped", L),
            ("offsets", L + 1), ("recv_kept", R * L), ("own_kept", E), ("send_bytes", R),
            ("recv_bytes", R), ("send_slots", R), ("recv_slots", R))


def plan_slices(R: int, E: int) -> dict[str, slice]:
    """Where each section of the plan lies, for ``R`` ranks and ``E`` experts."""
    at, out = PLAN_HEADER, {}
    for name, n in plan_sections(R, E):
        out[name] = slice(at, at + n)
        at += n
    return out


def plan_size(R: int, E: int) -> int:
    return plan_slices(R, E)["recv_slots"].stop


# ---- wire format (docs/design.md) -----------------------------------------------------------
PAIRS_META = ("t", "k", "j", "w")  # int32 t, int32 k, int32 j, float32 w after the payload
PAIRS_META_BYTES = 4 * len(PAIRS_META)
DEDUP_TOKEN_META = ("t", "n")      # int32 t, int32 n (kept slots on this rank) after the payload
DEDUP_TOKEN_META_BYTES = 4 * len(DEDUP_TOKEN_META)
SLOT_ROW_BYTES = 8                 # int32 (k << 24 | j), float32 w
# hier: its inter-node rows are dedup's token and slot rows (the slot's
# j the expert's id on the node); its intra-node token rows name the source rank too
HIER_TOKEN_META = ("s", "t", "n")  # int32 s, int32 t, int32 n (kept slots on this rank)
HIER_TOKEN_META_BYTES = 4 * len(HIER_TOKEN_META)
SLOT_K_SHIFT = 24                  # k: the top 8 bits (decoded unsigned), j: the low 24
DEDUP_MAX_TOPK = 255               # k < 2**8 (the spec's limit: K <= 255)
DEDUP_MAX_LOCAL = 1 << SLOT_K_SHIFT  # j < 2**24

# ---- payloads (reference/payloads.py is the table; these are its numbers) ---------------------
# A quantized payload's row on the wire: H E4M3 bytes, then H / block scales of
# PAYLOAD_SCALE_BYTES bytes each (little-endian). None: H * itemsize(x) bytes of x itself.
PAYLOAD_BLOCKS = {None: 0, "mxfp8": 32, "fp8_block128": 128}     # elements per scale along H
PAYLOAD_SCALE_BYTES = {None: 0, "mxfp8": 1, "fp8_block128": 4}   # E8M0 code, float32
MXFP8_BLOCK = PAYLOAD_BLOCKS["mxfp8"]
FP8_BLOCK128_BLOCK = PAYLOAD_BLOCKS["fp8_block128"]


# the payload codes as an error text names them: "0 (none), 1 (mxfp8), 2 (fp8_block128)"
PAYLOAD_CHOICES = ", ".join(f"{c} ({p or 'none'})"
                            for p, c in sorted(PAYLOAD_CODES.items(), key=lambda item: item[1]))


class PayloadCodes:
    """What every tier's payload table row derives from its ``name`` alone (the reference's rows,
    reference/payloads.py, and epkit.payloads' share it): its code, its block, and the check of
    ``H`` that needs nothing but the block."""

    name: object  # the payload= value: None or a name of PAYLOAD_CODES

    @property
    def code(self) -> int:
        """The ABI code (PAYLOAD_CODES): the count words' and the call header's."""
        return PAYLOAD_CODES[self.name]

    @property
    def block(self) -> int:
        """Elements per scale along H (0: rows of x itself)."""
        return PAYLOAD_BLOCKS[self.name]

    @property
    def quantized(self) -> bool:
        return self.block > 0

    def hidden_triple(self, hidden: int) -> tuple:
        """``H % block == 0`` (reference/validate.py, check 7): else HIDDEN_NOT_MULT32 (a: H, b:
        the payload's code)."""
        if self.quantized and hidden % self.block:
            return (Reason.HIDDEN_NOT_MULT32, int(hidden), self.code)
        return (Reason.OK, 0, 0)


def payload_bytes(hidden: int, itemsize: int, payload=None) -> int:
    """Bytes of one token's payload on the wire: ``H * itemsize(x)`` for ``payload=None``, else
    ``H`` E4M3 bytes followed by ``H / block`` scales (``H + scale_bytes * H / block``)."""
    block = PAYLOAD_BLOCKS[payload]
    if not block:
        return hidden * itemsize
    return hidden + PAYLOAD_SCALE_BYTES[payload] * (hidden // block)


# C++ spellings that are not the plain CamelCase of the Python name (kept from the kernels).
_CPP_NAMES = {"topk": "TopK", "nonuniform_rank": "NonUniformRank"}


def _camel(name: str) -> str:
    return _CPP_NAMES.get(name) or "".join(p.capitalize() for p in name.split("_"))


def _enum(name: str, prefix: str, items) -> list[str]:
    body = ", ".join(f"k{prefix}{_camel(k)} = {v}" for k, v in items)
    return [f"enum {name} : int64_t {{ {body} }};"]


def render_header() -> str:
    """``production/csrc/abi.h``: the C++ form of this module (names as the kernels use them)."""
    out = ["// Generated from reference/abi.py (render_header) by production/_build.py: do not",
           "// edit by hand. The interface between Python and the kernels; tests/reference/",
           "// test_abi.py fails if this file drifts from reference/abi.py.",
           "#pragma once", "", "#include <cstdint>", "", "namespace epkit {", ""]
    out.append("// reasons (reference/errors.py Reason): reason::kIndexOutOfRange, ...")
    out.append("namespace reason {")
    out += [f"constexpr int64_t k{_camel(r.name.lower())} = {int(r)};" for r in Reason]
    out += ["}  // namespace reason", "", "// dtype codes (reference/errors.py DTYPE_CODES)",
            "namespace dtype_code {"]
    out += [f"constexpr int64_t k{_camel(k)} = {v};" for k, v in DTYPE_CODES.items()]
    out += ["}  // namespace dtype_code", "", "// options"]
    out += [f"constexpr int64_t k{_camel(k)} = {v};" for k, v in TRANSPORT_CODES.items()]
    out += _enum("Requested", "Req", EXCHANGE_CODES.items())  # what the caller asked for
    out += _enum("Variant", "", VARIANT_CODES.items())        # the exchange that runs
    out += [f"constexpr int64_t kPayload{_camel(str(k) if k else 'none')} = {v};"
            for k, v in PAYLOAD_CODES.items()]
    out += [f"constexpr int64_t kPayloadCount = {len(PAYLOAD_CODES)};"]
    # the payload table by code, so that a kernel asks a row instead of naming payloads
    payloads = sorted(PAYLOAD_CODES, key=PAYLOAD_CODES.get)
    out += ["constexpr int64_t kPayloadBlocks[kPayloadCount] = {"
            + ", ".join(str(PAYLOAD_BLOCKS[p]) for p in payloads) + "};",
            "constexpr int64_t kPayloadScaleBytes[kPayloadCount] = {"
            + ", ".join(str(PAYLOAD_SCALE_BYTES[p]) for p in payloads) + "};",
            f'constexpr const char* kPayloadChoices = "{PAYLOAD_CHOICES}";']
    out += ["", "// count words: [header | tokens_per_expert (E) | tokens_per_rank (R)]"]
    out += _enum("WordField", "Word", ((f, i) for i, f in enumerate(WORD_FIELDS)))
    out += [f"constexpr int64_t kWordHeader = {WORD_HEADER};", "",
            "// prepare's pre_error argument"]
    out += _enum("PreErrorField", "PreError", ((f, i) for i, f in enumerate(PRE_ERROR_FIELDS)))
    out += ["",
            "// plan header words, then the sections (PlanOffsets in epkit.h)"]
    out += _enum("PlanHeader", "", [(f, i) for i, f in enumerate(PLAN_FIELDS)]
                 + [("plan_header", PLAN_HEADER)])
    out += ["", "// wire format: byte offsets of the metadata after a row's payload, row sizes"]
    out += [f"constexpr int64_t kPairsMeta{_camel(f)} = {4 * i};" for i, f in enumerate(PAIRS_META)]
    out += [f"constexpr int64_t kDedupMeta{_camel(f)} = {4 * i};"
            for i, f in enumerate(DEDUP_TOKEN_META)]
    out += [f"constexpr int64_t kPairsMetaBytes = {PAIRS_META_BYTES};",
            f"constexpr int64_t kDedupTokMeta = {DEDUP_TOKEN_META_BYTES};",
            f"constexpr int64_t kSlotRowBytes = {SLOT_ROW_BYTES};",
            f"constexpr int64_t kSlotKShift = {SLOT_K_SHIFT};",
            f"constexpr int64_t kDedupMaxTopK = {DEDUP_MAX_TOPK};",
            f"constexpr int64_t kDedupMaxLocal = {DEDUP_MAX_LOCAL};",
            "", "// payloads: elements per scale along H, bytes per scale (0: no scale)"]
    for name in PAYLOAD_CODES:
        if PAYLOAD_BLOCKS[name]:
            out += [f"constexpr int64_t k{_camel(name)}Block = {PAYLOAD_BLOCKS[name]};",
                    f"constexpr int64_t k{_camel(name)}ScaleBytes = {PAYLOAD_SCALE_BYTES[name]};"]
    out += ["", "}  // namespace epkit", ""]
    return "\n".join(out)
