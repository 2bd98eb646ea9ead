"""Bitwise comparison of an output with the reference's, and how a difference is shown."""

from __future__ import annotations

import numpy as np

__all__ = ["compare_bitwise"]


def _fmt(v) -> str:
    a = np.asarray(v)
    if a.dtype.kind in "iub":
        return str(a.item())
    bits = a.view(np.dtype(f"u{a.dtype.itemsize}")).item()
    return f"{float(a.astype(np.float64))!r} (0x{bits:0{2 * a.dtype.itemsize}x})"


def _where(shape, flat_index) -> str:
    idx = np.unravel_index(flat_index, shape)
    if len(shape) == 2:
        return f"row {idx[0]}, col {idx[1]}"
    return "index " + ", ".join(str(i) for i in idx)


def _kind_mismatch(got, want):
    """(got as an array, None) when it has want's shape and dtype, else (None, message)."""
    want = np.asarray(want)
    if got is None:
        return None, f"missing (expected {want.dtype} {list(want.shape)})"
    got = np.asarray(got)
    if got.shape != want.shape:
        return None, f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return None, f"dtype {got.dtype}, expected {want.dtype}"
    return got, None


def compare_bitwise(got, want) -> str | None:
    """None when ``got`` has ``want``'s shape, dtype and bytes (a NaN matches any NaN); else
    what differs."""
    want = np.asarray(want)
    got, msg = _kind_mismatch(got, want)
    if msg or want.size == 0:
        return msg
    u = np.dtype(f"u{want.dtype.itemsize}")
    diff = np.ascontiguousarray(got).view(u) != np.ascontiguousarray(want).view(u)
    if diff.any() and want.dtype.kind not in "iub":
        # IEEE 754 leaves the sign and payload of a computed NaN open (x86 makes -NaN, torch's
        # bfloat16 cast +NaN): a NaN matches any NaN; every other value, -0.0 included, its bits
        with np.errstate(all="ignore"):
            diff &= ~(np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64)))
    if not diff.any():
        return None
    at = np.flatnonzero(diff)
    first, worst = int(at[0]), _worst(got.reshape(-1), want.reshape(-1), at)
    g, w = got.reshape(-1), want.reshape(-1)
    text = (f"{want.dtype} {list(want.shape)}: worst difference at {_where(want.shape, worst)}: "
            f"got {_fmt(g[worst])}, expected {_fmt(w[worst])}")
    if first != worst:
        text += (f"; first difference at {_where(want.shape, first)}: got {_fmt(g[first])}, "
                 f"expected {_fmt(w[first])}")
    return text + f"; {len(at)} of {want.size} elements differ"


def _worst(got, want, at) -> int:
    """The flat index, among ``at`` (where the bits differ), of the largest ``|got - want|``: a
    NaN or an infinity against a number counts as infinite; between equal-valued elements
    (``0.0`` and ``-0.0``) as zero; the first such element on ties."""
    with np.errstate(all="ignore"):
        a, b = got[at].astype(np.float64), want[at].astype(np.float64)
        gap = np.abs(a - b)
    gap[np.isnan(gap)] = np.inf  # a NaN on one side, or infinities of opposite signs
    return int(at[int(np.argmax(gap))])


def _compare_with_tail(got, want, fill, static: bool) -> str | None:
    """Like compare_bitwise; a static mode may append all-padding rows (``fill``) at the end."""
    if static and got is not None and np.ndim(got) == np.ndim(want) and np.ndim(want) >= 1 \
            and np.shape(got)[0] > np.shape(want)[0] and np.shape(got)[1:] == np.shape(want)[1:]:
        got = np.asarray(got)
        m = np.shape(want)[0]
        head = compare_bitwise(got[:m], want)
        if head:
            return head
        tail = np.zeros_like(got[m:]) if fill == 0 else np.full_like(got[m:], fill)
        msg = compare_bitwise(got[m:], tail)
        return None if msg is None else f"trailing static rows (from row {m}): {msg}"
    return compare_bitwise(got, want)
