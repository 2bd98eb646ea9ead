"""The buffers that never leave an op, owned by a :class:`epkit.Dispatcher` (DeepEP's ``Buffer``,
TransformerEngine's ``EpBuffer``): allocated on first use, grown when a call needs more,
reused by every later call, released on request.

Why: on the CPU a buffer above glibc's mmap threshold (32 MiB at most) is fresh pages on every
allocation, and touching them first costs about as much as the exchange that fills them
(docs/benchmarks.md, "out fresh"); the default workload's return path and pairs' rows are such
buffers. On CUDA the caching allocator reuses memory already; the workspace there gives the
same buffer (the same address) every call.

What lives here: every staging buffer of an exchange inside an op, both sides: the dispatch's
send buffer (``pack_into`` writes it) and receive buffer, the return path's (``gather_units``) of
combine and the dispatch backward, the combine backward's (``scatter_rows_into``). What never
does: any tensor an op returns or saves for backward (outputs alias nothing), the buffers of
the lazy schedule (several may be in flight at once) and those of hier and the quantized
payloads (allocated fresh: :func:`empty`, on the CPU on huge pages).

Two buffers serve every op, :data:`SEND` and :data:`RECV`, each as large as the largest side
of an exchange so far (DeepEP's one buffer, in two because an exchange reads one while it
writes the other). That is safe because a buffer is read only inside the op that filled it,
before that op returns, and the ops of one group never run at once in a process: dispatch,
combine and both backward passes hold the group's call lock (production/agree.py, ``serial``). So
the next step's forward may run before the last step's backward.

Ops find a Dispatcher's workspace by its key (an int, a constant under torch.compile); key -1
is no workspace (every buffer fresh: the functional ``epkit.dispatch`` / ``epkit.combine``).
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from typing import Callable, Optional

import torch

from . import _build

_build.load()  # empty's fresh path is an epkit op
_KEYS = itertools.count()
_LIVE: "weakref.WeakValueDictionary[int, Workspace]" = weakref.WeakValueDictionary()
SEND, RECV = "send", "recv"  # the two buffers: an exchange's send side and its receive side
GROWTH = 1.125   # a grown buffer gets this much headroom: routing-dependent sizes vary per step
ALIGN = 1 << 16  # and is rounded up to 64 KiB


class Workspace:
    """A Dispatcher's buffers, one per side (:data:`SEND`, :data:`RECV`) and device: ``take``
    returns a view of the side's buffer (grown when too small), ``release`` frees them all,
    ``nbytes`` is what is held."""

    def __init__(self):
        self.key = next(_KEYS)
        self._bufs: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()
        _LIVE[self.key] = self

    def take(self, side: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """``torch.empty(shape, dtype=dtype, device=device)``'s shape and dtype, in buffer
        ``side`` (:data:`SEND` or :data:`RECV`): its contents are whatever the last call left."""
        device = torch.device(device)
        need = math.prod(int(s) for s in shape) * dtype.itemsize
        with self._lock:
            buf = self._bufs.get((side, device))
            if buf is None or buf.numel() < need:
                size = -(-int(need * GROWTH) // ALIGN) * ALIGN
                self._bufs.pop((side, device), None)  # the old one is freed before the new one
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                self._bufs[(side, device)] = buf
        return buf[:need].view(dtype).view(tuple(int(s) for s in shape))

    def release(self) -> None:
        """Free every buffer (the next call allocates again)."""
        with self._lock:
            self._bufs.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._bufs.values())

    def buffers(self) -> list[torch.Tensor]:
        """The buffers held (for the tests that outputs alias none of them)."""
        with self._lock:
            return list(self._bufs.values())


def allocator(key: int, side: str) -> Optional[Callable]:
    """``alloc(shape, dtype, device)`` taking from workspace ``key``'s ``side`` buffer
    (:data:`SEND` or :data:`RECV`), or None
    (key -1, or a Dispatcher already gone): the caller allocates fresh."""
    ws = _LIVE.get(key) if key >= 0 else None
    if ws is None:
        return None
    return lambda shape, dtype, device: ws.take(side, shape, dtype, device)


def empty(alloc: Optional[Callable], shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A buffer on ``like``'s device: from ``alloc`` (an :func:`allocator`), else fresh
    (``epkit::empty_large``: on the CPU, 2 MiB and more on transparent huge pages, as the
    kernels' own large outputs; csrc/cpu/alloc.cpp)."""
    if alloc is None:
        return torch.ops.epkit.empty_large(like, [int(s) for s in shape], dtype)
    return alloc(tuple(shape), dtype, like.device)
