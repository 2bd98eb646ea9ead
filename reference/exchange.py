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

A transport may move several sections (dedup: token rows and slot rows), each one exchange of
its own rows with its own counts and, under static, its own ``cap``. The variant is decided
once for the plan (``resolve`` with every section's counts): equal needs every section
uniform (each with its own count), and auto picks equal only then.

The diagonal chunk (s == d) is the local copy; it is counted in the bytes like the others.
Backward of an exchange is the exchange with the counts transposed (send <-> receive).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .errors import Reason, error

VARIANTS = ("ragged", "padded", "equal", "static", "auto")


def is_uniform(counts: np.ndarray) -> bool:
    """Every entry of the [R, R] count matrix is the same."""
    return bool((counts == counts.flat[0]).all())


def resolve(variant: str, *counts: np.ndarray) -> str:
    """The variant that runs for a plan whose sections have the given [R, R] count matrices:
    ``auto`` -> equal when every section is uniform, else ragged; ``equal`` with a section that
    is not uniform raises EQUAL_NONUNIFORM, naming the lowest rank with a count that differs
    from its section's ``[0][0]`` (over all sections)."""
    uniform = all(is_uniform(c) for c in counts)
    if variant == "auto":
        return "equal" if uniform else "ragged"
    if variant == "equal" and not uniform:
        rank = min(int(np.flatnonzero((c != c.flat[0]).any(axis=1))[0])
                   for c in counts if not is_uniform(c))
        raise error(rank, Reason.EQUAL_NONUNIFORM)
    if variant not in VARIANTS:
        raise ValueError(f"epkit.reference: unknown exchange variant {variant!r}")
    return variant


def header_rows(row_bytes: int) -> int:
    """Rows of the static exchange's in-band header: enough for an 8-byte count."""
    if row_bytes <= 0:
        raise ValueError("epkit.reference: the static exchange needs rows of at least one byte")
    return -(-8 // row_bytes)


def _pad_to(counts: np.ndarray, cap: Optional[int]) -> int:
    """The padded exchange's chunk: the largest count, or ``cap`` when given (never below it)."""
    P = int(counts.max(initial=0))
    if cap is None:
        return P
    if P > cap:
        raise ValueError(f"epkit.reference: a padded chunk of {P} rows exceeds its cap {cap}")
    return int(cap)


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


def exchange_rows(bufs: Sequence[np.ndarray], send_counts, variant: str = "ragged",
                  cap: Optional[int] = None) -> Tuple[List[np.ndarray], np.ndarray]:
    """Carry out one exchange of byte rows.

    Args:
        bufs: R arrays [S_r, B] uint8 (the same B everywhere).
        send_counts: [R, R] ints, row s = rows s sends to each peer (sums to S_s).
        variant: see the module docstring; cap: the static chunk size in rows (padded: the
            chunk to pad to, default the largest count).
    Returns:
        (received: R arrays [N_d, B] uint8, moved: [R, R] int64 bytes s sent to d, padding and
        headers included).
    """
    counts = np.asarray(send_counts, np.int64).reshape(len(bufs), len(bufs))
    R = len(bufs)
    B = bufs[0].shape[1]
    if (counts < 0).any() or any(counts[s].sum() != bufs[s].shape[0] for s in range(R)):
        raise ValueError("epkit.reference: send_counts must be >= 0 and sum to each rank's rows")
    variant = resolve(variant, counts)
    if variant == "ragged":
        return _all_to_all_split(list(bufs), counts), counts * B
    if variant == "equal":
        block = int(counts.flat[0])
        return _all_to_all_equal(list(bufs), block), np.full((R, R), block * B, np.int64)
    if variant == "padded":
        P = _pad_to(counts, cap)
        sends = []
        for s in range(R):
            chunks = _chunks(bufs[s], counts[s])
            sends.append(np.concatenate([np.concatenate([c, np.zeros((P - len(c), B), np.uint8)])
                                         for c in chunks]))
        got = _all_to_all_equal(sends, P)
        received = [np.concatenate([got[d][s * P:s * P + counts[s, d]] for s in range(R)])
                    for d in range(R)]
        return received, np.full((R, R), P * B, np.int64)
    # static
    if cap is None:
        raise ValueError("epkit.reference: the static exchange needs cap")
    hdr = header_rows(B)
    block = hdr + cap
    sends = []
    for s in range(R):
        blocks = []
        for d, chunk in enumerate(_chunks(bufs[s], counts[s])):
            if len(chunk) > cap:
                raise error(s, Reason.STATIC_OVERFLOW, len(chunk), cap)
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
    return received, np.full((R, R), block * B, np.int64)


def exchange_bytes(counts, row_bytes: int, variant: str, cap: Optional[int] = None) -> np.ndarray:
    """Bytes each rank sends to each peer ([R, R] int64) for a count matrix, without moving any."""
    counts = np.asarray(counts, np.int64)
    variant = resolve(variant, counts)
    R = counts.shape[0]
    if variant in ("ragged", "equal"):
        return counts * row_bytes
    if variant == "padded":
        return np.full((R, R), _pad_to(counts, cap) * row_bytes, np.int64)
    if cap is None:
        raise ValueError("epkit.reference: the static exchange needs cap")
    too_many = np.argwhere(counts > cap)
    if too_many.size:
        s, d = too_many[0]
        raise error(int(s), Reason.STATIC_OVERFLOW, int(counts[s, d]), cap)
    return np.full((R, R), (header_rows(row_bytes) + cap) * row_bytes, np.int64)


def exchange(xs: Sequence[np.ndarray], send_counts, variant: str = "ragged",
             cap: Optional[int] = None) -> List[np.ndarray]:
    """The exchange on arrays of any dtype and trailing shape.

    Args:
        xs: R arrays [S_r, ...] (one dtype and trailing shape for the group).
        send_counts: R sequences of R ints; ``send_counts[s][d]`` rows go from s to d.
        variant: "ragged", "padded", "equal", "static" (needs ``cap``) or "auto".
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
