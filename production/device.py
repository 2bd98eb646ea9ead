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
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["HOST", "host_plan", "count_exchange", "check_static", "Side"]

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
                   static_shape: Optional[list] = None) -> torch.Tensor:
    """``epkit::count_exchange`` for device words: the device plan with its host mirror attached;
    raises the group's :class:`epkit.InputError` (eager exchanges; static: see the module)."""
    import torch.distributed as dist

    from epkit import ops
    from epkit.collectives import all_gather
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
        template[:, 4], template[:, 5], template[:, 6], template[:, 7] = H, K, dtype_code, payload
        mirror = ops.C.plan(template, *args)  # the CPU kernel: routing-independent words
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
    return plan


def check_static(dispatch_or_plan) -> None:
    """Raise the group's :class:`epkit.InputError` if a static-exchange dispatch on CUDA had one
    (its plan carries it on the device; this waits for the stream). A no-op otherwise."""
    from epkit import ops
    from epkit.reference.errors import error

    plan = getattr(dispatch_or_plan, "_plan", dispatch_or_plan)
    code, a, b, rank = plan[: ops.ERR_RANK + 1].tolist()
    if code:
        raise error(int(rank), int(code), int(a), int(b))


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
            for t in made:
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
