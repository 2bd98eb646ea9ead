"""The count exchange: every rank's count words all-gathered, the plan made from them, and the
group's error raised on every rank (the body of ``epkit::count_exchange``, ops.py).

Two paths, one result. In host memory (the CPU kernels) the plan is made where the words were
gathered. On the device path (CUDA, or the interpreted Triton kernels standing in for it) the
plan stays on the device, and its *host mirror* is returned beside it (``plan_host``, which
every op that reads the plan on the host is handed):

- eager exchanges (ragged, padded, equal, auto, lazy): the mirror is the whole plan, copied once
  into pinned host memory: the one host wait of a dispatch; combine and both backward passes
  reuse the mirror and wait for nothing.
- static: no host wait at all (CUDA-graph capturable). The mirror is the plan of a routing-free
  template (every rank with this rank's ``H``, ``K``, dtype and payload, and zero counts):
  exactly the plan's routing-independent words, which are all the static exchange reads on the
  host. The group's error, if any, stays on the device: under an erroneous plan the kernels move
  no token, and :func:`epkit.device.check_static` raises it when the caller asks. A template
  cannot know whether capacity dropped a slot: its ``dropped_any`` word is -1 ("maybe") when a
  capacity is set, 0 when none is (epkit.moves.may_drop reads it).

In host memory ``plan_host`` is a copy of the plan (an op's outputs never share storage).

``EPKIT_HOST_PLAN=1`` computes an eager plan with the CPU kernel instead (the gathered words
copied to pinned memory: the same one host wait), a fallback should the device plan be in doubt.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from . import _build
from .collectives import all_gather, group_from_name
from .hostreads import to_host
from .memory import device_path, host_work, mark_host, pinned
from .moves import token_rows_gather
from .transports import by_code
from .plan import DROPPED_ANY, ERR_RANK, WORD_HEADER, raise_error
from epkit.reference import abi
from epkit.reference.capacity import capacity_from_factor
from epkit.reference.errors import MAX_CAPACITY

_build.load()
C = torch.ops.epkit

__all__ = ["count_exchange", "factor_capacity"]


def count_exchange(words, group_name, rank, num_experts, align, capacity, transport, exchange,
                   max_tokens_per_rank, static_shape, capacity_factor, topk_idx, also=None):
    """``(plan, plan_host)`` of this rank from every rank's count ``words`` (see the module);
    raises the group's :class:`epkit.InputError` on every rank.

    ``also``: a transport's own words that ride on the plan's host read (hier's counts of the
    kept routing: production/hier.py). Called with the device plan on every rank, before the
    group's error is known on the device path, so it must not fail on any routing; returns a
    device tensor, which comes back in host memory as a third result."""
    group = group_from_name(group_name)
    if device_path(words):  # CUDA, or the interpreted Triton kernels standing in for it
        return _on_device(words, group, rank, num_experts, align, capacity, transport, exchange,
                          max_tokens_per_rank, static_shape, topk_idx, capacity_factor, also)
    R = dist.get_world_size(group)
    gathered = words.new_empty((R * words.shape[0],))  # gloo wants a flat output
    all_gather(gathered, words.contiguous(), group, "epkit.dispatch (count exchange)")
    if capacity_factor > 0:
        capacity = factor_capacity(gathered.view(R, -1), num_experts, capacity_factor)
    args = (rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank)
    plan = C.plan(gathered.view(R, -1), *args)
    raise_error(plan)
    # the token rows that travel, after a capacity drop
    if by_code(transport).replans_after_drops and int(plan[DROPPED_ANY]):
        plan = C.plan(token_rows_gather(gathered, plan, plan, topk_idx, group, R, num_experts),
                      *args)
    if also is not None:
        return plan, plan.clone(), also(plan)
    return plan, plan.clone()


def factor_capacity(gathered: torch.Tensor, num_experts: int, factor: float) -> int:
    """The capacity of ``factor`` from the gathered words ``[R, 8 + E + R]`` (host memory)."""
    # summed in Python from the words as read: host memory on every path, no tensor made
    used = sum(map(sum, gathered[:, WORD_HEADER:WORD_HEADER + num_experts].tolist()))
    return min(capacity_from_factor(used, num_experts, factor), MAX_CAPACITY)  # huge: keeps all


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return to_host(t, pinned=True)


def _template(R: int, W: int, args, shape=(0, 0, 0, 0)) -> torch.Tensor:
    """The plan (CPU kernel) of a routing-free template, as a host mirror: every rank with zero
    counts and ``shape`` = ``[H, K, dtype code, payload]``: exactly the plan's
    routing-independent words (ranks, experts, capacity, the static caps). Its ``dropped_any``
    is -1 ("maybe": a capacity is set) or 0 (none is), which epkit.moves.may_drop reads."""
    with host_work():
        template = mark_host(torch.zeros((R, W), dtype=torch.int64))
        F = {f: i for i, f in enumerate(abi.WORD_FIELDS)}
        for field, value in zip(("hidden", "topk", "x_dtype", "payload"), shape):
            template[:, F[field]] = int(value)
        mirror = mark_host(C.plan(template, *args))
        mirror[DROPPED_ANY] = -1 if args[3] >= 0 else 0  # args[3]: the capacity; -1: maybe
    return mirror


def _on_device(words: torch.Tensor, group, rank: int, num_experts: int, align: int,
               capacity: int, transport: int, exchange: int, max_tokens_per_rank: int,
               static_shape: Optional[list] = None, topk_idx: Optional[torch.Tensor] = None,
               capacity_factor: float = -1.0, also=None) -> tuple:
    """``epkit::count_exchange`` for device words: ``(the device plan, its host mirror)``, and
    with ``also`` its words in host memory, in the plan's one copy where the plan is made on
    the device (:func:`count_exchange`); raises the group's :class:`epkit.InputError` (eager
    exchanges; static: see the module).

    Host reads (docs/design.md, "Host reads"): one for an eager exchange, the mirror. dedup with
    a capacity gathers the token rows (token_rows_gather) and plans again whether or not a
    slot was dropped (the words equal tokens_per_rank when nothing was, so the plan is the
    same), so the one copy carries the final plan and the first plan's error words. A
    ``capacity_factor`` needs the gathered counts on the host: they are the one read, and the
    plan is made there (a second read only for dedup's token rows when a slot was dropped;
    ``also``'s words take that second read, or one of their own without drops).
    static: no host read, unless a ``capacity_factor`` is set."""
    R = dist.get_world_size(group)
    gathered = words.new_empty((R * words.shape[0],))
    all_gather(gathered, words.contiguous(), group, "epkit.dispatch (count exchange)")
    host_words = None
    if capacity_factor > 0:  # the gathered counts decide the capacity: read them once
        host_words = _pinned_copy(gathered).view(R, -1)
        capacity = factor_capacity(host_words, num_experts, capacity_factor)
    args = (rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank)
    static = max_tokens_per_rank >= 0
    if static and also is not None:
        raise ValueError("epkit: words that ride on the plan's read need an eager exchange")
    planned_rows = False  # dedup's token rows gathered and planned already
    extra = None  # also's words in host memory
    if static:
        plan = C.plan(gathered.view(R, -1), *args)
        if static_shape is None:
            raise ValueError("epkit: the static exchange on CUDA needs the dispatch's static_shape "
                             "[H, K, dtype code, payload] to size its chunks without a host wait")
        mirror = _template(R, words.shape[0], args, static_shape)
        if by_code(transport).replans_after_drops and capacity >= 0:
            words2 = token_rows_gather(gathered, plan, mirror, topk_idx, group, R, num_experts)
            plan = C.plan(words2, *args)
    elif host_words is not None or os.environ.get("EPKIT_HOST_PLAN") == "1":
        if host_words is None:
            host_words = _pinned_copy(gathered).view(R, -1)  # the one host wait
        mirror = pinned(C.plan(host_words, *args))
        plan = (mirror.to(words.device, non_blocking=True) if words.is_cuda else mirror.clone())
    elif by_code(transport).replans_after_drops and capacity >= 0:
        first = C.plan(gathered.view(R, -1), *args)
        plan = C.plan(token_rows_gather(gathered, first, _template(R, words.shape[0], args),
                                        topk_idx, group, R, num_experts), *args)
        # the one host wait: the first plan's error words (the group's error, raised before
        # anything that the token rows' plan might say), the final plan and also's words
        both, mirror, extra = _read_plan(plan, also, first[: ERR_RANK + 1])
        raise_error(both)
        planned_rows = True
    else:
        plan = C.plan(gathered.view(R, -1), *args)
        _, mirror, extra = _read_plan(plan, also)  # the one host wait of an eager dispatch
    if not static:
        raise_error(mirror)
        if by_code(transport).replans_after_drops and not planned_rows and int(mirror[DROPPED_ANY]):
            words2 = token_rows_gather(gathered, plan, mirror, topk_idx, group, R, num_experts)
            plan = C.plan(words2, *args)
            # a second host wait, only with drops (the plan was made on the host, so also's
            # words are not read yet: they ride here)
            _, mirror, later = _read_plan(plan, also if extra is None else None)
            extra = later if extra is None else extra
    if also is None:
        return plan, mirror
    if extra is None:  # the plan was made on the host (a capacity_factor), without drops
        extra = _pinned_copy(also(plan))
    return plan, mirror, extra


def _read_plan(plan: torch.Tensor, also=None, lead: Optional[torch.Tensor] = None) -> tuple:
    """One host copy of ``[lead |] plan [| also(plan)]``: ``(the copy, the plan's words, also's
    words or None)``, each in host memory (the words views of the copy)."""
    parts = ([] if lead is None else [lead]) + [plan] + ([] if also is None else [also(plan)])
    if len(parts) == 1:
        return (mirror := _pinned_copy(plan)), mirror, None
    host = _pinned_copy(torch.cat(parts))
    at, end = (0 if lead is None else lead.shape[0]), plan.shape[0]
    mirror = mark_host(host[at:at + end])
    return host, mirror, (None if also is None else mark_host(host[at + end:]))
