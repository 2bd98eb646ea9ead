"""The local-kernel part of ``epkit bench``: epkit's C++ kernels timed alone, in one process.

During one real epkit step (forward and backward, on the bench's group) every call to a C++
kernel (``torch.ops.epkit.*``: ``pack``, ``unpack``, ``gather_units``, ``reduce_tokens``,
``scatter_rows``, ``combine_backward_dest``, ...) is recorded on rank 0 with its real arguments.
Then, while the other ranks wait at a barrier, rank 0 replays each call on its own (median of
``reps`` calls) and times ``memcpy`` in the same process: so the kernels see exactly the
shapes, plans and routing of the benchmark, and nothing here depends on their signatures.

Achieved bandwidth = (bytes of the kernel's tensor arguments + bytes of its outputs) / time:
every array counted once, read or written; time = the best of ``reps`` calls (other processes
on the machine can only slow a call down; the median is kept too). ``memcpy`` is
``dst.copy_(src)`` of a buffer as large as ``pack``'s output into a preallocated destination,
counted as read + write;
``memcpy, fresh dst`` allocates the destination on every call as the kernels do, and pays the
first touch of freshly mapped pages when the buffer is large. Per kernel, ``out_fresh_ms`` is
that copy at the size of the kernel's first output (glibc maps a buffer over 32 MiB afresh on
every allocation): the part of the kernel's time that allocating and writing its output costs
at the least, so a kernel whose time is close to it is bound by first touch, not by its loops.

A kernel called more than once in a step is listed by call: ``gather_units`` (combine) and
``gather_units #2`` (dispatch backward), ``reduce_tokens`` likewise. ``pack_into``,
``gather_units`` and ``scatter_rows_into`` write into a buffer they are given (the
Dispatcher's workspace), so they have no fresh output to touch.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

# The kernels of a step; prepare and plan (count words, the plan) are host-side bookkeeping.
KERNELS = ("pack", "pack_into", "unpack", "gather_rows", "gather_units", "reduce_tokens",
           "scatter_rows", "scatter_rows_into",
           "combine_backward_dest", "gather_slot_values", "scatter_slot_values")


# The kernels that write a buffer they are given (the Dispatcher's workspace): no fresh output.
INTO = ("pack_into", "gather_units", "scatter_rows_into")


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class KernelRecorder:
    """While active, every ``ops.C.<name>(...)`` call made by epkit is noted as
    ``(name, op, args, kwargs, bytes, first output's bytes)``, ``bytes`` = arguments + outputs."""

    def __init__(self, timeline: list = None):
        self.calls: list[tuple] = []
        self.timeline = timeline  # with a list: ("kernel", call) appended in order too

    @contextlib.contextmanager
    def active(self):
        from epkit import ops

        real = ops.C
        calls, timeline = self.calls, self.timeline

        class _Proxy:
            def __getattr__(self, name):
                op = getattr(real, name)

                def call(*args, **kwargs):
                    # the arguments as they are now: a workspace buffer (epkit/workspace.py) is
                    # overwritten by the step's later exchanges, so a replay reads a copy
                    saved = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
                    out = op(*args, **kwargs)
                    args = saved
                    first = 0 if name in INTO else _nbytes(
                        out[0] if isinstance(out, (list, tuple)) else out)
                    calls.append((name, op, args, kwargs, _nbytes(args) + _nbytes(out), first))
                    if timeline is not None:
                        timeline.append(("kernel", calls[-1]))
                    return out

                return call

        # modules holding ``C`` as a global; epkit.payloads reads ``ops.C`` at call time
        names = ("epkit.ops", "epkit.moves", "epkit.lazy", "epkit.api", "epkit.hier")
        mods = [m for m in (sys.modules.get(n) for n in names)
                if m is not None and getattr(m, "C", None) is real]
        proxy = _Proxy()
        for m in mods:
            m.C = proxy
        try:
            yield self
        finally:
            for m in mods:
                m.C = real


def _times(fn, reps: int) -> tuple[float, float]:
    """``(best, median)`` seconds of ``reps`` calls after one untimed call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def replay(calls: list[tuple], reps: int, threads: int) -> dict:
    """Time every recorded kernel call alone, and memcpy, at ``threads`` threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seen: dict[str, int] = {}
        rows = {}
        big = torch.zeros((max([n for *_, n in calls] + [1]),), dtype=torch.uint8)
        for name, op, args, kwargs, nbytes, nout in calls:
            if name not in KERNELS:
                continue
            seen[name] = seen.get(name, 0) + 1
            label = name if seen[name] == 1 else f"{name} #{seen[name]}"
            best, med = _times(lambda: op(*args, **kwargs), reps)
            part = big[:nout]  # no output (INTO: writes a given buffer): no first touch
            fresh = _times(lambda: torch.empty_like(part).copy_(part), reps)[0] if nout else 0.0
            rows[label] = {"best_ms": 1e3 * best, "median_ms": 1e3 * med, "bytes": int(nbytes),
                           "gbps": nbytes / best / 1e9, "out_fresh_ms": 1e3 * fresh}
        del big
        # memcpy of the pack's send buffer: pack's first output, or the buffer pack_into fills
        pack_out = next((n if name == "pack" else _nbytes(args[-1])
                         for name, op, args, kwargs, _, n in calls
                         if name in ("pack", "pack_into")), 1 << 24)
        src = torch.randint(0, 255, (max(pack_out, 1),), dtype=torch.uint8)
        dst = torch.empty_like(src)
        memcpy = 2 * src.numel() / _times(lambda: dst.copy_(src), reps)[0] / 1e9
        fresh = 2 * src.numel() / _times(lambda: torch.empty_like(src).copy_(src), reps)[0] / 1e9
        for r in rows.values():
            r["vs_memcpy"] = r["gbps"] / memcpy
        return {"threads": threads, "memcpy_bytes": src.numel(), "memcpy_gbps": memcpy,
                "memcpy_fresh_gbps": fresh, "rows": rows}
    finally:
        torch.set_num_threads(saved)
