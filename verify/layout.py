"""Dispatch's layout against the reference's: bit for bit (``exact``), or under ``reordered``
(rows inside an expert in any order, padding anywhere inside its segment), matched slot by slot
through ``row_src``; and why a layout that meets ``reordered`` is not exact."""

from __future__ import annotations

import numpy as np

from epkit.reference import payloads
from .cases import Case
from .compare import _compare_with_tail, compare_bitwise


def _slot_keys(src: np.ndarray, K: int, Tmax: int) -> np.ndarray:
    return (src[:, 0] * (Tmax + 1) + src[:, 1]) * (K + 1) + src[:, 2]


def _reordered_dispatch(got: dict, want, case: Case, padding: str):
    """Check one rank's dispatch under ``reordered``. Returns (messages [(output, text)],
    ``perm``): ``perm[m]`` is the reference row of the implementation's row ``m`` (-1 for
    padding or a row that matches none). The steps: the layout (counts, offsets, row_src's
    form), each row's slot found in the reference, where the slots sit, then the values."""
    msgs, layout = _reordered_layout(got, want, case)
    if layout is None:
        return msgs, None
    M, off_a, src = layout
    K, Tmax = case.topk, max(case.tokens) if case.tokens else 0
    perm, found = _slot_permutation(src, np.asarray(want.row_src), K, Tmax)
    problem = _misplaced_slot(src, perm, found, off_a, want, case.local_experts)
    if problem:
        msgs.append(("row_src", problem))
    msgs += _reordered_values(got, want, case, perm, src[:, 0] < 0, M, padding == "ignored")
    return msgs, perm


def _reordered_layout(got: dict, want, case: Case):
    """``(messages, (M, expert_offsets, row_src) or None)``: the layout's form: expert_x 2-D,
    tokens_per_expert the reference's, offsets ascending from 0 within M in multiples of align,
    row_src integers [M, 3]. None where the rest cannot be checked."""
    msgs, L = [], case.local_experts
    ex = got.get("expert_x")
    if ex is None or np.ndim(ex) != 2:
        return [("expert_x", "missing" if ex is None else f"shape {list(np.shape(ex))}, "
                 f"expected [M, {case.hidden}]")], None
    M = int(np.shape(ex)[0])
    msg = compare_bitwise(_ints(got.get("tokens_per_expert")), want.tokens_per_expert)
    if msg:
        msgs.append(("tokens_per_expert", msg))
    off_a = _ints(got.get("expert_offsets"))
    if off_a is None or off_a.shape != (L + 1,) or off_a.dtype != np.int64:
        msgs.append(("expert_offsets", "missing" if off_a is None else
                     f"{off_a.dtype} {list(off_a.shape)}, expected integers [{L + 1}]"))
        return msgs, None
    seg = np.diff(off_a)
    if off_a[0] != 0 or (seg < 0).any() or off_a[-1] > M:
        msgs.append(("expert_offsets", f"{off_a.tolist()} is not a layout of {M} rows "
                     "(starts at 0, ascending, ends at M or before, padding rows after it)"))
        return msgs, None
    if (seg % case.align).any():
        j = int(np.flatnonzero(seg % case.align)[0])
        msgs.append(("expert_offsets", f"expert {j}'s segment has {int(seg[j])} rows, not a "
                     f"multiple of align {case.align}"))
    src = _ints(got.get("row_src"))
    if src is None or src.shape != (M, 3) or src.dtype != np.int64:
        msgs.append(("row_src", "missing" if src is None else
                     f"{src.dtype} {list(src.shape)}, expected integers [{M}, 3]"))
        return msgs, None
    return msgs, (M, off_a, src)


def _slot_permutation(src: np.ndarray, wsrc: np.ndarray, K: int, Tmax: int):
    """``(perm, found)``: the reference row holding each implementation row's slot (by its
    (s, t, k) in row_src; -1 for padding or no match) and whether a real row matched."""
    wreal = wsrc[:, 0] >= 0
    real = src[:, 0] >= 0  # a padding row: source rank -1
    wkeys = _slot_keys(wsrc[wreal], K, Tmax)
    wrows = np.flatnonzero(wreal)
    order = np.argsort(wkeys, kind="stable")
    keys = _slot_keys(src, K, Tmax)
    pos = np.clip(np.searchsorted(wkeys[order], keys), 0, max(len(wkeys) - 1, 0))
    found = real & (len(wkeys) > 0)
    if len(wkeys):
        found &= wkeys[order][pos] == keys
    perm = np.where(found, wrows[order][pos] if len(wkeys) else -1, -1)
    return np.where(real & found, perm, -1), found


def _misplaced_slot(src, perm, found, off_a, want, L) -> str | None:
    """The first thing wrong with where the slots sit, or None: a slot the reference does not
    hold here, one held twice, one in another expert's segment, or slots missing."""
    M, wsrc = src.shape[0], np.asarray(want.row_src)
    real, wreal = src[:, 0] >= 0, wsrc[:, 0] >= 0
    expert_of = np.full(M, -1)  # which expert each row sits in (-1: after the last segment)
    for j in range(L):
        expert_of[off_a[j]:off_a[j + 1]] = j
    want_expert = np.full(len(wsrc), -1)
    for j in range(L):
        want_expert[want.expert_offsets[j]:want.expert_offsets[j + 1]] = j
    want_of = want_expert[np.maximum(perm, 0)] if len(want_expert) else np.full(M, -1)
    if (real & ~found).any():
        m = int(np.flatnonzero(real & ~found)[0])
        return f"row {m}: row_src {src[m].tolist()} is not a slot this rank holds in the reference"
    if len(np.unique(perm[real])) != int(real.sum()):
        vals, counts = np.unique(perm[real], return_counts=True)
        m = int(np.flatnonzero(real & (perm == vals[counts > 1][0]))[1])
        return f"row {m}: slot {src[m].tolist()} appears twice"
    if (real & (expert_of != want_of)).any():
        m = int(np.flatnonzero(real & (expert_of != want_of))[0])
        return (f"row {m}: slot {src[m].tolist()} sits in local expert {int(expert_of[m])}, "
                f"the reference puts it in expert {int(want_expert[perm[m]])}")
    if int(real.sum()) != int(wreal.sum()):
        missing = np.setdiff1d(np.flatnonzero(wreal), perm[real])
        return (f"{int(wreal.sum() - real.sum())} slots missing, e.g. "
                f"{wsrc[missing[0]].tolist()}" if len(missing) else "rows missing")
    return None


def _reordered_values(got, want, case, perm, pad, M, keep_pad) -> list:
    """The value outputs against the reference's rows placed in the implementation's layout
    by ``perm``; padding rows zero (or, ``keep_pad``: whatever the implementation holds)."""

    def in_layout(name, ref_rows):
        ref_rows = np.asarray(ref_rows)
        out = np.zeros((M, *ref_rows.shape[1:]), ref_rows.dtype)
        out[perm >= 0] = ref_rows[perm[perm >= 0]]
        g = got.get(name)
        if keep_pad and g is not None and np.shape(g) == out.shape:
            g = np.asarray(g)
            if g.dtype == out.dtype:
                out[pad] = g[pad]
        return out

    checks = [("expert_x", want.expert_x), ("row_weight", want.row_weight)]
    if case.payload is not None:
        checks.append(("expert_scale", want.expert_scale))
        if got.get("expert_x_hp") is not None:
            checks.append(("expert_x_hp", payloads.decode(case.payload, want.expert_x,
                                                          want.expert_scale)))
    msgs = []
    for name, w in checks:
        msg = compare_bitwise(got.get(name), in_layout(name, w))
        if msg:
            msgs.append((name, msg))
    if got.get("dropped_per_expert") is not None:
        msg = compare_bitwise(_ints(got["dropped_per_expert"]), want.dropped_per_expert)
        if msg:
            msgs.append(("dropped_per_expert", msg))
    return msgs


def _ints(a):
    """An integer array as int64 (reordered / bounded accept any integer dtype); else as is."""
    if a is None:
        return None
    a = np.asarray(a)
    return a.astype(np.int64) if a.dtype.kind in "iu" else a


def _exact_dispatch(got: dict, want, case: Case, static: bool, ref):
    checks = [
        ("tokens_per_expert", want.tokens_per_expert, None),
        ("expert_offsets", want.expert_offsets, None),
        ("row_src", want.row_src, -1),
        ("expert_x", want.expert_x, 0),
        ("row_weight", want.row_weight, 0),
    ]
    if case.payload is not None:
        checks.append(("expert_scale", want.expert_scale, 0))
        if got.get("expert_x_hp") is not None:  # dequantized rows, when offered
            checks.append(("expert_x_hp", payloads.decode(case.payload, want.expert_x,
                                                          want.expert_scale), 0))
    if got.get("dropped_per_expert") is not None:
        checks.append(("dropped_per_expert", want.dropped_per_expert, None))
    msgs = []
    for name, w, fill in checks:
        msg = _compare_with_tail(got.get(name), w, fill, static and fill is not None)
        if msg:
            msgs.append((name, msg))
    return msgs


def _not_exact_layout(got: dict, want) -> str:
    """Why a layout that meets ``reordered`` is not exact: integer outputs of another dtype,
    padding rows where the canonical layout has none or others, rows in another order."""
    narrow = [n for n in ("tokens_per_expert", "expert_offsets", "row_src", "dropped_per_expert")
              if got.get(n) is not None and np.asarray(got[n]).dtype != np.int64]
    reasons = [f"integer dtypes ({', '.join(f'{np.asarray(got[n]).dtype} {n}' for n in narrow)})"
               ] if narrow else []
    try:
        src = np.asarray(got.get("row_src")).astype(np.int64)
        wsrc = np.asarray(want.row_src)
        if src.shape == wsrc.shape and (src == wsrc).all():
            same = all(compare_bitwise(_ints(got.get(n)), getattr(want, n)) is None
                       for n in ("tokens_per_expert", "expert_offsets"))
            if same and narrow:
                return reasons[0]
        ours = src[(src >= 0).all(axis=1)]
        theirs = wsrc[wsrc[:, 0] >= 0]
        if ours.shape == theirs.shape and (ours == theirs).all():
            return ", ".join(reasons + ["padding rows"])
    except Exception:  # noqa: BLE001 - a reason only
        pass
    return ", ".join(reasons + ["row order inside experts"])
