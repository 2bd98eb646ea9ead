"""Counting what the device path launches: kernels, collectives (``epkit.device``).

On a GPU every aten op that computes, copies or fills is a kernel launch (3 to 5 us of launch
cost each, before any byte moves), and every Triton launch is one more; a collective is a
round trip over the group. The budgets of docs/design.md ("Launch budget") are counted here,
on any machine: under ``EPKIT_KERNELS=triton`` on CPU the library takes the same device path
as on CUDA, so the same ops are issued::

    with count_launches() as n:
        d = epkit.dispatch(...)
    n.kernels, n.collectives, n.by_name   # e.g. 9, 2, Counter({"triton::_errors_kernel": 1, ...})

How: ``torch.profiler`` records every op the dispatcher runs, inside epkit's custom ops too (a
``TorchDispatchMode`` is switched off there), and every Triton launch is marked by a launch hook
(``triton::<kernel>``). The op tree is walked from its roots: a ``triton::`` mark is one kernel
(what the interpreter does inside it is not looked at), a ``c10d::`` op one collective, an aten
op that computes, copies or fills one kernel (its own children are its implementation, not
further launches); views, empty allocations and metadata ops launch nothing, and the ops that
may or may not copy (``to``, ``contiguous``, ``reshape``, ...) count what they delegate to.
Host waits (host reads and host-to-device copies) are :func:`epkit.hostreads.count_host_reads`'
job.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import torch

from . import triton as kernels
from .memory import HOST_WORK

__all__ = ["Launches", "count_launches", "LAUNCH_FREE", "DELEGATES"]

# aten ops that launch nothing on a GPU: views, allocations without a fill, metadata, and a
# scalar read (of host memory nothing; of device memory a host wait, count_host_reads' job).
LAUNCH_FREE = frozenset(f"aten::{n}" for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "set_", "view", "_unsafe_view", "as_strided", "slice", "select", "expand",
    "permute", "transpose", "t", "unsqueeze", "squeeze", "_reshape_alias", "alias", "diagonal",
    "movedim", "view_as", "narrow", "unbind", "split", "split_with_sizes", "chunk",
    "unflatten", "detach", "detach_", "lift_fresh", "lift_fresh_copy", "result_type",
    "_has_compatible_shallow_copy_type", "record_stream", "is_nonzero", "size", "stride",
    "resolve_conj", "resolve_neg", "_conj", "numpy_T", "expand_as", "broadcast_tensors",
    "_nested_tensor_from_mask_left_aligned", "pin_memory", "_pin_memory", "is_pinned",
    "item", "_local_scalar_dense",
))
# aten ops that launch only what they delegate to (a copy when one is needed).
DELEGATES = frozenset(f"aten::{n}" for n in (
    "to", "contiguous", "reshape", "flatten", "type_as", "atleast_1d", "repeat_interleave_",
))


@dataclass
class Launches:
    """What one counted region launched. ``by_name``: kernels and collectives by op name
    (``aten::where``, ``triton::_errors_kernel``, ``c10d::alltoall_base_``)."""

    aten: int = 0
    triton: int = 0
    collectives: int = 0
    by_name: collections.Counter = field(default_factory=collections.Counter)

    @property
    def kernels(self) -> int:
        """Device kernel launches: aten ops that launch plus Triton launches."""
        return self.aten + self.triton

    def add(self, events) -> None:
        """Count the profiler's ``events`` (their trees, walked from the roots), in the threads
        that run the program's code: a thread with an op, an autograd node or a Python frame
        besides bare aten ops. A gloo worker copying a collective's buffers on CPU runs bare
        aten ops in a thread of its own; it is the collective's work, counted once as the
        collective (NCCL does it in its kernel)."""
        ours = {e.thread for e in events
                if not e.name.startswith(("aten::", "gloo:", "nccl:", "record_param_comms"))}
        stack = [e for e in events if e.cpu_parent is None and e.thread in ours]
        while stack:
            e = stack.pop()
            name = e.name
            if name.startswith("triton::"):
                self.triton += 1
                self.by_name[name] += 1
            elif name.startswith("c10d::"):
                self.collectives += 1
                self.by_name[name] += 1
            elif name == HOST_WORK:  # host memory only: no launch on a GPU (memory.host_work)
                continue
            elif name.startswith("aten::") and name not in DELEGATES:
                if name not in LAUNCH_FREE:
                    self.aten += 1
                    self.by_name[name] += 1
            else:  # epkit ops, autograd nodes, annotations, delegating aten ops: look inside
                stack.extend(e.cpu_children)


@contextlib.contextmanager
def _marked_launches():
    """Mark every Triton launch in the profile as ``triton::<kernel name>``."""
    if not kernels.registered_keys():
        yield
        return
    from .triton import _runtime

    @contextlib.contextmanager
    def mark(kernel, grid, args, constexprs):
        fn = getattr(kernel, "fn", kernel)
        with torch.profiler.record_function(f"triton::{getattr(fn, '__name__', fn)}"):
            yield

    _runtime.LAUNCH_HOOKS.append(mark)
    try:
        yield
    finally:
        _runtime.LAUNCH_HOOKS.remove(mark)


@contextlib.contextmanager
def count_launches():
    """Count the kernel launches and collectives made inside, in every thread; yields a
    :class:`Launches`, filled when the context closes."""
    from torch.profiler import ProfilerActivity, profile

    counts = Launches()
    with _marked_launches(), profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("epkit.count_launches"):  # marks this thread
            yield counts
    counts.add(prof.events())
