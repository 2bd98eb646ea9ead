"""``epkit.exchange``: the public all-to-all of rows, differentiable (semantics: "Exchange").

It exchanges the counts first (every rank learns every count, so the equal variant's uniformity
and every rank's bad input are decided collectively, before any row moves), then moves the rows
with :func:`epkit.collectives.all_to_all` in the chosen variant. Its backward is the exchange
with send and receive counts swapped. The reference is ``epkit.reference.exchange``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import agree
from .agree import tensor_error
from .collectives import (EXCHANGE_VARIANTS, VARIANTS, all_gather, all_to_all, dtype_code,
                          is_group, resolve_group, small_device)
from epkit.reference import abi
from epkit.reference.errors import Reason, error

__all__ = ["exchange"]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, variant, max_chunk):
        ctx.args = (send_counts, recv_counts, group, variant, max_chunk)
        return all_to_all(x, send_counts, recv_counts, group, variant, max_chunk,
                          what="epkit.exchange")

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts, group, variant, max_chunk = ctx.args
        return all_to_all(grad, recv_counts, send_counts, group, variant, max_chunk,
                          what="epkit.exchange backward"), *([None] * 5)


def exchange(x: torch.Tensor, send_counts, group=None, variant: str = "ragged") -> torch.Tensor:
    """All-to-all of rows, differentiable.

    Args:
        x: ``[sum(send_counts), ...]`` any dtype; rows for peer ``q`` start at
            ``sum(send_counts[:q])``.
        send_counts: ``[R]`` ints (list or int64 tensor): rows this rank sends to each peer.
        group: process group (default: the default group).
        variant: ``"ragged"``, ``"padded"`` or ``"equal"`` (equal needs every count in the
            group to be the same; otherwise :class:`epkit.InputError`).

    Returns:
        ``[sum(recv_counts), ...]``: rows from source ranks in ascending order.
    """
    bad_group = not is_group(group)  # reported over the default group, collectively
    group = resolve_group(group)
    R = dist.get_world_size(group)
    dev = small_device(group)
    with agree.serial(group):
        found, cause = agree.guarded(_counts_error, x, send_counts, R, variant)
        sc, code = ((torch.zeros(R, dtype=torch.int64), (Reason.BAD_ARGUMENT, 6, 0))
                    if cause is not None else found)
        if bad_group:
            code = (Reason.BAD_GROUP, 0, 0)
        ok = code[0] == Reason.OK
        vcode = _VARIANT_CODES.get(variant, -1) if isinstance(variant, str) else -1
        words = agree.header(agree.EXCHANGE, [-1, -1, -1, -1, vcode, -1, -1],
                             code, dtype_code(x.dtype) if ok else 0,
                             row_width=math.prod(x.shape[1:]) if ok else 0)
        agree.agree(group, words, "epkit.exchange (call header)", cause)
        gathered = torch.empty(R * R, dtype=torch.int64, device=dev)
        all_gather(gathered, sc.to(dev), group, "epkit.exchange (count exchange)")
    counts = gathered.view(R, R).cpu()  # counts[s, d]: rows s sends to d, known to every rank
    me = dist.get_rank(group)
    max_chunk = int(counts.max()) if counts.numel() else 0
    if VARIANTS[variant].uniform:
        odd = (counts != counts.reshape(-1)[0]).any(dim=1).nonzero()
        if odd.numel():  # every rank names the same (lowest) source rank
            raise error(int(odd[0]), Reason.EQUAL_NONUNIFORM)
    return _Exchange.apply(x, counts[me].tolist(), counts[:, me].tolist(), group, variant,
                           max_chunk)


_VARIANT_CODES = {k: abi.VARIANT_CODES[k] for k in EXCHANGE_VARIANTS}  # what epkit.exchange takes


def _counts_error(x, send_counts, R: int, variant):
    """``(send_counts [R] int64, (code, a, b))``: this rank's local error, if any, and the counts
    to gather (zeros when they are unusable, so the gather keeps its size)."""
    zeros = torch.zeros(R, dtype=torch.int64)
    bad = tensor_error(1, x)
    if bad:
        return zeros, bad
    if x.dim() < 1:
        return zeros, (Reason.SEND_COUNTS_SUM, -1, 0)
    if not isinstance(variant, str) or variant not in _VARIANT_CODES:
        return zeros, (Reason.OPTION, 2, -1)
    try:
        sc = torch.as_tensor(send_counts).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        return zeros, (Reason.NOT_A_TENSOR, 6, 0)
    if sc.is_floating_point() or sc.is_complex() or sc.dtype == torch.bool:
        return zeros, (Reason.NOT_A_TENSOR, 6, 0)
    sc = sc.to(torch.int64).cpu()
    if sc.numel() != R:
        return zeros, (Reason.SEND_COUNTS, sc.numel(), R)
    if bool((sc < 0).any()):
        return zeros, (Reason.SEND_COUNTS_NEGATIVE, int(sc[sc < 0][0]), 0)
    if x.shape[0] != int(sc.sum()):
        return zeros, (Reason.SEND_COUNTS_SUM, x.shape[0], int(sc.sum()))
    return sc, (Reason.OK, 0, 0)
