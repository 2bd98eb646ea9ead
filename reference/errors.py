"""Input errors: one class, and the message of every reason, shared by the reference and
production.

Every bad-input check in epkit yields an ``(code, a, b)`` triple: a reason code from
``abi.Reason`` and two integer details. Production ships the triple inside the count exchange, so
every rank formats the *same* message for the *same* offending rank (the lowest one that is
bad); the reference raises exactly that message. Keeping the messages here (pure Python, no
torch) is what lets the two raise identical errors. The codes themselves (``Reason``, the dtype
and option codes) are abi.py's; this module only names and formats them.
"""

from __future__ import annotations

import struct

from .abi import (DTYPE_CODES, EXCHANGE_CODES, PAYLOAD_BLOCKS, PAYLOAD_CODES, TRANSPORT_CODES,
                  Reason)

__all__ = ["InputError", "Reason", "DTYPE_CODES", "dtype_name", "format_reason"]


class InputError(ValueError):
    """Bad input to a collective epkit operation.

    Raised on *every* rank of the group with the same message, before any token moves.

    Attributes:
        rank: the offending rank (the lowest one if several are bad).
        code: a :class:`Reason`.
        reason: the human-readable reason, without the rank prefix.
    """

    def __init__(self, rank: int, code: "Reason", reason: str):
        self.rank = int(rank)
        self.code = Reason(code)
        self.reason = reason
        super().__init__(f"epkit: rank {self.rank}: {reason}")

    def __reduce__(self):  # picklable across worker processes
        return (InputError, (self.rank, int(self.code), self.reason))


_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
_FLOAT_NAMES = ("float32", "bfloat16", "float16", "float64")
# Floating ids are nearly always a top-k's outputs taken in the wrong order (torch.topk gives
# the values first).
SWAPPED_TOPK = (" (swapped? torch.topk returns (values, indices): "
                "topk_weights, topk_idx = scores.topk(K))")


def dtype_name(code: int) -> str:
    return _DTYPE_NAMES.get(int(code), "an unsupported dtype")


_OPTIONS = {1: "transport", 2: "exchange", 3: "payload"}
ARGUMENTS = {1: "x", 2: "topk_idx", 3: "topk_weights", 4: "expert_y", 5: "dispatch",
             6: "send_counts", 7: "weighted", 8: "variant"}
DEVICES = {0: "cpu", 1: "cuda", 2: "meta", 3: "another"}
OPERATIONS = {0: "a collective that is not an epkit call", 1: "epkit.dispatch",
              2: "epkit.combine", 3: "epkit.exchange", 4: "the backward of epkit.dispatch",
              5: "the backward of epkit.combine"}
# Option codes as they travel in the call header (production/agree.py): abi.py's tables, read
# at each use (a transport added to TRANSPORT_CODES is named at once); -1: not a valid name.
_OPTION_CODES = {"transport": TRANSPORT_CODES, "exchange": EXCHANGE_CODES,
                 "payload": PAYLOAD_CODES}


def option_names(kind: str) -> dict:
    """code -> name of the option ``kind`` ("transport", "exchange", "payload"; {} for another)."""
    return {code: str(name) for name, code in _OPTION_CODES.get(kind, {}).items()}

# What a production transport may refuse (UNSUPPORTED's a, by what the caller asked for; b
# names the transport).
UNSUPPORTED_CODES = {"lazy": 1, "static": 2, "payload": 3, "torch.compile": 4}
UNSUPPORTED_WHAT = {1: "exchange='lazy'", 2: "exchange='static'", 3: "a payload",
                    4: "torch.compile"}
UNSUPPORTED_HINT = {4: "run it eagerly, or use another transport"}
FOREIGN = {1: "was made on another process group than this Dispatcher's",
           2: "is not an epkit.Dispatch",
           3: "was altered after dispatch (a field no longer matches what dispatch returned)",
           4: "is a PendingDispatch: call its wait() first"}
# Bounds of the integer options (beyond them the plan's int64 arithmetic or a kernel's int32
# row indices would overflow): num_experts, capacity, max_tokens_per_rank.
MAX_EXPERTS = (1 << 31) - 1
MAX_CAPACITY = 1 << 62
MAX_TOKENS = (1 << 31) - 1
# Call flags (production/agree.py): how a call's ranks must agree beyond its options.
CALL_FLAGS = {1: ("a weighted combine", "an unweighted combine")}
MAX_ALIGN = 1 << 20  # beyond it the padding alone would be an absurd allocation


def factor_bits(f) -> int:
    """A capacity factor as it travels in the call header: its float64 bits (-1: None)."""
    return -1 if f is None else struct.unpack("<q", struct.pack("<d", float(f)))[0]


def _factor(bits: int) -> str:
    return "None" if bits == -1 else repr(struct.unpack("<d", struct.pack("<q", int(bits)))[0])


def _flags(bits: int, other: int) -> str:
    """The call flags in which ``bits`` and ``other`` differ, as words."""
    diff = int(bits) ^ int(other)
    return ", ".join(CALL_FLAGS[f][0 if bits & f else 1] for f in sorted(CALL_FLAGS) if diff & f)


def _payload(code: int) -> tuple:
    """A payload code's name and block (0: unknown) for the payload checks' texts."""
    name = option_names("payload").get(int(code), "")
    block = PAYLOAD_BLOCKS.get(name, 0)
    return (name, block) if block else ("", 0)


def _hidden_text(hidden: int, code: int) -> str:
    name, block = _payload(code)
    if not block:
        return f"hidden size {hidden} is not a multiple of the payload's block"
    return f"payload {name} needs hidden % {block} == 0: hidden size {hidden} is not a multiple of {block}"


def _opt(kind: str, code: int) -> str:
    return repr(option_names(kind).get(int(code), "an unknown name"))


def format_reason(code: int, a: int = 0, b: int = 0) -> str:
    """The message for a reason code and its two details (identical on every rank). One
    entry per reason: a table, not logic, hence its length."""
    c = Reason(code)
    return {
        Reason.OK: "no error",
        Reason.INDEX_OUT_OF_RANGE: f"topk_idx holds expert {a}, outside [-1, {b})",
        Reason.DUPLICATE_EXPERT: f"topk_idx row {a} names expert {b} twice",
        Reason.INDEX_DTYPE: f"topk_idx must have an integer dtype, got {dtype_name(a)}"
                            + (SWAPPED_TOPK if dtype_name(a) in _FLOAT_NAMES else ""),
        Reason.X_NOT_2D: f"x must be 2-D [T, H], got {a} dimensions",
        Reason.IDX_SHAPE: f"topk_idx has {a} rows but x has {b}",
        Reason.WEIGHTS_SHAPE: f"topk_weights has shape [{a}, {b}], which differs from topk_idx",
        Reason.HIDDEN_MISMATCH: f"hidden size {a} differs from rank 0's {b}",
        Reason.DTYPE_MISMATCH: f"x dtype {dtype_name(a)} differs from rank 0's {dtype_name(b)}",
        Reason.TOPK_MISMATCH: f"top-k {a} differs from rank 0's {b}",
        Reason.EXPERTS_NOT_DIVISIBLE: f"num_experts {a} is not a multiple of the group size {b}",
        Reason.ALIGN: f"align must be in [1, {MAX_ALIGN}], got {a}",
        Reason.CAPACITY: f"capacity must be in [0, 2**62], got {a}",
        Reason.NONFINITE_WEIGHT: f"topk_weights row {a} holds a non-finite value",
        Reason.NONFINITE_PAYLOAD: f"x row {a} holds a non-finite value (payload "
                                  f"{_payload(b)[0] or 'quantized'} needs finite x)",
        Reason.HIDDEN_NOT_MULT32: _hidden_text(a, b),
        Reason.EXPERT_Y_ROWS: f"expert_y has {a} rows but the dispatch produced {b}",
        Reason.EXPERT_Y_HIDDEN: f"expert_y has hidden size {a} but the dispatch has {b}",
        Reason.X_DTYPE: f"x must be float32 or bfloat16, got {dtype_name(a)}",
        Reason.WEIGHTS_DTYPE: f"topk_weights must be float32, bfloat16 or float16, got {dtype_name(a)}",
        Reason.STATIC_OVERFLOW: f"{a} tokens exceed max_tokens_per_rank={b}",
        Reason.EQUAL_NONUNIFORM: "exchange='equal' needs a uniform plan (every count the same)",
        Reason.NUM_EXPERTS: f"num_experts must be in [1, {MAX_EXPERTS}], got {a}",
        Reason.EXPERT_Y_DTYPE: f"expert_y must be float32 or bfloat16, got {dtype_name(a)}",
        Reason.OPTION: f"unknown {_OPTIONS.get(a, 'option')}: choose from "
                       + ", ".join(map(repr, option_names(_OPTIONS.get(a)).values())),
        Reason.IDX_NOT_2D: f"topk_idx must be 2-D [T, K], got {a} dimensions",
        Reason.WEIGHTS_NOT_2D: f"topk_weights must be 2-D [T, K], got {a} dimensions",
        Reason.GRAD_ROWS: f"gradient has {a} rows but the operation produced {b}",
        Reason.GRAD_HIDDEN: f"gradient has hidden size {a} but the operation has {b}",
        Reason.GRAD_DTYPE: f"gradient must be float32 or bfloat16, got {dtype_name(a)}",
        Reason.STATIC_MAX: f"exchange='static' needs max_tokens_per_rank in [0, {MAX_TOKENS}], "
                           f"got {a}",
        Reason.TOPK_TOO_LARGE: f"top-k {a} exceeds the dedup transport's limit of {b} "
                               "(k travels in 8 bits): use transport='pairs'",
        Reason.ROWS_DTYPE_MISMATCH: f"expert_y / gradient dtype {dtype_name(a)} differs from rank 0's {dtype_name(b)}",
        Reason.NOT_A_TENSOR: f"{ARGUMENTS.get(a, 'an argument')} must be a torch.Tensor "
                             "(from a NumPy array: torch.from_numpy(array))",
        Reason.DEVICE: f"{ARGUMENTS.get(a, 'an argument')} is on a {DEVICES.get(b, 'another')} "
                       "device: epkit needs cpu or cuda tensors, all on the same device",
        Reason.CALL_MISMATCH: f"called {OPERATIONS.get(a, OPERATIONS[0])} while rank 0 called "
                              f"{OPERATIONS.get(b, OPERATIONS[0])}: the ranks are out of step "
                              "(a call skipped or repeated on one rank)",
        Reason.CALL_SEQUENCE: f"is at call #{a} on this group while rank 0 is at #{b}: the ranks "
                              "are out of step (a call skipped or repeated on one rank)",
        Reason.NUM_EXPERTS_MISMATCH: f"num_experts {a} differs from rank 0's {b}",
        Reason.ALIGN_MISMATCH: f"align {a} differs from rank 0's {b}",
        Reason.CAPACITY_MISMATCH: f"capacity {'None' if a < 0 else a} differs from rank 0's "
                                  f"{'None' if b < 0 else b}",
        Reason.TRANSPORT_MISMATCH: f"transport {_opt('transport', a)} differs from rank 0's "
                                   f"{_opt('transport', b)}",
        Reason.EXCHANGE_MISMATCH: f"exchange {_opt('exchange', a)} differs from rank 0's "
                                  f"{_opt('exchange', b)}",
        Reason.PAYLOAD_MISMATCH: f"payload {_opt('payload', a)} differs from rank 0's "
                                 f"{_opt('payload', b)}",
        Reason.MAX_TOKENS_MISMATCH: f"max_tokens_per_rank {'None' if a < 0 else a} differs from "
                                    f"rank 0's {'None' if b < 0 else b}",
        Reason.DISPATCH_MISMATCH: f"combines the dispatch of call #{a} while rank 0 combines "
                                  f"that of call #{b}",
        Reason.FOREIGN_DISPATCH: f"the Dispatch given to combine {FOREIGN.get(a, FOREIGN[2])}",
        Reason.SEND_COUNTS: f"send_counts has {a} entries for a group of {b}",
        Reason.SEND_COUNTS_SUM: f"x has {a} rows but send_counts sum to {b}",
        Reason.SEND_COUNTS_NEGATIVE: f"send_counts holds the negative count {a}",
        Reason.ROW_WIDTH_MISMATCH: f"rows of {a} elements differ from rank 0's {b} elements",
        Reason.CAPACITY_FACTOR: f"capacity_factor must be a finite number > 0, got {_factor(a)}",
        Reason.CAPACITY_AND_FACTOR: "pass capacity or capacity_factor, not both",
        Reason.CAPACITY_FACTOR_MISMATCH: f"capacity_factor {_factor(a)} differs from rank 0's "
                                         f"{_factor(b)}",
        Reason.CALL_FLAGS_MISMATCH: f"asks for {_flags(a, b)} while rank 0 asks for "
                                    f"{_flags(b, a)}",
        Reason.BAD_ARGUMENT: f"{ARGUMENTS.get(a, 'an argument or option')} could not be read (it raised on "
                             "this rank: see the exception's cause there)",
        Reason.RANKS_PER_NODE: f"ranks_per_node must be >= 1 and divide the group size {b}, "
                               f"got {a}",
        Reason.RANKS_PER_NODE_MISMATCH: f"ranks_per_node {a} differs from rank 0's {b} (the "
                                        "default follows LOCAL_WORLD_SIZE: set it alike on "
                                        "every rank, or pass ranks_per_node=)",
        Reason.UNSUPPORTED: f"transport={_opt('transport', b)} does not support "
                            f"{UNSUPPORTED_WHAT.get(a, 'this option')} in production: "
                            + UNSUPPORTED_HINT.get(a, "use another exchange or payload with it "
                                                   "(docs/design.md, its transport's section), "
                                                   "or another transport"),
        Reason.BAD_GROUP: "group must be a torch.distributed ProcessGroup (or None for the "
                          "default group)",
        Reason.TOO_MANY_LOCAL_EXPERTS: f"{a} experts per rank exceed the dedup transport's limit "
                                       f"of {b} (j travels in 24 bits): use transport='pairs'",
    }[c]


def error(rank: int, code: int, a: int = 0, b: int = 0) -> InputError:
    return InputError(rank, Reason(code), format_reason(code, a, b))
