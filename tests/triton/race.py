"""The race checker: a launch hook (``_runtime.LAUNCH_HOOKS``) that, under Triton's interpreter,
records the bytes every program of a launch loads and stores, and fails the launch if two
programs write one byte, or a program reads a byte another program of the same launch writes.

Why: the interpreter runs programs one after another, so either race gives one fixed, plausible
answer here and an undefined one on a GPU (programs run concurrently; atomics are relaxed). The
rule the kernels keep (``_runtime.py``): one writer per output byte, and results cross programs
only through a second launch. Atomics count as a read and a write (the rule has no use for them).

How: while a launch runs, the interpreter's single builder (``interpreter_builder``) has its
``create_masked_load`` / ``create_masked_store`` (every load and store goes through them: plain,
masked, atomic load/store, tensor descriptors) and atomics wrapped on the instance; the current
program is the builder's ``grid_idx``. Each access becomes byte intervals (addresses of the
unmasked lanes, runs of consecutive elements merged, so a row is one interval); at the end of a
program they are merged into disjoint intervals; at the end of the launch, sorted intervals of
all programs are compared with NumPy (no per-byte sets). Same-program overlaps are never races.

Only programs are compared, so the tile sizes decide what can be seen: at the interpreter's
(large tiles, mostly one program a launch) a launch has little to compare; under
``_runtime.gpu_tiles()`` (``EPKIT_TILES=gpu`` for a whole run) the kernels take a GPU launch's
tiles and program counts, and two programs writing one row are two programs here too.
"""

from __future__ import annotations

import contextlib

import numpy as np


class RaceError(AssertionError):
    """Two programs of one launch write one byte, or one reads what another writes."""


def _runs(addresses: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) byte intervals of the elements at ``addresses`` (each ``size`` bytes), runs
    of consecutive elements (in the tile's order) joined."""
    a = addresses.astype(np.uint64, copy=False).ravel()
    if a.size == 1:
        return a, a + np.uint64(size)
    breaks = np.flatnonzero(np.diff(a) != np.uint64(size)) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [a.size - 1]))
    return a[first], a[last] + np.uint64(size)


def _merge(starts: list, ends: list) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted intervals covering the union (touching intervals joined)."""
    s = np.concatenate(starts)
    e = np.concatenate(ends)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.concatenate(([True], s[1:] > reach[:-1]))
    heads = np.flatnonzero(new)
    tails = np.concatenate((heads[1:] - 1, [s.size - 1]))
    return s[heads], reach[tails]


class _Recorder:
    def __init__(self, builder):
        self.builder = builder
        self.programs: list[tuple] = []  # grid index of each program that touched memory
        self.current = None
        self.pending = {"r": ([], []), "w": ([], [])}
        self.done = {"r": ([], [], []), "w": ([], [], [])}  # starts, ends, program numbers

    def note(self, kind: str, ptrs, mask) -> None:
        from triton.runtime.interpreter import _get_np_dtype

        idx = self.builder.grid_idx
        if idx != self.current:
            self.close()
            self.current = idx
        addresses = np.asarray(ptrs.data)
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
        if addresses.size == 0:
            return
        size = np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize
        s, e = _runs(addresses, size)
        self.pending[kind][0].append(s)
        self.pending[kind][1].append(e)

    def close(self) -> None:
        """End of the current program: its intervals merged, numbered."""
        if self.current is None:
            return
        number = len(self.programs)
        self.programs.append(self.current)
        for kind, (starts, ends) in self.pending.items():
            if starts:
                s, e = _merge(starts, ends)
                self.done[kind][0].append(s)
                self.done[kind][1].append(e)
                self.done[kind][2].append(np.full(s.size, number, dtype=np.int64))
        self.pending = {"r": ([], []), "w": ([], [])}
        self.current = None

    def _all(self, kind):
        starts, ends, progs = self.done[kind]
        if not starts:
            empty = np.zeros(0, dtype=np.uint64)
            return empty, empty, np.zeros(0, dtype=np.int64)
        s, e, p = np.concatenate(starts), np.concatenate(ends), np.concatenate(progs)
        order = np.argsort(s, kind="stable")
        return s[order], e[order], p[order]

    def first_race(self):
        """(kind, address, program a, program b) of the first race found, or None."""
        self.close()
        ws, we, wp = self._all("w")
        if ws.size > 1:
            reach = np.maximum.accumulate(we)
            hit = np.flatnonzero(ws[1:] < reach[:-1])
            if hit.size:  # each program's intervals are disjoint: an overlap is two programs
                i = int(hit[0]) + 1
                j = int(np.argmax(we[:i] > ws[i]))
                return "write-write", int(ws[i]), int(wp[j]), int(wp[i])
        rs, re_, rp = self._all("r")
        if ws.size == 0 or rs.size == 0:
            return None
        lo = np.searchsorted(we, rs, side="right")  # first write ending after the read's start
        hi = np.searchsorted(ws, re_, side="left")  # writes starting before the read's end
        overlapping = np.flatnonzero(lo < hi)
        for r in overlapping:
            others = np.flatnonzero(wp[lo[r]:hi[r]] != rp[r])
            if others.size:
                w = int(lo[r] + others[0])
                return "read-write", int(max(rs[r], ws[w])), int(rp[r]), int(wp[w])
        return None


def _describe(address: int, kernel, args) -> str:
    names = list(getattr(kernel, "arg_names", []))
    for i, arg in enumerate(args):
        if hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            base = storage.data_ptr()
            if base <= address < base + storage.nbytes():
                name = names[i] if i < len(names) else f"#{i}"
                return f"byte {address - base} of argument {name!r} ({tuple(arg.shape)} {arg.dtype})"
    return f"address {address:#x}"


@contextlib.contextmanager
def check_races(kernel, grid, args, constexprs):
    """Launch hook: raise RaceError after a launch whose programs race (interpreter only)."""
    from epkit.triton import _runtime

    if not _runtime.INTERPRETED:
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    recorder = _Recorder(builder)
    cls = type(builder)

    def load(ptrs, mask, other, cache_policy, is_volatile):
        recorder.note("r", ptrs, mask)
        return cls.create_masked_load(builder, ptrs, mask, other, cache_policy, is_volatile)

    def store(ptrs, value, mask, cache_policy):
        recorder.note("w", ptrs, mask)
        return cls.create_masked_store(builder, ptrs, value, mask, cache_policy)

    def atomic_cas(ptr, cmp, val, sem, scope):
        recorder.note("r", ptr, None)
        recorder.note("w", ptr, None)
        return cls.create_atomic_cas(builder, ptr, cmp, val, sem, scope)

    def atomic_rmw(op, ptr, val, mask, sem, scope):
        recorder.note("r", ptr, mask)
        recorder.note("w", ptr, mask)
        return cls.create_atomic_rmw(builder, op, ptr, val, mask, sem, scope)

    patched = {"create_masked_load": load, "create_masked_store": store,
               "create_atomic_cas": atomic_cas, "create_atomic_rmw": atomic_rmw}
    for name, fn in patched.items():
        setattr(builder, name, fn)
    try:
        yield
    finally:
        for name in patched:
            builder.__dict__.pop(name, None)
    race = recorder.first_race()
    if race:
        kind, address, a, b = race
        pa, pb = recorder.programs[a], recorder.programs[b]
        what = ("programs {} and {} both write" if kind == "write-write"
                else "program {} reads what program {} writes:")
        raise RaceError(f"{getattr(kernel, '__name__', kernel)} over grid {tuple(grid)}: "
                        f"{what.format(pa, pb)} {_describe(address, kernel, args)}")
