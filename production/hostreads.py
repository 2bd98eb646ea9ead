"""Counting the host reads of would-be device memory on the device path (``epkit.device``).

On CUDA a host read of device memory is a wait for the stream; the design allows one per eager
dispatch (the plan's pinned mirror) and none in combine, the backward passes and the static
exchange (docs/design.md, "Host reads"). Under ``EPKIT_KERNELS=triton`` on CPU the library
takes the same device path (:func:`epkit.device.device_path`), so :func:`count_host_reads`
proves those counts on any machine::

    with count_host_reads() as reads:
        d = epkit.dispatch(...)
    reads.by_op()  # {"count_exchange": 1}

What counts, on a tensor the device path treats as device memory (not host-marked,
:func:`epkit.device.mark_host`): :func:`epkit.device.to_host` (production's one intended way to
read the device), and, as a net for reads that bypass it, ``.item()``, ``int()``, ``float()``,
``bool()``, ``operator.index()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")`` (not
``.to(device)``: on the interpreted path host and device are one ``torch.device``), ``copy_``
into host memory, and the ops whose output size depends on the data (a host wait on
CUDA: ``nonzero``, a boolean mask index, ``masked_select``, ``bincount``, ``unique``,
``repeat_interleave`` without ``output_size``). The net patches ``torch.Tensor`` methods for the
duration of the context, not a ``TorchDispatchMode``: a mode is switched off inside the
``torch.library.custom_op`` bodies where epkit's collectives run, so it would see none of them.
Each read is attributed to the innermost epkit operation on the stack (:data:`OPS`).

A host-to-device copy is a wait too (from pageable memory a copy to the GPU is synchronous on
CUDA, and a CUDA-graph capture forbids it), so the counter counts them with the reads (kind
``"host-to-device copy"``): ``.to(device)`` or ``copy_`` of a host tensor (marked by
:func:`mark_host`) into device memory, and a tensor made from Python or NumPy data on a device
(``torch.tensor(data, device=...)``, ``torch.as_tensor``) by epkit's own code. On the
interpreted path host and device are one ``torch.device``, so the copy is counted where it
would happen on CUDA even though nothing is copied here.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from contextlib import contextmanager
from typing import NamedTuple

import torch

from . import triton as kernels
from .memory import device_path, is_host, mark_host

__all__ = ["Read", "Counter", "count_host_reads", "record", "quiet", "to_host", "OPS"]

# (module file, qualified function name) -> the operation a read inside it belongs to; the
# innermost match on the stack wins (the call header inside a combine is the call header's).
OPS = {
    ("agree.py", "agree"): "call header",
    ("agree.py", "raise_pending"): "call header",
    ("count_exchange.py", "count_exchange"): "count_exchange",
    ("count_exchange.py", "_on_device"): "count_exchange",
    ("hier.py", "gather_plan"): "count_exchange",
    ("ops.py", "prepare_dispatch"): "dispatch_tokens",
    ("ops.py", "dispatch_tokens"): "dispatch_tokens",
    ("api.py", "Dispatcher._dispatch"): "dispatch_tokens",
    ("lazy.py", "issue_dispatch"): "dispatch_tokens",
    ("lazy.py", "_DispatchWait.forward"): "dispatch_tokens",
    ("__init__.py", "_QuantizedDispatch.forward"): "dispatch_tokens",
    ("hier.py", "dispatch"): "dispatch_tokens",
    ("ops.py", "combine_tokens"): "combine_tokens",
    ("api.py", "Dispatcher.combine"): "combine_tokens",
    ("lazy.py", "issue_combine"): "combine_tokens",
    ("lazy.py", "_CombineWait.forward"): "combine_tokens",
    ("hier.py", "_Combine.forward"): "combine_tokens",
    ("ops.py", "dispatch_tokens_backward"): "dispatch_tokens_backward",
    ("lazy.py", "_DispatchWait.backward"): "dispatch_tokens_backward",
    ("__init__.py", "_QuantizedDispatch.backward"): "dispatch_tokens_backward",
    ("hier.py", "_Dispatch.backward"): "dispatch_tokens_backward",
    ("ops.py", "combine_tokens_backward"): "combine_tokens_backward",
    ("lazy.py", "_CombineWait.backward"): "combine_tokens_backward",
    ("hier.py", "_Combine.backward"): "combine_tokens_backward",
    ("deferred.py", "check_static"): "check_static",
}

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# the reading functions (hostreads.py, plan.py, count_exchange.py)
_READERS = ("to_host", "_pinned_copy", "host_words")


class Read(NamedTuple):
    """One host read: the epkit operation it belongs to (``"other"`` outside them), how it read
    (``to_host``, ``item``, ``tolist``, ``nonzero``, ...) and the epkit line that read."""

    op: str
    kind: str
    where: str


class Counter:
    """The reads seen while its :func:`count_host_reads` context is open."""

    def __init__(self):
        self.reads: list[Read] = []
        self._taken = 0

    def take(self) -> list[Read]:
        """The reads since the last ``take`` (a phase of a test: dispatch, combine, ...)."""
        out, self._taken = self.reads[self._taken:], len(self.reads)
        return out

    @staticmethod
    def by_op(reads) -> dict:
        """``{operation: reads}`` of ``reads``."""
        out: dict = {}
        for r in reads:
            out[r.op] = out.get(r.op, 0) + 1
        return out


_ACTIVE: list[Counter] = []
_LOCK = threading.Lock()
_STATE = threading.local()  # .inside: a patched read is running (its own inner reads are its)


def _where() -> tuple[str, str]:
    """``(operation, file:line)`` of the innermost epkit frame that maps to an operation."""
    frame, line = sys._getframe(2), None
    while frame is not None:
        code = frame.f_code
        path = os.path.abspath(code.co_filename)
        if path.startswith(_PACKAGE) and os.path.basename(path) != "hostreads.py":
            here = f"{os.path.relpath(path, _PACKAGE)}:{frame.f_lineno}"
            if code.co_qualname not in _READERS:  # the line that asked, not the reader's
                line = line or here
            op = OPS.get((os.path.basename(path), code.co_qualname))
            if op is not None:
                return op, line
        frame = frame.f_back
    return "other", line or "?"


def record(kind: str, t) -> None:
    """Count a host read of ``t`` if it is would-be device memory and a counter is open."""
    if not _ACTIVE or getattr(_STATE, "inside", False):
        return
    if not device_path(t):
        return
    _append(kind, *_where())


def _append(kind: str, op: str, where: str) -> None:
    for c in list(_ACTIVE):
        c.reads.append(Read(op, kind, where))


def _device_active() -> bool:
    """Whether there is a device path at all: CUDA, or the Triton kernels on CPU."""
    return torch.cuda.is_available() or "CPU" in kernels.registered_keys()


def _record_upload(dst_on_device: bool) -> None:
    """Count a host-to-device copy made by epkit's code (a line of the package on the stack)."""
    if not _ACTIVE or getattr(_STATE, "inside", False) or not dst_on_device:
        return
    op, where = _where()
    if where != "?":
        _append("host-to-device copy", op, where)


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """``t`` in host memory: ``t`` itself off the device path (CPU, the mirror), else a copy, a
    host wait on CUDA (into pinned memory with ``pinned``; a plain CPU copy stands in on the
    interpreted path). Every host read of device memory epkit means to make goes through here,
    so :func:`count_host_reads` counts it."""
    if not device_path(t):
        return t
    record("to_host", t)
    with quiet():
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            host.copy_(t)  # blocking device-to-host copy: the host waits for the stream here
        else:
            host = t.clone()
    return mark_host(host)


@contextmanager
def quiet():
    """Reads inside are not counted (the caller counted its read already)."""
    before = getattr(_STATE, "inside", False)
    _STATE.inside = True
    try:
        yield
    finally:
        _STATE.inside = before


# ---- the net: torch.Tensor methods and torch functions that read the host --------------------

def _counted(kind: str, fn, which=lambda args, kwargs: args[0] if args else None):
    @functools.wraps(fn)
    def read(*args, **kwargs):
        t = which(args, kwargs)
        if t is not None:
            record(kind, t)
        with quiet():
            return fn(*args, **kwargs)
    return read


def _to_cpu(args, kwargs):
    """``t.to("cpu")`` and ``t.to(host tensor)`` read the host. ``t.to(u.device)`` does not
    count: on the interpreted path the device and the host are one ``torch.device``, and the
    idiom moves between tensors of one device (on CUDA no read)."""
    t, rest = args[0], list(args[1:]) + [kwargs.get("device")]
    for a in rest:
        if isinstance(a, str) and a.split(":")[0] == "cpu":
            return t
        if isinstance(a, torch.Tensor) and _host_target(a):
            return t
    return None


def _host_target(t) -> bool:
    return is_host(t)


def _device_target(a) -> bool:
    """Whether ``a`` (a ``.to`` / ``device=`` argument) names device memory: a CUDA device, a
    device-path tensor, or, where the Triton kernels stand in on CPU, a ``torch.device``
    (the idiom ``t.to(u.device)``; the string ``"cpu"`` names the host)."""
    if isinstance(a, torch.Tensor):
        return device_path(a)
    if isinstance(a, torch.device):
        return a.type == "cuda" or _device_active()
    return isinstance(a, str) and a.split(":")[0] == "cuda"


def _uploading(fn, is_upload):
    """Wrap ``fn``: count a host-to-device copy when ``is_upload(args, kwargs)``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _record_upload(is_upload(args, kwargs))
        return fn(*args, **kwargs)
    return wrapper


def _to_device(args, kwargs) -> bool:
    t = args[0]
    return (isinstance(t, torch.Tensor) and is_host(t)
            and any(_device_target(a) for a in list(args[1:]) + [kwargs.get("device")]))


def _copy_from_host(args, kwargs) -> bool:
    dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    return isinstance(src, torch.Tensor) and is_host(src) and device_path(dst)


def _made_on_device(args, kwargs) -> bool:
    """``torch.tensor(data, device=...)`` / ``torch.as_tensor``: host data onto a device."""
    data = args[0] if args else kwargs.get("data")
    return not isinstance(data, torch.Tensor) and _device_target(kwargs.get("device"))


def _copy_into_host(args, kwargs):
    dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    return src if isinstance(src, torch.Tensor) and _host_target(dst) else None


def _bool_index(args, kwargs):
    """``t[mask]`` / ``t[mask] = v``: a boolean tensor index has a data-dependent size."""
    idx = args[1]
    parts = idx if isinstance(idx, tuple) else (idx,)
    hit = [p for p in parts if isinstance(p, torch.Tensor) and p.dtype == torch.bool]
    return hit[0] if hit else None


def _unsized_repeat(args, kwargs):
    """``repeat_interleave`` of tensor repeats without ``output_size`` (the one-argument form:
    the input is the repeats) sizes its output from the data."""
    if kwargs.get("output_size") is not None:
        return None
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    return repeats if isinstance(repeats, torch.Tensor) else None


_TENSOR_READS = {
    "item": "item", "tolist": "tolist", "numpy": "numpy", "cpu": "cpu",
    "__int__": "int", "__float__": "float", "__bool__": "bool", "__index__": "index",
    "nonzero": "nonzero", "masked_select": "masked_select", "bincount": "bincount",
    "unique": "unique",
}
_TORCH_READS = {"nonzero": "nonzero", "masked_select": "masked_select",
                "bincount": "bincount", "unique": "unique"}


def _install() -> list:
    """Patch the net in; returns what to put back."""
    saved = []

    def patch(owner, name, wrapper):
        saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name))))
        setattr(owner, name, wrapper)

    for name, kind in _TENSOR_READS.items():
        patch(torch.Tensor, name, _counted(kind, getattr(torch.Tensor, name)))
    for name, kind in _TORCH_READS.items():
        patch(torch, name, _counted(kind, getattr(torch, name)))
    patch(torch.Tensor, "to", _uploading(_counted("to cpu", torch.Tensor.to, _to_cpu),
                                         _to_device))
    patch(torch.Tensor, "copy_", _uploading(
        _counted("copy to host", torch.Tensor.copy_, _copy_into_host), _copy_from_host))
    for name in ("tensor", "as_tensor"):
        patch(torch, name, _uploading(getattr(torch, name), _made_on_device))
    patch(torch.Tensor, "__getitem__", _counted("mask index", torch.Tensor.__getitem__,
                                                _bool_index))
    patch(torch.Tensor, "__setitem__", _counted("mask index", torch.Tensor.__setitem__,
                                                _bool_index))
    patch(torch.Tensor, "repeat_interleave",
          _counted("repeat_interleave", torch.Tensor.repeat_interleave, _unsized_repeat))
    patch(torch, "repeat_interleave",
          _counted("repeat_interleave", torch.repeat_interleave, _unsized_repeat))
    return saved


_SAVED: list = []


@contextmanager
def count_host_reads():
    """Count the host reads of would-be device memory made inside, in every thread; yields a
    :class:`Counter`. Nested and concurrent counters each see every read."""
    counter = Counter()
    with _LOCK:
        if not _ACTIVE:
            _SAVED[:] = _install()
        _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        with _LOCK:
            _ACTIVE.remove(counter)
            if not _ACTIVE:
                for owner, name, value in reversed(_SAVED):
                    setattr(owner, name, value)
                _SAVED.clear()
