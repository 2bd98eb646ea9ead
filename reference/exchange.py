"""Exchange: the all-to-all underneath, in every variant, moving raw row bytes.

``exchange(xs, send_counts)`` on rank ``r`` returns the concatenation, over source ranks ``s``
ascending, of the rows ``s`` addressed to ``r``; ``s``'s rows for peer ``q`` are
``xs[s][sum(send_counts[s][:q]) : sum(send_counts[s][:q + 1])]``. Every variant returns the
same bytes; they differ in what travels:

    ragged  one all-to-all with split sizes: chunk (s, d) is send_counts[s][d] rows
    padded  every chunk padded with zero rows to P = max over all (s, d) of the counts (or to
            a given ``cap >= P``, a bound both sides derive from the plan), one equal-length
            all-to-all of R * P rows each way, unpadded with the known counts
    equal   the plan is uniform (every count the same, n): the split-free all-to-all of n rows
            per chunk; a non-uniform plan is an InputError (EQUAL_NONUNIFORM) naming the lowest
            rank with a count that differs from send_counts[0][0]
    static  every chunk is a fixed ``cap`` rows plus an in-band header of ``ceil(8 / B)`` rows
            (one row whenever a row holds B >= 8 bytes) whose first 8 bytes are the count
            (int64, little-endian); the receiver reads the count from the header, never from
            the plan. A count above ``cap`` is an InputError (STATIC_OVERFLOW)
    auto    equal when the plan is uniform, else ragged

    lazy    not a variant: a *schedule*. ``issue`` starts an exchange and returns a
            :class:`Pending`; ``wait()`` gives the result. The bytes and the result are the
            variant's, exactly; only the time at which a rank waits differs, so independent
            work can run while the rows travel. ``exchange="lazy"`` (an option value of
            dispatch and combine) is the ``auto`` variant on the lazy schedule.

Each variant is one row of ``VARIANTS``: how it moves rows (``move``), how many bytes that
takes without moving any (``bytes``) and the shape of its chunks (``fixed``: one length for
every chunk; ``in_band``: the count travels in the chunk). Each ``exchange=`` option value is
one row of ``OPTIONS``: which variant it runs for a plan's sections (``pick``) and on which
schedule. A new variant is one row of each here, its ABI code in abi.py and its counterpart in
production (epkit.collectives).

A transport may move several sections (dedup: token rows and slot rows), each one exchange of
its own rows with its own counts and, under static, its own ``cap``. The variant is decided
once for the plan (``resolve`` with every section's counts): equal needs every section
uniform (each with its own count), and auto picks equal only then.

The diagonal chunk (s == d) is the local copy; it is counted in the bytes like the others.
Backward of an exchange is the exchange with the counts transposed (send <-> receive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .abi import EXCHANGE_CODES, VARIANT_CODES
from .errors import Reason, error


def is_uniform(counts: np.ndarray) -> bool:
    """Every entry of the [R, R] count matrix is the same."""
    return bool((counts == counts.flat[0]).all())


# --- the options: which variant an exchange= value runs ----------------------------------------
# ``pick(sections)``: the variant for a plan whose sections are ``(counts, ranks)`` pairs, a
# count matrix [n, n] and the (global) rank of each of its rows.

def _fixed(name: str) -> Callable:
    return lambda sections: name


def _auto(sections) -> str:
    """equal when every section is uniform, else ragged."""
    return "equal" if all(is_uniform(c) for c, _ in sections) else "ragged"


def _equal(sections) -> str:
    """equal; a section that is not uniform raises EQUAL_NONUNIFORM, naming the lowest rank
    with a count that differs from its section's ``[0][0]`` (over all sections)."""
    bad = [ranks[int(np.flatnonzero((c != c.flat[0]).any(axis=1))[0])]
           for c, ranks in sections if not is_uniform(c)]
    if bad:
        raise error(min(bad), Reason.EQUAL_NONUNIFORM)
    return "equal"


@dataclass(frozen=True)
class Option:
    """One ``exchange=`` value: the variant it runs for a plan (``pick``, over every section of
    the plan), the schedule it runs on, and on another schedule the option it stands for."""
    name: str
    pick: Callable
    schedule: str = "eager"
    eager: Optional[str] = None     # the same option on the eager schedule (None: itself)

    @property
    def code(self) -> int:
        """The ABI code (abi.EXCHANGE_CODES): the call header's."""
        return EXCHANGE_CODES[self.name]


OPTIONS: Dict[str, Option] = {o.name: o for o in (
    Option("ragged", _fixed("ragged")),
    Option("padded", _fixed("padded")),
    Option("equal", _equal),
    Option("static", _fixed("static")),
    Option("auto", _auto),
    Option("lazy", _auto, "lazy", eager="auto"),   # auto on the lazy schedule
)}
assert set(OPTIONS) == set(EXCHANGE_CODES), "abi.EXCHANGE_CODES and the option table differ"
# The options on the eager schedule, what ``exchange_rows`` / ``exchange_bytes`` take (an
# operation's exchange= may also name ``lazy``: it runs its variant, ``split_option``; the lazy
# schedule itself is ``issue``).
NAMES: Tuple[str, ...] = tuple(n for n, o in OPTIONS.items() if o.schedule == "eager")


def split_option(exchange: str) -> Tuple[str, str]:
    """An ``exchange=`` option value -> ``(variant name, schedule)``: ``"lazy"`` is the auto
    variant on the lazy schedule; every other name is itself, eager (None and values that are
    no option too: validation reports them). A reference operation runs the variant: the
    schedule changes when the rows move, not what moves."""
    option = OPTIONS.get(exchange) if isinstance(exchange, str) else None
    if option is None:
        return exchange, "eager"
    return option.eager or option.name, option.schedule


def resolve(variant: str, *counts: np.ndarray, ranks: Optional[Sequence] = None) -> str:
    """The variant that runs for a plan whose sections have the given count matrices (the
    option's ``pick``): ``auto`` -> equal when every section is uniform, else ragged; ``equal``
    with a section that is not uniform raises EQUAL_NONUNIFORM, naming the lowest rank with a
    count that differs from its section's ``[0][0]`` (over all sections). ``ranks``: the global
    rank of each section's rows (default: row i is rank i)."""
    option = OPTIONS.get(variant)
    if option is None or option.schedule != "eager":
        raise ValueError(f"epkit.reference: unknown exchange variant {variant!r}")
    if ranks is None:
        ranks = [range(len(c)) for c in counts]
    return option.pick(list(zip(counts, ranks)))


def is_static(exchange: Optional[str]) -> bool:
    """The option runs the static variant (chunks of a fixed cap: needs max_tokens_per_rank)."""
    return exchange in VARIANTS and VARIANTS[exchange].in_band


def header_rows(row_bytes: int) -> int:
    """Rows of the static exchange's in-band header: enough for an 8-byte count."""
    if row_bytes <= 0:
        raise ValueError("epkit.reference: the static exchange needs rows of at least one byte")
    return -(-8 // row_bytes)


# --- the collectives underneath ------------------------------------------------------------

def _all_to_all_split(bufs: List[np.ndarray], counts: np.ndarray) -> List[np.ndarray]:
    """The collective with split sizes: rank d gets chunk (s, d) of every s, s ascending."""
    R = len(bufs)
    starts = [np.concatenate([[0], np.cumsum(counts[s])]) for s in range(R)]
    return [np.concatenate([bufs[s][starts[s][d]:starts[s][d + 1]] for s in range(R)])
            for d in range(R)]


def _all_to_all_equal(bufs: List[np.ndarray], block: int) -> List[np.ndarray]:
    """The split-free collective: every rank's buffer is R blocks of ``block`` rows."""
    R = len(bufs)
    return [np.concatenate([bufs[s][d * block:(d + 1) * block] for s in range(R)]) for d in range(R)]


def _chunks(buf: np.ndarray, counts_row: np.ndarray) -> List[np.ndarray]:
    starts = np.concatenate([[0], np.cumsum(counts_row)])
    return [buf[starts[d]:starts[d + 1]] for d in range(len(counts_row))]


def _pad_to(counts: np.ndarray, cap: Optional[int]) -> int:
    """The padded exchange's chunk: the largest count, or ``cap`` when given (never below it)."""
    P = int(counts.max(initial=0))
    if cap is None:
        return P
    if P > cap:
        raise ValueError(f"epkit.reference: a padded chunk of {P} rows exceeds its cap {cap}")
    return int(cap)


def _same(counts: np.ndarray, nbytes: int) -> np.ndarray:
    return np.full(counts.shape, nbytes, np.int64)


# --- the variants: move(bufs [R] of [S, B] uint8, counts [R, R], cap) -> (received, bytes) ---

def _ragged_move(bufs, counts, cap):
    return _all_to_all_split(bufs, counts), counts * bufs[0].shape[1]


def _ragged_bytes(counts, row_bytes, cap):
    return counts * row_bytes


def _equal_move(bufs, counts, cap):
    block = int(counts.flat[0])
    return _all_to_all_equal(bufs, block), _same(counts, block * bufs[0].shape[1])


def _padded_move(bufs, counts, cap):
    R, B, P = len(bufs), bufs[0].shape[1], _pad_to(counts, cap)
    sends = [np.concatenate([np.concatenate([c, np.zeros((P - len(c), B), np.uint8)])
                             for c in _chunks(bufs[s], counts[s])]) for s in range(R)]
    got = _all_to_all_equal(sends, P)
    received = [np.concatenate([got[d][s * P:s * P + counts[s, d]] for s in range(R)])
                for d in range(R)]
    return received, _same(counts, P * B)


def _padded_bytes(counts, row_bytes, cap):
    return _same(counts, _pad_to(counts, cap) * row_bytes)


def _static_check(counts, cap):
    if cap is None:
        raise ValueError("epkit.reference: the static exchange needs cap")
    too_many = np.argwhere(counts > cap)
    if too_many.size:
        s, d = too_many[0]
        raise error(int(s), Reason.STATIC_OVERFLOW, int(counts[s, d]), cap)


def _static_move(bufs, counts, cap):
    """Chunks of ``header + cap`` rows; the receiver reads each count from its header."""
    _static_check(counts, cap)
    R, B = len(bufs), bufs[0].shape[1]
    hdr = header_rows(B)
    block = hdr + cap
    sends = []
    for s in range(R):
        blocks = []
        for chunk in _chunks(bufs[s], counts[s]):
            head = np.zeros(hdr * B, np.uint8)
            head[:8] = np.frombuffer(np.int64(len(chunk)).astype("<i8").tobytes(), np.uint8)
            blocks += [head.reshape(hdr, B), chunk, np.zeros((cap - len(chunk), B), np.uint8)]
        sends.append(np.concatenate(blocks) if blocks else np.zeros((0, B), np.uint8))
    got = _all_to_all_equal(sends, block)
    received = []
    for d in range(R):
        parts = []
        for s in range(R):
            blk = got[d][s * block:(s + 1) * block]
            n = int(np.frombuffer(blk[:hdr].tobytes()[:8], "<i8")[0])   # the in-band count
            parts.append(blk[hdr:hdr + n])
        received.append(np.concatenate(parts))
    return received, _same(counts, block * B)


def _static_bytes(counts, row_bytes, cap):
    _static_check(counts, cap)
    return _same(counts, (header_rows(row_bytes) + cap) * row_bytes)


@dataclass(frozen=True)
class Variant:
    """One way of moving a section's rows: ``move`` carries it out on byte rows, ``bytes``
    says what it would send without moving anything ([R, R] int64, padding and headers
    included). ``fixed``: every chunk has one length (padded, equal, static); ``in_band``:
    chunks of a fixed cap, each with its count in a header row (static)."""
    name: str
    move: Callable
    bytes: Callable
    fixed: bool = False
    in_band: bool = False

    @property
    def code(self) -> int:
        """The ABI code (abi.VARIANT_CODES): the plan's VARIANT word."""
        return VARIANT_CODES[self.name]


VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("ragged", _ragged_move, _ragged_bytes),
    Variant("padded", _padded_move, _padded_bytes, fixed=True),
    Variant("equal", _equal_move, _ragged_bytes, fixed=True),  # uniform: n rows a chunk
    Variant("static", _static_move, _static_bytes, fixed=True, in_band=True),
)}
assert set(VARIANTS) == set(VARIANT_CODES), "abi.VARIANT_CODES and the variant table differ"


def exchange_rows(bufs: Sequence[np.ndarray], send_counts, variant: str = "ragged",
                  cap: Optional[int] = None) -> Tuple[List[np.ndarray], np.ndarray]:
    """Carry out one exchange of byte rows.

    Args:
        bufs: R arrays [S_r, B] uint8 (the same B everywhere).
        send_counts: [R, R] ints, row s = rows s sends to each peer (sums to S_s).
        variant: a name of ``NAMES`` (see the module docstring); cap: the static chunk size in
            rows (padded: the chunk to pad to, default the largest count).
    Returns:
        (received: R arrays [N_d, B] uint8, moved: [R, R] int64 bytes s sent to d, padding and
        headers included).
    """
    counts = np.asarray(send_counts, np.int64).reshape(len(bufs), len(bufs))
    R = len(bufs)
    if (counts < 0).any() or any(counts[s].sum() != bufs[s].shape[0] for s in range(R)):
        raise ValueError("epkit.reference: send_counts must be >= 0 and sum to each rank's rows")
    return VARIANTS[resolve(variant, counts)].move(list(bufs), counts, cap)


def exchange_bytes(counts, row_bytes: int, variant: str, cap: Optional[int] = None) -> np.ndarray:
    """Bytes each rank sends to each peer ([R, R] int64) for a count matrix, without moving any."""
    counts = np.asarray(counts, np.int64)
    return VARIANTS[resolve(variant, counts)].bytes(counts, row_bytes, cap)


class Pending:
    """An exchange on the lazy schedule: issued, not yet waited for. ``wait()`` returns what
    the eager call would have (once). In one process nothing overlaps, so this states the
    contract production keeps: no result exists before ``wait()``, and it is the variant's."""

    def __init__(self, run: Callable):
        self._run, self._done = run, None

    def wait(self):
        if self._run is not None:
            self._done, self._run = self._run(), None
        return self._done


def issue(xs: Sequence[np.ndarray], send_counts, variant: str = "auto",
          cap: Optional[int] = None) -> Pending:
    """``exchange`` on the lazy schedule: the same arguments, the same result, at ``wait()``."""
    return Pending(lambda: exchange(xs, send_counts, variant, cap))


def exchange(xs: Sequence[np.ndarray], send_counts, variant: str = "ragged",
             cap: Optional[int] = None) -> List[np.ndarray]:
    """The exchange on arrays of any dtype and trailing shape.

    Args:
        xs: R arrays [S_r, ...] (one dtype and trailing shape for the group).
        send_counts: R sequences of R ints; ``send_counts[s][d]`` rows go from s to d.
        variant: "ragged", "padded", "equal", "static" (needs ``cap``) or "auto";
            ``"lazy"`` is not a variant: use :func:`issue` (the lazy schedule).
    Returns:
        R arrays [N_r, ...]: on rank r the rows addressed to r, source ranks ascending.
    """
    xs = [np.ascontiguousarray(x) for x in xs]
    if len({(x.dtype, x.shape[1:]) for x in xs}) != 1:
        raise ValueError("epkit.reference: exchange needs one dtype and trailing shape on all ranks")
    dtype, tail = xs[0].dtype, xs[0].shape[1:]
    row_bytes = dtype.itemsize * int(np.prod(tail, dtype=np.int64))
    width = int(np.prod(tail, dtype=np.int64))
    bufs = [x.reshape(x.shape[0], width).view(np.uint8).reshape(x.shape[0], row_bytes) for x in xs]
    received, _ = exchange_rows(bufs, send_counts, variant, cap)
    return [np.ascontiguousarray(r).view(dtype).reshape((r.shape[0],) + tail) for r in received]
