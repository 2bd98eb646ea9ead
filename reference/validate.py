"""Input validation: which rank is bad, and why, decided before any token moves.

Every check yields a reason triple ``(code, a, b)`` (``errors.Reason`` and two details). A rank
puts its first failing triple into the header of its count-exchange word vector,

    HEADER = [error_code, a, b, T, H, K, x_dtype_code, reserved]       int64 [8]

and every rank derives the same error from the gathered ``[R, 8]`` headers (``group_error``):
the lowest rank with a non-zero code; if there is none, the lowest rank whose ``H``, x dtype or
``K`` differs from rank 0's (reported in that order). The reference raises that error.

Order of the checks on one rank (the first failing one is reported):

1. options, identical on every rank, so always reported for rank 0 (``option_triple``, which
   production asks too): ``align >= 1``, ``capacity >= 0``, ``capacity_factor`` a finite
   number > 0 and not with ``capacity``, ``num_experts >= 1``, ``num_experts % R == 0``,
   transport, exchange, payload names (``OPTION``, ``b = -1``), ``max_tokens_per_rank >= 0``
   under the static exchange, ``ranks_per_node`` a divisor of ``R`` (``RANKS_PER_NODE``); an
   integer option that is not an integer reports -1;
2. dtypes: x float32 or bfloat16; topk_idx an integer dtype (not bool); topk_weights float32,
   bfloat16 or float16 (the last two widened to float32, exactly, before anything reads them);
3. shapes: x 2-D; topk_idx 2-D; topk_idx rows == x rows; topk_weights 2-D; its shape == topk_idx's;
4. index range: the first entry, in row-major order, outside ``[-1, E)`` (``a`` = the entry);
5. duplicates: the first row naming an expert twice (``b`` = the smallest such expert);
6. routing weights finite: the first row holding a NaN or an infinity (every entry is checked,
   unused slots included, and also when the combine will be unweighted);
7. a quantized payload only (payloads.py): ``H % block == 0``, then the first row of x holding a
   non-finite value (every row); both report the payload's code as ``b``;
8. static exchange only: ``T <= max_tokens_per_rank`` (``STATIC_OVERFLOW``, ``a = T``).

After the agreement the transport checks what its wire format encodes (dedup and hier:
``K <= 255``, ``TOPK_TOO_LARGE`` named for rank 0; transports/dedup.py, hier.py).

Combine and the backward passes check, per rank in ascending order, the arrays they are given
against the dispatch result: dtype (float32 or bfloat16), then rows, then ``H`` (an array that
is not 2-D reports ``H = -1``); ``expert_y`` uses the ``EXPERT_Y_*`` reasons, gradients the
``GRAD_*`` reasons; then every rank's dtype must equal rank 0's (``ROWS_DTYPE_MISMATCH``: the
rows of all ranks share one exchange). combine_backward checks its gradients first, then
``expert_y``.
"""

from __future__ import annotations

import math
import operator
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import payloads
from .abi import EXCHANGE_CODES, PAYLOAD_CODES, TRANSPORT_CODES
from .dtypes import BFLOAT16, FLOAT32, FLOAT_DTYPES, dtype_code
from .exchange import is_static
from .errors import (MAX_ALIGN, MAX_CAPACITY, MAX_EXPERTS, MAX_TOKENS, InputError, Reason, error,
                     factor_bits)

Triple = Tuple[int, int, int]
OK: Triple = (Reason.OK, 0, 0)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# What topk_weights may be: bfloat16 and float16 values are all float32 values, so widening them
# loses nothing (the routers of Megatron-Core and torchtitan give bfloat16 weights in bfloat16
# training).
WEIGHT_DTYPES = (FLOAT32, BFLOAT16, np.dtype(np.float16))


def as_int(v, default=None):
    """``v`` as an int when it is one (a Python or NumPy integer; not a bool, float or string),
    clamped to int64 so that it fits a header word (the bounds checks then name it); else
    ``default``. An option of the wrong type is reported like one out of range."""
    if v is None or isinstance(v, bool):
        return default
    try:
        return min(max(operator.index(v), INT64_MIN), INT64_MAX)
    except TypeError:
        return default


def factor_word(f) -> int:
    """A capacity factor's header word: its float64 bits; -1 for None or not a real number."""
    if f is None or isinstance(f, (bool, str)):
        return -1
    try:
        return factor_bits(float(f))
    except (TypeError, ValueError, OverflowError):
        return -1


def _named(value, names) -> bool:
    try:
        return value in names
    except TypeError:  # an unhashable value is no name
        return False


def option_triple(align, capacity, num_experts, num_ranks, transport=None, exchange=None,
                  payload=None, max_tokens_per_rank=None, ranks_per_node=1,
                  capacity_factor=None) -> Triple:
    """Check 1 of the module docstring, the one body of the option checks (production's
    ``validate.option_error`` asks it too): ``a`` is the option as an int (-1 when it is not
    one), a name that is not one reports which (``OPTION``, ``a`` = 1 transport, 2 exchange,
    3 payload). transport, exchange, payload None: not this call's option (the canonical
    computation, no payload); every name the ABI codes is one (``"lazy"`` too)."""
    A, C, E = as_int(align), as_int(capacity), as_int(num_experts)
    G, M = as_int(ranks_per_node), as_int(max_tokens_per_rank)
    if A is None or not 1 <= A <= MAX_ALIGN:
        return (Reason.ALIGN, -1 if A is None else A, 0)
    if capacity is not None and (C is None or not 0 <= C <= MAX_CAPACITY):
        return (Reason.CAPACITY, -1 if C is None else C, 0)
    if capacity_factor is not None:
        if capacity is not None:
            return (Reason.CAPACITY_AND_FACTOR, 0, 0)
        bits = factor_word(capacity_factor)
        if bits == -1 or not 0 < float(capacity_factor) < math.inf:  # NaN compares false
            return (Reason.CAPACITY_FACTOR, bits, 0)
    if E is None or not 1 <= E <= MAX_EXPERTS:
        return (Reason.NUM_EXPERTS, -1 if E is None else E, 0)
    if E % num_ranks != 0:
        return (Reason.EXPERTS_NOT_DIVISIBLE, E, num_ranks)
    for option_id, value, names in ((1, transport, TRANSPORT_CODES),
                                     (2, exchange, EXCHANGE_CODES),
                                     (3, payload, PAYLOAD_CODES)):
        if value is not None and not _named(value, names):
            return (Reason.OPTION, option_id, -1)
    if is_static(exchange) and (M is None or not 0 <= M <= MAX_TOKENS):
        return (Reason.STATIC_MAX, -1 if M is None else M, 0)
    if G is None or not 1 <= G <= num_ranks or num_ranks % G:
        return (Reason.RANKS_PER_NODE, -1 if G is None else G, num_ranks)
    return OK


def check_options(num_ranks: int, **options) -> None:
    """Raise the option error (named for rank 0: every rank holds the same options)."""
    if num_ranks < 1:
        raise ValueError("epkit.reference: the group needs at least one rank (empty lists given)")
    code, a, b = option_triple(num_ranks=num_ranks, **options)
    if code != Reason.OK:
        raise error(0, code, a, b)


def _routing_triple(idx: np.ndarray, num_experts: int) -> Triple:
    """Index range, then duplicates, of one rank's validated-shape ``topk_idx`` [T, K]."""
    idx = idx.astype(np.int64)
    bad = (idx < -1) | (idx >= num_experts)
    if bad.any():
        return (Reason.INDEX_OUT_OF_RANGE, int(idx.ravel()[np.argmax(bad.ravel())]), num_experts)
    srt = np.sort(idx, axis=1)
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    rows = np.flatnonzero(dup.any(axis=1))
    if rows.size:
        t = int(rows[0])
        return (Reason.DUPLICATE_EXPERT, t, int(srt[t, 1:][dup[t]][0]))
    return OK


def _idx_dtype_triple(idx: np.ndarray) -> Triple:
    if not np.issubdtype(idx.dtype, np.integer):
        return (Reason.INDEX_DTYPE, dtype_code(idx.dtype), 0)
    return OK


def routing_triple(idx: np.ndarray, num_experts: int) -> Triple:
    """The checks ``layout`` makes on one rank: index dtype, 2-D, range, duplicates."""
    for triple in (_idx_dtype_triple(idx),
                   (Reason.IDX_NOT_2D, idx.ndim, 0) if idx.ndim != 2 else OK):
        if triple[0] != Reason.OK:
            return triple
    return _routing_triple(idx, num_experts)


def local_triple(x: np.ndarray, idx: np.ndarray, w: np.ndarray, num_experts: int,
                 payload: Optional[str] = None, max_tokens_per_rank: Optional[int] = None) -> Triple:
    """Checks 2..8 of the module docstring on one rank's dispatch inputs."""
    if x.dtype not in FLOAT_DTYPES:
        return (Reason.X_DTYPE, dtype_code(x.dtype), 0)
    if _idx_dtype_triple(idx)[0] != Reason.OK:
        return _idx_dtype_triple(idx)
    if w.dtype not in WEIGHT_DTYPES:
        return (Reason.WEIGHTS_DTYPE, dtype_code(w.dtype), 0)
    if x.ndim != 2:
        return (Reason.X_NOT_2D, x.ndim, 0)
    if idx.ndim != 2:
        return (Reason.IDX_NOT_2D, idx.ndim, 0)
    if idx.shape[0] != x.shape[0]:
        return (Reason.IDX_SHAPE, idx.shape[0], x.shape[0])
    if w.ndim != 2:
        return (Reason.WEIGHTS_NOT_2D, w.ndim, 0)
    if w.shape != idx.shape:
        return (Reason.WEIGHTS_SHAPE, w.shape[0], w.shape[1])
    triple = _routing_triple(idx, num_experts)
    if triple[0] != Reason.OK:
        return triple
    rows = np.flatnonzero(~np.isfinite(w).all(axis=1))
    if rows.size:
        return (Reason.NONFINITE_WEIGHT, int(rows[0]), 0)
    triple = payloads.get(payload).check(x)
    if triple[0] != Reason.OK:
        return triple
    if max_tokens_per_rank is not None and x.shape[0] > max_tokens_per_rank:
        return (Reason.STATIC_OVERFLOW, x.shape[0], int(max_tokens_per_rank))
    return OK


def header(triple: Triple, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """One rank's count-exchange header ``[code, a, b, T, H, K, x_dtype_code, 0]`` int64 [8]."""
    T = x.shape[0] if x.ndim >= 1 else -1
    H = x.shape[1] if x.ndim == 2 else -1
    K = idx.shape[1] if idx.ndim == 2 else -1
    return np.array([triple[0], triple[1], triple[2], T, H, K, dtype_code(x.dtype), 0], np.int64)


def group_error(headers: np.ndarray) -> Optional[InputError]:
    """The error every rank raises, from the gathered headers int64 [R, 8]; None if all is well."""
    for r in range(headers.shape[0]):
        if headers[r, 0] != Reason.OK:
            return error(r, int(headers[r, 0]), int(headers[r, 1]), int(headers[r, 2]))
    for r in range(1, headers.shape[0]):
        for word, code in ((4, Reason.HIDDEN_MISMATCH), (6, Reason.DTYPE_MISMATCH),
                           (5, Reason.TOPK_MISMATCH)):
            if headers[r, word] != headers[0, word]:
                return error(r, code, int(headers[r, word]), int(headers[0, word]))
    return None


def check_dispatch(xs, topk_idx, topk_weights, *, num_experts, align=1, capacity=None,
                   transport=None, exchange=None, payload=None, max_tokens_per_rank=None,
                   ranks_per_node=1):
    """Validate a whole group's dispatch inputs; return ``(xs, idx, ws)`` as NumPy arrays with
    ``idx`` widened to int64. Raises the ``InputError`` every rank would raise."""
    R = len(xs)
    if not (len(topk_idx) == len(topk_weights) == R):
        raise ValueError("epkit.reference: xs, topk_idx and topk_weights need one entry per rank")
    check_options(R, align=align, capacity=capacity, num_experts=num_experts, transport=transport,
                  exchange=exchange, payload=payload, max_tokens_per_rank=max_tokens_per_rank,
                  ranks_per_node=ranks_per_node)
    xs = [np.asarray(x) for x in xs]
    idx = [np.asarray(i) for i in topk_idx]
    ws = [np.asarray(w) for w in topk_weights]
    static_max = max_tokens_per_rank if is_static(exchange) else None
    headers = np.stack([
        header(local_triple(xs[r], idx[r], ws[r], int(num_experts), payload, static_max), xs[r], idx[r])
        for r in range(R)])
    err = group_error(headers)
    if err is not None:
        raise err
    return xs, [i.astype(np.int64) for i in idx], [w.astype(FLOAT32) for w in ws]


def check_layout(topk_idx, num_experts) -> List[np.ndarray]:
    """Validate ``layout``'s inputs (options, then per rank the routing checks); int64 copies."""
    R = len(topk_idx)
    check_options(R, align=1, capacity=None, num_experts=num_experts)
    idx = [np.asarray(i) for i in topk_idx]
    for r in range(R):
        code, a, b = routing_triple(idx[r], int(num_experts))
        if code != Reason.OK:
            raise error(r, code, a, b)
    return [i.astype(np.int64) for i in idx]


def _rows_triple(arr: np.ndarray, rows: int, hidden: int, grad: bool) -> Triple:
    dtype_r, rows_r, hidden_r = ((Reason.GRAD_DTYPE, Reason.GRAD_ROWS, Reason.GRAD_HIDDEN) if grad
                                 else (Reason.EXPERT_Y_DTYPE, Reason.EXPERT_Y_ROWS, Reason.EXPERT_Y_HIDDEN))
    if arr.dtype not in FLOAT_DTYPES:
        return (dtype_r, dtype_code(arr.dtype), 0)
    n = arr.shape[0] if arr.ndim >= 1 else -1
    if n != rows:
        return (rows_r, n, rows)
    h = arr.shape[1] if arr.ndim == 2 else -1
    if h != hidden:
        return (hidden_r, h, hidden)
    return OK


def check_rows(arrays: Sequence, shapes: Sequence[Tuple[int, int]], *, grad: bool) -> List[np.ndarray]:
    """Validate per-rank float arrays against each rank's expected ``(rows, H)``; return them as
    NumPy arrays. ``grad`` selects the ``GRAD_*`` reasons instead of the ``EXPERT_Y_*`` ones."""
    if len(arrays) != len(shapes):
        raise ValueError("epkit.reference: need one array per rank")
    arrays = [np.asarray(a) for a in arrays]
    for r, (arr, (rows, hidden)) in enumerate(zip(arrays, shapes)):
        code, a, b = _rows_triple(arr, rows, hidden, grad)
        if code != Reason.OK:
            raise error(r, code, a, b)
    for r, arr in enumerate(arrays):   # one dtype for the group: the rows share one exchange
        if arr.dtype != arrays[0].dtype:
            raise error(r, Reason.ROWS_DTYPE_MISMATCH, dtype_code(arr.dtype), dtype_code(arrays[0].dtype))
    return arrays


def check_results(res) -> None:
    if len(res) == 0:
        raise ValueError("epkit.reference: empty list of dispatch results")
    if any(r.group.num_ranks != len(res) or r.rank != i for i, r in enumerate(res)):
        raise ValueError("epkit.reference: results must be the full group's list, in rank order")
