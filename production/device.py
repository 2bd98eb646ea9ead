"""epkit on CUDA: where the plan lives, the one host wait, and the lazy form's side stream.

Off the *device path* (:func:`device_path`: CUDA tensors, or any tensor not in host memory under
``EPKIT_KERNELS=triton``, where the interpreted Triton kernels stand in for the GPU's) every
function here is the identity or a no-op, so the default CPU path does what it always did. On
it, every host read of device memory goes through :func:`to_host`, which
:func:`count_host_reads` counts (epkit/hostreads.py; docs/design.md, "Host reads").

**The plan.** ``count_exchange`` all-gathers the count words on their device (NCCL) and computes
the plan there (``epkit::plan`` has a CUDA kernel), so on CUDA the plan is a device tensor that
the CUDA kernels read in place. The Python side reads a few plan words on the host (sizes, the
all-to-all split sizes); it reads them from the plan's *host mirror*, a CPU tensor attached to
the device plan (:func:`host_plan`):

- eager exchanges (ragged, padded, equal, auto, lazy): the mirror is the whole plan, copied once
  into pinned host memory. That copy is the one host wait of a dispatch; combine and both
  backward passes reuse the mirror and wait for nothing.
- static: no host wait at all (CUDA-graph capturable). The mirror is the plan of a routing-free
  template (every rank with this rank's ``H``, ``K``, dtype and payload, and zero counts): exactly
  the plan's routing-independent words, which are all the static exchange reads on the host. The
  group's error, if any, stays on the device: under an erroneous plan the kernels move no token
  (every chunk empty, ``expert_x`` all padding, combine zeros), and :func:`check_static` raises
  it on the host (a host wait) when the caller asks.

``EPKIT_HOST_PLAN=1`` computes an eager plan with the CPU kernel instead (the gathered words
copied to pinned memory: the same one host wait), a fallback should the device plan be in doubt.

**Unpack's checks.** The CPU unpack raises when the received chunks disagree with the plan; the
CUDA unpack cannot without a host wait. There such a mismatch writes every output of that call
in its "nothing received" form (``expert_x`` zeros, ``row_src`` -1, ``row_weight`` 0,
``recv_map`` -1: never uninitialised rows) and sets bits in a sticky status word of the device.
:func:`check_static` reads that word together with the plan's error words (one host wait, as
before) and raises :class:`UnpackMismatch` if any bit is set; :func:`unpack_status` reads (and
clears) it alone. ``EPKIT_CUDA_CHECKS=1`` makes every CUDA unpack read its own status and raise
at once (a host wait per call).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["HOST", "device_path", "mark_host", "is_host", "to_host", "host_plan",
           "count_exchange", "check_static", "unpack_status", "UnpackMismatch", "Side",
           "count_host_reads"]

HOST = "_epkit_host"  # attribute of a device plan: its host mirror
HOST_MEMORY = "_epkit_host_memory"  # attribute of a tensor in host memory on the device path


def device_path(t) -> bool:
    """Whether ``t`` is device memory as far as epkit's Python is concerned, so that reading it
    on the host is a wait (the *device path*): a CUDA tensor, or, with the Triton kernels
    registered for CPU (``EPKIT_KERNELS=triton``, interpreted), any CPU tensor not marked as
    host memory (:func:`mark_host`: the plan's mirror, the call header on a CPU backend). So
    the interpreted path takes the CUDA path's branches: the plan's host mirror, no host read
    of a device word except through :func:`to_host`. Streams, graphs and NCCL stay keyed on
    real CUDA (``t.is_cuda``)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and _interpreted() and not is_host(t)


def _interpreted() -> bool:
    from . import triton

    return "CPU" in triton.registered_keys()


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` (and so its views) as host memory on the device path; returns ``t``."""
    setattr(t, HOST_MEMORY, True)
    return t


def is_host(t: torch.Tensor) -> bool:
    """``t`` or the tensor it views was marked by :func:`mark_host`."""
    base = t._base
    return getattr(t, HOST_MEMORY, False) or (base is not None and
                                              getattr(base, HOST_MEMORY, False))


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """``t`` in host memory: ``t`` itself off the device path (CPU, the mirror), else a copy, a
    host wait on CUDA (into pinned memory with ``pinned``; a plain CPU copy stands in on the
    interpreted path). Every host read of device memory epkit means to make goes through here,
    so :func:`count_host_reads` counts it."""
    if not device_path(t):
        return t
    from . import hostreads

    hostreads.record("to_host", t)
    with hostreads.quiet():
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            host.copy_(t)  # blocking device-to-host copy: the host waits for the stream here
        else:
            host = t.clone()
    return mark_host(host)


def count_host_reads():
    """A context counting the host reads of device memory on the device path (epkit/hostreads.py)."""
    from .hostreads import count_host_reads as counting

    return counting()


def host_plan(plan: torch.Tensor) -> torch.Tensor:
    """The plan's words on the host: the plan itself on CPU; on the device path its mirror (a
    copy with a host wait, should a plan have lost it: correct, and counted by
    :func:`count_host_reads`)."""
    if not device_path(plan):
        return plan
    mirror = getattr(plan, HOST, None)
    return mirror if mirror is not None else to_host(plan)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return to_host(t, pinned=True)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory where there is CUDA (else itself), marked as host."""
    return mark_host(t.pin_memory() if torch.cuda.is_available() else t)


TEMPLATE = "_epkit_template"  # attribute of a mirror that is a routing-free template


def _template(R: int, W: int, args, shape=(0, 0, 0, 0)) -> torch.Tensor:
    """The plan (CPU kernel) of a routing-free template, as a host mirror: every rank with zero
    counts and ``shape`` = ``[H, K, dtype code, payload]``: exactly the plan's
    routing-independent words (ranks, experts, capacity, the static caps). Marked as a template
    (:data:`TEMPLATE`: epkit.moves.may_drop then answers "a capacity is set")."""
    from . import ops
    from epkit.reference import abi

    template = mark_host(torch.zeros((R, W), dtype=torch.int64))
    F = {f: i for i, f in enumerate(abi.WORD_FIELDS)}
    for field, value in zip(("hidden", "topk", "x_dtype", "payload"), shape):
        template[:, F[field]] = int(value)
    mirror = mark_host(ops.C.plan(template, *args))
    setattr(mirror, TEMPLATE, True)
    return mirror


def count_exchange(words: torch.Tensor, group, rank: int, num_experts: int, align: int,
                   capacity: int, transport: int, exchange: int, max_tokens_per_rank: int,
                   static_shape: Optional[list] = None,
                   topk_idx: Optional[torch.Tensor] = None,
                   capacity_factor: float = -1.0) -> torch.Tensor:
    """``epkit::count_exchange`` for device words: the device plan with its host mirror attached;
    raises the group's :class:`epkit.InputError` (eager exchanges; static: see the module).

    Host reads (docs/design.md, "Host reads"): one for an eager exchange, the mirror. dedup with
    a capacity gathers the token rows (ops.token_rows_gather) and plans again whether or not a
    slot was dropped (the words equal tokens_per_rank when nothing was, so the plan is the
    same), so the one copy carries the final plan and the first plan's error words. A
    ``capacity_factor`` needs the gathered counts on the host: they are the one read, and the
    plan is made there (a second read only for dedup's token rows when a slot was dropped).
    static: no host read, unless a ``capacity_factor`` is set."""
    import torch.distributed as dist

    from . import ops
    from .collectives import all_gather
    from epkit.reference.errors import error

    R = dist.get_world_size(group)
    gathered = words.new_empty((R * words.shape[0],))
    all_gather(gathered, words.contiguous(), group, "epkit.dispatch (count exchange)")
    host_words = None
    if capacity_factor > 0:  # the gathered counts decide the capacity: read them once
        host_words = _pinned_copy(gathered).view(R, -1)
        capacity = ops._factor_capacity(host_words, num_experts, capacity_factor)
    args = (rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank)
    static = max_tokens_per_rank >= 0
    planned_rows = False  # dedup's token rows gathered and planned already
    if static:
        plan = ops.C.plan(gathered.view(R, -1), *args)
        if static_shape is None:
            raise ValueError("epkit: the static exchange on CUDA needs the dispatch's static_shape "
                             "[H, K, dtype code, payload] to size its chunks without a host wait")
        mirror = _template(R, words.shape[0], args, static_shape)
        if transport == ops.DEDUP and capacity >= 0:
            setattr(plan, HOST, mirror)  # may_drop: a capacity is set
            words2 = ops.token_rows_gather(gathered, plan, topk_idx, group, R, num_experts)
            plan = ops.C.plan(words2, *args)
    elif host_words is not None or os.environ.get("EPKIT_HOST_PLAN") == "1":
        if host_words is None:
            host_words = _pinned_copy(gathered).view(R, -1)  # the one host wait
        mirror = _pinned(ops.C.plan(host_words, *args))
        plan = (mirror.to(words.device, non_blocking=True) if words.is_cuda else mirror.clone())
    elif transport == ops.DEDUP and capacity >= 0:
        first = ops.C.plan(gathered.view(R, -1), *args)
        setattr(first, HOST, _template(R, words.shape[0], args))  # may_drop: a capacity is set
        plan = ops.C.plan(ops.token_rows_gather(gathered, first, topk_idx, group, R,
                                                num_experts), *args)
        # the one host wait: the first plan's error words (the group's error, raised before
        # anything that the token rows' plan might say) and the final plan, in one copy
        both = _pinned_copy(torch.cat([first[: ops.ERR_RANK + 1], plan]))
        _raise(both, error)
        mirror = both[ops.ERR_RANK + 1:]
        planned_rows = True
    else:
        plan = ops.C.plan(gathered.view(R, -1), *args)
        mirror = _pinned_copy(plan)  # the one host wait of an eager dispatch
    setattr(plan, HOST, mirror)
    if not static:
        _raise(mirror, error)
        if transport == ops.DEDUP and not planned_rows and int(mirror[ops.DROPPED_ANY]):
            words2 = ops.token_rows_gather(gathered, plan, topk_idx, group, R, num_experts)
            plan = ops.C.plan(words2, *args)
            setattr(plan, HOST, _pinned_copy(plan))  # a second host wait, only with drops
    return plan


def _raise(mirror: torch.Tensor, error) -> None:
    """Raise the error the plan's host words carry, if any."""
    from . import ops

    code = int(mirror[ops.ERR_CODE])
    if code:
        raise error(int(mirror[ops.ERR_RANK]), code, int(mirror[ops.ERR_A]),
                    int(mirror[ops.ERR_B]))


class UnpackMismatch(RuntimeError):
    """A CUDA unpack found received chunks that disagree with the plan (a deferred error: that
    call's outputs were written as if nothing had been received). ``bits``: the status bits
    (1 in-band count, 2 in-band slot count, 4 rows, 8 slot row, 16 expert row, 32 plan shape or
    sizes, 64 expert total; epkit.triton.unpack.STATUS_BITS)."""

    def __init__(self, bits: int):
        self.bits = int(bits)
        super().__init__(f"epkit.unpack: received chunks disagreed with the plan on CUDA (status "
                         f"bits {self.bits:#x}); that unpack's outputs were zero-filled")


def _status_word(device: torch.device) -> Optional[torch.Tensor]:
    """The device's sticky unpack status word (int32 [1]), kept by the Triton unpack
    (epkit.triton.unpack.status_word); None off CUDA (a CPU unpack raises at once instead) or
    where Triton is not importable (then no epkit unpack runs on CUDA)."""
    if device.type != "cuda":
        return None
    try:
        from .triton.unpack import status_word
    except ImportError:
        return None
    return status_word(device)


def unpack_status(device=None, clear: bool = True) -> int:
    """The CUDA unpack status bits of ``device`` (default: the current CUDA device) since they
    were last cleared: 0 when every unpack matched its plan. A host wait; ``clear`` zeroes the
    word (on the stream, no wait). 0 on CPU or without CUDA kernels."""
    if device is None:
        if not torch.cuda.is_available():
            return 0
        device = torch.device("cuda", torch.cuda.current_device())
    word = _status_word(torch.device(device))
    if word is None:
        return 0
    bits = int(to_host(word)[0])
    if bits and clear:
        word.zero_()
    return bits


def check_static(dispatch_or_plan) -> None:
    """Raise the group's :class:`epkit.InputError` if a static-exchange dispatch on CUDA had one
    (its plan carries it on the device), else :class:`UnpackMismatch` if a CUDA unpack on the
    plan's device found chunks that disagree with their plan since the last check (the word is
    then cleared). One host wait for both (it waits for the stream). A no-op on CPU. First,
    the call headers agreed on the device during CUDA-graph capture (epkit/agree.py) raise
    their error, if one has."""
    from . import agree, ops
    from epkit.reference.errors import error

    plan = getattr(dispatch_or_plan, "_plan", dispatch_or_plan)
    group = getattr(getattr(dispatch_or_plan, "_config", None), "group", None)
    agree.raise_pending(group)  # call headers agreed on the device during graph capture
    head = plan[: ops.ERR_RANK + 1]
    word = _status_word(plan.device)
    if word is not None:  # one copy to the host: the error words and the status together
        head = torch.cat([head, word.to(torch.int64)])
    words = to_host(head).tolist()
    code, a, b, rank = words[:4]
    if code:
        raise error(int(rank), int(code), int(a), int(b))
    if word is not None and words[4]:
        word.zero_()
        raise UnpackMismatch(words[4])


_SIDE_STREAMS: dict = {}


class Side:
    """The lazy form's side stream on CUDA; on CPU a no-op.

    ``with Side(*inputs) as side:`` runs the issue on a side stream that first waits for the
    current stream (the inputs are then in use there: ``record_stream``); ``side.wrap(finish,
    *made)`` returns ``finish`` made to end with :meth:`join`: the current stream waits for the
    side stream's work, and the tensors made on the side stream (the result, ``made``) are marked
    in use by the current stream, so the caching allocator does not hand their memory out while
    the current stream may still read them.
    """

    def __init__(self, *inputs: Optional[torch.Tensor]):
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        self.cuda = bool(tensors) and tensors[0].is_cuda
        if self.cuda:
            dev = tensors[0].device
            if dev not in _SIDE_STREAMS:
                _SIDE_STREAMS[dev] = torch.cuda.Stream(device=dev)
            self.stream = _SIDE_STREAMS[dev]
            self.inputs = tensors
            self.done = None

    def __enter__(self):
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            for t in self.inputs:
                if t.is_cuda:
                    t.record_stream(self.stream)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._ctx.__exit__(*exc)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        return False

    def join(self, *made: Optional[torch.Tensor]) -> None:
        if self.cuda:
            cur = torch.cuda.current_stream(self.stream.device)
            cur.wait_event(self.done)
            for t in (x for m in made for x in (m if isinstance(m, tuple) else (m,))):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(cur)

    def wrap(self, finish, *made: Optional[torch.Tensor]):
        if not self.cuda:
            return finish

        def finished():
            out = finish()
            self.join(out, *made)
            return out

        return finished
