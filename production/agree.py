"""The call header: the first collective of every epkit call, so that no rank acts alone.

A group stays in step only if every rank enters the same collectives with the same sizes. A
check that raises on one rank before its first collective leaves the others waiting, and that
rank's *next* call then pairs with their current one: silent wrong data. Options that differ
between ranks (``num_experts`` sizes the count vector) make the ranks gather different lengths,
which gloo answers with an abort. So every dispatch, combine and exchange opens with one
all-gather of a header whose size depends on nothing at all (and so do both backward passes,
so a rank that skips ``backward()`` is an error on every rank, not a mismatched exchange)::

    HEADER = [MAGIC, op, seq, ref, E, align, capacity, transport, exchange, payload,
              max_tokens, error code, a, b, rows dtype, row width, capacity factor,
              flags, ranks_per_node, x hidden, x dtype, top-k]                     int64 [22]

``op`` is the operation (``errors.OPERATIONS``), ``seq`` this rank's call number on the group,
``ref`` the call number of the dispatch a combine consumes, the options as codes
(``errors.option_names``; ``-1`` for ``None`` or an unknown name; the capacity factor as its
float64 bits; ``ranks_per_node`` as resolved on the rank, so that a ``LOCAL_WORLD_SIZE`` that
differs between ranks is an error, not two summation orders), ``(code, a, b)`` the rank's
local error (every check that needs no collective: types, devices, options, shapes), and the
``flags`` what else the ranks of one call must agree on (errors.CALL_FLAGS: a weighted
combine), the dtype and width (elements per row) of rows
that share one exchange (``epkit.exchange``'s x,
combine's ``expert_y`` dtype; 0 where the count exchange checks them instead, as dispatch's). Every rank
derives the same error from the gathered ``[R, 22]`` words (:func:`group_error`), in this order:
a rank in another operation or at another call number (out of step), the lowest rank with a
local error, the first option that differs from rank 0's, a combine of another dispatch, a rows
dtype unlike rank 0's, then a static dispatch's shape (below).

A static dispatch on the device path (``epkit.device.device_path``) sizes its exchange from its
own ``H``, ``K``, x dtype and payload, reading nothing back (the plan's error stays on the device
until ``check_static``), so ranks that disagree on them would enter the exchange with different
sizes: gloo aborts the process, NCCL may hang or corrupt. Its header therefore carries ``x
hidden``, ``x dtype`` and ``top-k`` (0 in every other call), checked as the count exchange checks
them (lowest rank first, H, then dtype, then K, against rank 0's), then rank 0's K against the
transport's limit (``TOPK_TOO_LARGE``): the same errors the plan would give. After an error the
call numbers are re-synchronised (every rank takes the group's largest plus one), so the next
valid call works.

Calls on one group are serialised within a process (:func:`serial`): two threads sharing a
Dispatcher (or a group) take turns instead of interleaving their collectives.

Where it travels: on CPU (gloo, or the CPU half of ``cpu:gloo,cuda:nccl``) it is read on the
host at no device cost. On an NCCL-only group it is a CUDA tensor and reading it is a host wait,
except during CUDA-graph capture, where the error is computed on the device and kept pending
until :func:`raise_pending` (``epkit.device.check_static``) reads it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import transports
from .collectives import all_gather, resolve_group, small_device
from .hostreads import to_host
from .memory import mark_host
from epkit.reference.errors import Reason, error
from epkit.reference.validate import INT64_MAX

__all__ = ["DISPATCH", "COMBINE", "EXCHANGE", "header", "agree", "group_error", "serial",
           "raise_pending"]

MAGIC = 0x45504B4954  # "EPKIT"
HEADER = 22
(W_MAGIC, W_OP, W_SEQ, W_REF, W_E, W_ALIGN, W_CAP, W_TRANSPORT, W_EXCHANGE, W_PAYLOAD,
 W_MAX_TOKENS, W_CODE, W_A, W_B, W_DTYPE, W_WIDTH, W_CAP_FACTOR, W_FLAGS, W_RANKS_PER_NODE,
 W_X_HIDDEN, W_X_DTYPE, W_TOPK) = range(HEADER)
# A static dispatch's shape words, in the count exchange's order (reference/validate.py).
_SHAPE_WORDS = ((W_X_HIDDEN, Reason.HIDDEN_MISMATCH), (W_X_DTYPE, Reason.DTYPE_MISMATCH),
                (W_TOPK, Reason.TOPK_MISMATCH))
WEIGHTED = 1  # W_FLAGS bits (errors.CALL_FLAGS)
DISPATCH, COMBINE, EXCHANGE, DISPATCH_BACKWARD, COMBINE_BACKWARD = 1, 2, 3, 4, 5
NO_OPTIONS = [-1] * 7  # backward passes: the forward agreed the options already

# (header word, reason) of the options, in the order their disagreement is reported.
_OPTION_WORDS = ((W_E, Reason.NUM_EXPERTS_MISMATCH), (W_ALIGN, Reason.ALIGN_MISMATCH),
                 (W_CAP, Reason.CAPACITY_MISMATCH), (W_TRANSPORT, Reason.TRANSPORT_MISMATCH),
                 (W_EXCHANGE, Reason.EXCHANGE_MISMATCH), (W_PAYLOAD, Reason.PAYLOAD_MISMATCH),
                 (W_MAX_TOKENS, Reason.MAX_TOKENS_MISMATCH),
                 (W_CAP_FACTOR, Reason.CAPACITY_FACTOR_MISMATCH),
                 (W_RANKS_PER_NODE, Reason.RANKS_PER_NODE_MISMATCH))


class _GroupState:
    def __init__(self):
        self.seq = 0
        self.lock = threading.RLock()
        self.pending: list = []  # (error [4], gathered [R, 16]) on the device, unread


_STATES: dict[str, _GroupState] = {}
_STATES_LOCK = threading.Lock()


def _state(group) -> _GroupState:
    with _STATES_LOCK:
        return _STATES.setdefault(group.group_name, _GroupState())


@contextmanager
def serial(group):
    """Hold the group's call lock: one epkit call at a time on ``group`` in this process."""
    if torch.compiler.is_compiling():  # traced code runs on one thread; a lock would break it
        yield
        return
    with _state(group).lock:
        yield


def header(op: int, options: Sequence[int], triple: Sequence[int], rows_dtype: int = 0,
           ref: int = -1, row_width: int = 0, flags: int = 0,
           shape: Sequence[int] = (0, 0, 0)) -> list[int]:
    """This rank's header without its call number (:func:`agree` stamps it).

    ``options``: ``[E, align, capacity, transport, exchange, payload, max_tokens,
    capacity factor bits, ranks_per_node]`` as codes (the last two may be left out: -1).
    ``shape``: ``(H, x dtype code, K)`` of a static dispatch on the device path, else zeros.
    """
    options = list(options) + [-1] * (9 - len(options))
    *options, factor, rpn = options
    words = [MAGIC, int(op), 0, int(ref), *(int(v) for v in options)]
    assert len(words) == W_CODE, "epkit: seven to nine option words expected"
    return words + [int(triple[0]), int(triple[1]), int(triple[2]), int(rows_dtype),
                    int(row_width), int(factor), int(flags), int(rpn), *(int(v) for v in shape)]


# The checks of the gathered headers, in the order they are reported (the first that fires
# wins, naming the lowest rank it finds). ("magic", -, reason): the word is not MAGIC (a
# collective that is not an epkit call); ("local", -, -): the rank's own error words;
# (word, reason): the word differs from rank 0's (a = this rank's, b = rank 0's).
_CHECKS = ((("magic", Reason.CALL_MISMATCH), (W_OP, Reason.CALL_MISMATCH),
            (W_SEQ, Reason.CALL_SEQUENCE), ("local", None))
           + _OPTION_WORDS
           + ((W_REF, Reason.DISPATCH_MISMATCH), (W_DTYPE, Reason.ROWS_DTYPE_MISMATCH),
              (W_WIDTH, Reason.ROW_WIDTH_MISMATCH), (W_FLAGS, Reason.CALL_FLAGS_MISMATCH),
              ("shape", None), ("topk", Reason.TOPK_TOO_LARGE)))


def _max_topk(transport_code: int) -> int:
    """The transport's top-k limit (transports.Transport.max_topk) for a header's transport
    word; no limit for none (-1: not a dispatch) or an unknown code."""
    row = transports.TABLE_BY_CODE.get(int(transport_code))
    return INT64_MAX if row is None or row.max_topk is None else row.max_topk


def group_error(h) -> list[int]:
    """``[code, rank, a, b]`` (code 0: no error) from the gathered headers ``h [R, 18]``: a
    list of rows on the host (plain Python: the call's hot path), or a tensor during CUDA-graph
    capture (:func:`group_error_tensor`, the same checks as tensor ops)."""
    if isinstance(h, torch.Tensor):
        return group_error_tensor(h)
    h0 = h[0]
    for check, reason in _CHECKS:
        for r, row in enumerate(h):
            if check == "magic" and row[W_MAGIC] != MAGIC:
                return [int(reason), r, 0, h0[W_OP]]
            if check == "local" and row[W_CODE] != 0:
                return [row[W_CODE], r, row[W_A], row[W_B]]
            if check == "shape":
                for word, why in _SHAPE_WORDS:
                    if row[word] != h0[word]:
                        return [int(why), r, row[word], h0[word]]
            if check == "topk" and r == 0:
                limit = _max_topk(row[W_TRANSPORT])
                if row[W_TOPK] > limit:
                    return [int(reason), 0, row[W_TOPK], limit]
            if isinstance(check, int) and row[check] != h0[check]:
                return [int(reason), r, row[check], h0[check]]
    return [0, 0, 0, 0]


def group_error_tensor(h: torch.Tensor) -> torch.Tensor:
    """:func:`group_error` in tensor ops, for the device (no host read inside a capture)."""
    R = h.shape[0]
    ranks = torch.arange(R, device=h.device)
    h0 = h[0].unsqueeze(0).expand_as(h)
    out = torch.zeros(4, dtype=torch.int64, device=h.device)
    for check, reason in reversed(_CHECKS):  # the earliest check that fires is kept last
        if check == "magic":
            bad, code, a, b = h[:, W_MAGIC] != MAGIC, reason, torch.zeros_like(ranks), h0[:, W_OP]
        elif check == "local":
            bad, code, a, b = h[:, W_CODE] != 0, h[:, W_CODE], h[:, W_A], h[:, W_B]
        elif check == "shape":  # per rank the first of its shape words that differs
            bad = torch.zeros(R, dtype=torch.bool, device=h.device)
            code = a = b = torch.zeros_like(ranks)
            for word, why in reversed(_SHAPE_WORDS):
                differs = h[:, word] != h0[:, word]
                bad = bad | differs
                code = torch.where(differs, torch.full_like(ranks, int(why)), code)
                a = torch.where(differs, h[:, word], a)
                b = torch.where(differs, h0[:, word], b)
        elif check == "topk":  # rank 0's K (agreed by now) over its transport's limit
            limit = _max_topk_tensor(h0[:, W_TRANSPORT])
            bad = (h0[:, W_TOPK] > limit) & (ranks == 0)
            code, a, b = reason, h0[:, W_TOPK], limit
        else:
            bad, code, a, b = h[:, check] != h0[:, check], reason, h[:, check], h0[:, check]
        first = torch.where(bad, ranks, R).min()
        at = first.clamp(max=R - 1)
        if not isinstance(code, torch.Tensor):  # a fill, not a host copy (CUDA-graph capture)
            code = torch.full((R,), int(code), dtype=torch.int64, device=h.device)
        found = torch.stack([code[at], at, a[at], b[at]])
        out = torch.where(first < R, found, out)
    return out


def _max_topk_tensor(codes: torch.Tensor) -> torch.Tensor:
    """:func:`_max_topk` of each transport word, in tensor ops (fills, no host copy)."""
    limit = torch.full_like(codes, INT64_MAX)
    for code, row in transports.TABLE_BY_CODE.items():
        if row.max_topk is not None:
            limit = torch.where(codes == code, torch.full_like(codes, row.max_topk), limit)
    return limit


def guarded(check, *args):
    """``(check(*args), None)``, or, when reading an argument raises (an object of the wrong
    kind, an integer too large for int64, ...), ``(BAD_ARGUMENT triple, the exception)``: a
    rank must reach the header whatever it was given, never raise before it alone."""
    try:
        return check(*args), None
    except Exception as exc:  # noqa: BLE001 - re-raised as the cause of the collective error
        return (Reason.BAD_ARGUMENT, 0, 0), exc


def agree(group, words: list[int], what: str, cause: Optional[BaseException] = None) -> None:
    """All-gather this rank's header; raise the group's error on every rank, or return.

    ``what`` names the step for a :class:`epkit.PeerError` if a peer never arrives; ``cause``:
    the exception behind this rank's local error, chained to the InputError it raises.
    """
    state = _state(group)
    R = dist.get_world_size(group)
    words = list(words)
    words[W_SEQ] = state.seq
    dev = small_device(group)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing:  # no host-to-device copy in a capture: the words become fill kernels
        mine = torch.empty(HEADER, dtype=torch.int64, device=dev)
        for i, v in enumerate(words):
            mine[i] = v
    elif dev.type == "cpu":  # a CPU backend's memory: host memory on the device path too
        mine = mark_host(torch.tensor(words, dtype=torch.int64))
    else:  # NCCL alone: a host-to-device copy (counted as a wait, epkit.device)
        mine = torch.tensor(words, dtype=torch.int64, device=dev)
    gathered = torch.empty(R * HEADER, dtype=torch.int64, device=dev)
    if dev.type == "cpu":  # a CPU backend's memory: host memory on the device path too
        mark_host(gathered)
    all_gather(gathered, mine, group, what)
    h = gathered.view(R, HEADER)
    if capturing:
        # No host read inside a capture: the error waits on the device for raise_pending.
        state.pending.append((group_error_tensor(h), h))
        state.seq += 1
        return
    rows = to_host(h).tolist()  # on a CPU backend host memory already; NCCL alone: a wait
    _raise(state, group_error(rows), [row[W_SEQ] for row in rows], cause)


def _raise(state: _GroupState, err: list[int], seqs: list[int], cause=None) -> None:
    code, rank, a, b = err
    if code:
        state.seq = max(seqs) + 1  # everyone's next call carries the same number again
        raise error(rank, code, a, b) from cause
    state.seq += 1


def raise_pending(group) -> None:
    """Read the headers agreed on the device (CUDA-graph capture); raise the first error."""
    state = _state(group if group is not None else resolve_group(None))
    pending, state.pending = state.pending, []
    for err, h in pending:
        code, rank, a, b = to_host(err).tolist()
        if code:
            state.seq = max(state.seq, max(to_host(h[:, W_SEQ]).tolist()) + 1)
            raise error(rank, code, a, b)


def call_number(group) -> int:
    """The number the next epkit call on ``group`` will carry (a Dispatch records its own)."""
    return _state(group).seq


def tensor_error(arg_id: int, t) -> Optional[tuple[int, int, int]]:
    """A local error if ``t`` is not a tensor epkit can use: not a tensor, or on a device that
    is neither cpu nor cuda (meta, say)."""
    if not isinstance(t, torch.Tensor):
        return Reason.NOT_A_TENSOR, arg_id, 0
    if t.device.type not in ("cpu", "cuda"):
        return Reason.DEVICE, arg_id, 2 if t.device.type == "meta" else 3
    return None
