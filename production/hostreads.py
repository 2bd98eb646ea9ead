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
``repeat_interleave`` without ``output_size``). The net is a torch function mode (:class:`_Net`),
nothing patched: it sees those methods and functions wherever they are called while the
context is open, inside epkit's custom ops and their backward passes too. On CUDA the context
also sets ``torch.cuda.set_sync_debug_mode("warn")`` and counts each synchronizing operation
the net did not see (one inside a C++ op: kind ``"cuda sync"``).
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

import os
import sys
import threading
import types as pytypes
import warnings
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

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
_STATE = threading.local()  # .inside: a counted read is running (its own inner reads are its)


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


# ---- the net: a torch function mode over the reads and uploads ----------------------------

def _first(args, kwargs):
    return args[0] if args else None


def _to_cpu(args, kwargs):
    """``t.to("cpu")`` and ``t.to(host tensor)`` read the host. ``t.to(u.device)`` does not
    count: on the interpreted path the device and the host are one ``torch.device``, and the
    idiom moves between tensors of one device (on CUDA no read)."""
    t, rest = args[0], list(args[1:]) + [kwargs.get("device")]
    for a in rest:
        if isinstance(a, str) and a.split(":")[0] == "cpu":
            return t
        if isinstance(a, torch.Tensor) and is_host(a):
            return t
    return None


def _device_target(a) -> bool:
    """Whether ``a`` (a ``.to`` / ``device=`` argument) names device memory: a CUDA device, a
    device-path tensor, or, where the Triton kernels stand in on CPU, a ``torch.device``
    (the idiom ``t.to(u.device)``; the string ``"cpu"`` names the host)."""
    if isinstance(a, torch.Tensor):
        return device_path(a)
    if isinstance(a, torch.device):
        return a.type == "cuda" or _device_active()
    return isinstance(a, str) and a.split(":")[0] == "cuda"


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
    return src if isinstance(src, torch.Tensor) and is_host(dst) else None


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


def _never(args, kwargs) -> bool:
    return False


_T = torch.Tensor
# function -> (kind, the tensor it reads or None); every read of the net
READS = {f: (kind, which) for fs, kind, which in (
    ((_T.item,), "item", _first), ((_T.tolist,), "tolist", _first),
    ((_T.numpy,), "numpy", _first), ((_T.cpu,), "cpu", _first),
    ((_T.__int__,), "int", _first), ((_T.__float__,), "float", _first),
    ((_T.__bool__,), "bool", _first), ((_T.__index__,), "index", _first),
    ((_T.nonzero, torch.nonzero), "nonzero", _first),
    ((_T.masked_select, torch.masked_select), "masked_select", _first),
    ((_T.bincount, torch.bincount), "bincount", _first),
    ((_T.unique, torch.unique), "unique", _first),
    ((_T.to,), "to cpu", _to_cpu), ((_T.copy_,), "copy to host", _copy_into_host),
    ((_T.__getitem__, _T.__setitem__), "mask index", _bool_index),
    ((_T.repeat_interleave, torch.repeat_interleave), "repeat_interleave", _unsized_repeat),
) for f in fs}
# function -> whether the call copies host data to the device
UPLOADS = {_T.to: _to_device, _T.copy_: _copy_from_host,
           torch.tensor: _made_on_device, torch.as_tensor: _made_on_device}


# Functions whose body is Python (so may read the host inside), which the net re-enters around:
# epkit's custom ops (a dispatcher entry whose kernel is Python), and Python functions and
# methods (torch.autograd.grad, Tensor.backward, Tensor.__repr__, ...). C++ builtins run no
# Python, so they are called as they are: cheaper, and torch._C._set_grad_enabled (every
# no_grad) must not be re-entered (the mode's own entry sets the grad mode).
_PYTHON_BODIES = (pytypes.FunctionType, pytypes.MethodType, torch._ops.OpOverload,
                  torch._ops.OpOverloadPacket)
# torch.overrides.redispatch_function (torch >= 2.12); without it the net sees only the calls
# made outside epkit's ops (docs/design.md, "Host reads")
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)


class _Net(TorchFunctionMode):
    """The net: sees every torch function and ``torch.Tensor`` method called while it is on
    this thread's mode stack, and counts the reads (:data:`READS`) and uploads
    (:data:`UPLOADS`) among them. Not a ``TorchDispatchMode``: a dispatch mode is switched off
    inside the ``torch.library.custom_op`` bodies where epkit's collectives and host reads
    run, and ``tolist`` / ``numpy`` never reach the dispatcher. A function mode is popped while
    its handler runs too, so the handler puts itself back around the calls whose body is
    Python (``redispatch_function``): the bodies of epkit's ops, their backward passes and the
    Triton kernels' launch code run under the net."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_STATE, "inside", False):
            upload = UPLOADS.get(func, _never)(args, kwargs)
            _record_upload(upload)
            read = READS.get(func)
            t = None if read is None else read[1](args, kwargs)
            if t is not None:
                record(read[0], t)
            if upload or t is not None:
                with quiet():  # what the read or copy does inside is itself (a CUDA sync too)
                    return func(*args, **kwargs)
        if (_REDISPATCH is None or torch.compiler.is_compiling()
                or not isinstance(func, _PYTHON_BODIES)):
            return func(*args, **kwargs)
        with self:
            return _REDISPATCH(func, types, args, kwargs)


SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda's text, set_sync_debug_mode
_SYNC_HOOK: dict = {}  # while any counter is open: what the hook replaced (one per process)


def _show_sync(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` while a counter is open: a CUDA sync torch reports is counted
    as a read (unless the net counted it already: a counted read runs quiet); any other
    warning is shown as before."""
    if SYNC_WARNING not in str(message):
        return _SYNC_HOOK["shown"](message, category, filename, lineno, file, line)
    if _ACTIVE and not getattr(_STATE, "inside", False):
        _append("cuda sync", *_where())
    return None


def _hook_syncs(first: bool) -> None:
    """Install (``first``: the first counter opens) or remove (the last closes) the CUDA sync
    hook, under _LOCK: ``set_sync_debug_mode("warn")`` where CUDA is already initialised (a
    counter does not initialise it), its warnings always shown, to :func:`_show_sync`."""
    if first:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        _SYNC_HOOK.update(shown=warnings.showwarning,
                          mode=torch.cuda.get_sync_debug_mode() if cuda else None)
        warnings.filterwarnings("always", message=SYNC_WARNING)
        _SYNC_HOOK["filter"] = warnings.filters[0]
        warnings.showwarning = _show_sync
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return
    if _SYNC_HOOK["mode"] is not None:
        torch.cuda.set_sync_debug_mode(_SYNC_HOOK["mode"])
    if warnings.showwarning is _show_sync:
        warnings.showwarning = _SYNC_HOOK["shown"]
    if _SYNC_HOOK["filter"] in warnings.filters:
        warnings.filters.remove(_SYNC_HOOK["filter"])
        getattr(warnings, "_filters_mutated", lambda: None)()
    _SYNC_HOOK.clear()


_ACTIVE_HERE = threading.local()  # .net: this thread's _Net while a counter is open in it


@contextmanager
def count_host_reads():
    """Count the host reads of would-be device memory made inside (this thread, and the
    autograd engine's work for it; :func:`to_host` and CUDA syncs in any thread); yields a
    :class:`Counter`. Nested counters each see every read."""
    counter = Counter()
    outer = getattr(_ACTIVE_HERE, "net", None)
    with _LOCK:
        if not _ACTIVE:
            _hook_syncs(True)
        _ACTIVE.append(counter)
    try:
        if outer is not None:
            yield counter
        else:
            _ACTIVE_HERE.net = _Net()
            try:
                with _ACTIVE_HERE.net:
                    yield counter
            finally:
                _ACTIVE_HERE.net = None
    finally:
        with _LOCK:
            _ACTIVE.remove(counter)
            if not _ACTIVE:
                _hook_syncs(False)
