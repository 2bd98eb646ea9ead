"""epkit on CUDA: where the plan lives, the one host wait, and the lazy form's side stream.

On CPU every function here is the identity or a no-op, so the CPU path does what it always did.

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

__all__ = ["HOST", "host_plan", "count_exchange", "check_static", "unpack_status",
           "UnpackMismatch", "Side"]

HOST = "_epkit_host"  # attribute of a device plan: its host mirror


def host_plan(plan: torch.Tensor) -> torch.Tensor:
    """The plan's words on the host: the plan itself on CPU; on CUDA its mirror (a copy with a
    host wait, should a plan have lost it: correct, and caught by the sync-count tests)."""
    if plan.device.type == "cpu":
        return plan
    mirror = getattr(plan, HOST, None)
    return mirror if mirror is not None else plan.cpu()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)  # blocking device-to-host copy: the host waits for the stream here
    return host


def count_exchange(words: torch.Tensor, group, rank: int, num_experts: int, align: int,
                   capacity: int, transport: int, exchange: int, max_tokens_per_rank: int,
                   static_shape: Optional[list] = None,
                   topk_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``epkit::count_exchange`` for device words: the device plan with its host mirror attached;
    raises the group's :class:`epkit.InputError` (eager exchanges; static: see the module).

    dedup with capacity drops: the second all-gather of the token rows (ops.token_rows_gather)
    and the plan again; eager: when the mirror shows drops (a second host wait then); static:
    whenever a capacity is set, with no host read (the words equal tokens_per_rank when nothing
    was dropped, so the plan is the same)."""
    import torch.distributed as dist

    from . import ops
    from .collectives import all_gather
    from epkit.reference import abi
    from epkit.reference.errors import error

    R = dist.get_world_size(group)
    gathered = words.new_empty((R * words.shape[0],))
    all_gather(gathered, words.contiguous(), group, "epkit.dispatch (count exchange)")
    args = (rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank)
    static = max_tokens_per_rank >= 0
    if static:
        plan = ops.C.plan(gathered.view(R, -1), *args)
        if static_shape is None:
            raise ValueError("epkit: the static exchange on CUDA needs the dispatch's static_shape "
                             "[H, K, dtype code, payload] to size its chunks without a host wait")
        H, K, dtype_code, payload = (int(v) for v in static_shape)
        template = torch.zeros((R, words.shape[0]), dtype=torch.int64)
        F = {f: i for i, f in enumerate(abi.WORD_FIELDS)}
        for field, value in (("hidden", H), ("topk", K), ("x_dtype", dtype_code),
                             ("payload", payload)):
            template[:, F[field]] = value
        mirror = ops.C.plan(template, *args)  # the CPU kernel: routing-independent words
        if transport == ops.DEDUP and capacity >= 0:
            setattr(plan, HOST, mirror)  # may_drop: a capacity is set
            words2 = ops.token_rows_gather(gathered, plan, topk_idx, group, R, num_experts)
            plan = ops.C.plan(words2, *args)
    elif os.environ.get("EPKIT_HOST_PLAN") == "1":
        mirror = ops.C.plan(_pinned_copy(gathered).view(R, -1), *args).pin_memory()
        plan = mirror.to(words.device, non_blocking=True)
    else:
        plan = ops.C.plan(gathered.view(R, -1), *args)
        mirror = _pinned_copy(plan)  # the one host wait of an eager dispatch
    setattr(plan, HOST, mirror)
    if not static:
        code = int(mirror[ops.ERR_CODE])
        if code:
            raise error(int(mirror[ops.ERR_RANK]), code, int(mirror[ops.ERR_A]),
                        int(mirror[ops.ERR_B]))
        if transport == ops.DEDUP and int(mirror[ops.DROPPED_ANY]):
            words2 = ops.token_rows_gather(gathered, plan, topk_idx, group, R, num_experts)
            plan = ops.C.plan(words2, *args)
            setattr(plan, HOST, _pinned_copy(plan))  # a second host wait, only with drops
    return plan


class UnpackMismatch(RuntimeError):
    """A CUDA unpack found received chunks that disagree with the plan (a deferred error: that
    call's outputs were written as if nothing had been received). ``bits``: the status bits
    (1 in-band count, 2 in-band slot count, 4 rows, 8 slot row, 16 expert row, 32 plan shape or
    sizes, 64 expert total; csrc/cuda/unpack.cu)."""

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
    bits = int(word.item())
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
    words = head.tolist()
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
