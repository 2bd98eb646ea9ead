"""A Dispatch's counts out of the plan in one launch (``epkit::dispatch_counts``, ops.py).

A :class:`epkit.Dispatch` carries the plan's ``tokens_per_expert [L]``, ``offsets [L + 1]``,
``dropped [L]`` and ``send_bytes [R]`` sections and ``padded_tokens_per_expert [L]`` (the
offsets' differences), each its own tensor: a call's outputs never share storage
(docs/reliability.md). As torch ops that is four copies and a diff, five launches; here one
program copies every section into its own output (``L + 1`` and ``R`` words: a handful).
"""

from __future__ import annotations

import torch

from ._runtime import launch, tl, triton

__all__ = ["dispatch_counts"]


@triton.jit
def _counts_kernel(plan, tpe, offs, dropped, sent, padded, o_tpe, o_offs, o_dropped, o_sent, L,
                   R, WP: tl.constexpr):
    """tpe, dropped, padded [L], offs [L + 1], sent [R] int64 from the plan's sections at
    o_tpe, o_offs, o_dropped, o_sent; padded[e] = offs[e + 1] - offs[e]."""
    i = tl.arange(0, WP).to(tl.int64)
    e = i < L
    tl.store(tpe + i, tl.load(plan + o_tpe + i, mask=e), mask=e)
    tl.store(dropped + i, tl.load(plan + o_dropped + i, mask=e), mask=e)
    lo = tl.load(plan + o_offs + i, mask=i < L + 1)
    tl.store(offs + i, lo, mask=i < L + 1)
    hi = tl.load(plan + o_offs + i + 1, mask=e)
    tl.store(padded + i, hi - lo, mask=e)
    r = i < R
    tl.store(sent + i, tl.load(plan + o_sent + i, mask=r), mask=r)


def dispatch_counts(plan: torch.Tensor, slices: dict) -> tuple[torch.Tensor, ...]:
    """``(tokens_per_expert [L], expert_offsets [L + 1], dropped_per_expert [L], bytes_sent
    [R], padded_tokens_per_expert [L])`` int64, each its own tensor, from the device plan
    ``plan`` whose sections lie at ``slices`` (``abi.plan_slices``); one launch."""
    span = lambda name: slices[name].stop - slices[name].start  # noqa: E731
    L, R = span("tokens_per_expert"), span("send_bytes")
    new = lambda n: torch.empty(n, dtype=torch.int64, device=plan.device)  # noqa: E731
    tpe, offs, dropped, sent, padded = new(L), new(L + 1), new(L), new(R), new(L)
    launch(_counts_kernel, (1,), plan, tpe, offs, dropped, sent, padded,
           slices["tokens_per_expert"].start, slices["offsets"].start, slices["dropped"].start,
           slices["send_bytes"].start, L, R, WP=max(2, triton.next_power_of_2(max(L + 1, R))))
    return tpe, offs, dropped, sent, padded
