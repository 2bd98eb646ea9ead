"""The collective-bearing ops with their autograd (the C++ ops' fakes are in fakes.py, the plan's
words in plan.py, the exchanges inside these ops in moves.py).

Two layers of ``torch.library`` ops, all in the ``epkit`` namespace:

- Local kernels, schema and CPU kernel in C++ (``csrc/``): ``layout``, ``prepare``, ``plan``,
  ``pack``, ``unpack``, ``gather_rows``, ``reduce_tokens``, ``scatter_rows``,
  ``combine_backward_dest``, ``gather_slot_values``, ``scatter_slot_values``. Their fake kernels
  are in fakes.py; every routing-dependent size arrives as a SymInt argument, never guessed.
- Ops that move data over a process group (Python custom ops, opaque to ``torch.compile``):
  ``count_exchange`` (the one small all-gather that yields the plan, and the collective error),
  ``dispatch_tokens`` / ``combine_tokens`` and their backward ops ``dispatch_tokens_backward`` /
  ``combine_tokens_backward``. Autograd is registered with ``register_autograd``; the backward
  passes are ops too, and ``setup_context`` only saves tensors (no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _build
from .count_exchange import count_exchange as plan_of_group
from .memory import device_path
from .agree import (COMBINE_BACKWARD, DISPATCH_BACKWARD, NO_OPTIONS, agree, header, serial)
from .collectives import dtype_code, group_from_name
from .workspace import RECV, SEND, allocator
from .workspace import empty as ws_empty
from epkit.reference import abi
from epkit.reference.errors import Reason, error

_build.load()
C = torch.ops.epkit

from . import fakes  # noqa: F401  (registers the fake kernels)
from .plan import (EXPERT_ROWS, NONUNIFORM_RANK, RANKS, RECV_ROWS, SEND_BYTES, SEND_ROWS, UNIFORM,
                   plan_size, plan_slices, stamp_ranks_per_node)
from .transports import by_code
from .moves import move_back, move_dispatch, move_rows, move_slot_values, reduce_back

# ---- count exchange: the plan and the collective error --------------------------------------

@torch.library.custom_op("epkit::count_exchange", mutates_args=())
def count_exchange(words: torch.Tensor, group_name: str, rank: int, num_experts: int, align: int,
                   capacity: int, transport: int, exchange: int,
                   max_tokens_per_rank: int, static_shape: Optional[list[int]] = None,
                   capacity_factor: float = -1.0,
                   topk_idx: Optional[torch.Tensor] = None,
                   ranks_per_node: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's count words; return this rank's ``(plan, plan_host)``, or raise
    the group's error. ``plan_host`` is the plan's words in host memory, what every op below
    reads on the host (its argument of that name): on the device path the mirror, made with the
    one host wait of an eager dispatch (none for static); on CPU a copy of the plan.

    Every rank computes the same error from the same gathered words, so bad input on any rank
    raises the same :class:`epkit.InputError` on all of them, before any token moves.
    dedup: when the plan shows that capacity dropped a slot anywhere (``DROPPED_ANY``, the same
    on every rank), one more all-gather of every rank's kept token rows (R words, from
    ``topk_idx`` [T, K], this rank's routing) and the plan again (:func:`token_rows_gather`);
    without drops, none.
    (``production/count_exchange.py``; ``static_shape`` = ``[H, K, x dtype code, payload]``
    sizes the static exchange's mirror).
    ``capacity_factor > 0`` replaces ``capacity`` by ``capacity_from_factor(S, E, factor)``, ``S``
    the used slots of the gathered words (on CUDA reading ``S`` is one host wait).
    ``ranks_per_node`` (agreed in the call header) is written into the plan
    (:func:`stamp_ranks_per_node`): combine and the dispatch backward sum in its order.
    """
    plan, plan_host = plan_of_group(
        words, group_name, rank, num_experts, align, capacity, transport, exchange,
        max_tokens_per_rank, static_shape, capacity_factor, topk_idx)
    stamp_ranks_per_node(plan, plan_host, ranks_per_node)
    return plan, plan_host


@count_exchange.register_fake
def _(words, group_name, rank, num_experts, align, capacity, transport, exchange,
      max_tokens_per_rank, static_shape=None, capacity_factor=-1.0, topk_idx=None,
      ranks_per_node=1):
    import torch.distributed as dist

    R = dist.get_world_size(group_from_name(group_name))
    size = plan_size(R, num_experts)
    return words.new_empty((size,)), torch.empty((size,), dtype=torch.int64, device="cpu")


# ---- a Dispatch's counts ----------------------------------------------------------------------

@torch.library.custom_op("epkit::dispatch_counts", mutates_args=())
def dispatch_counts(plan: torch.Tensor, ranks: int, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    """The plan's counts as a Dispatch carries them, each its own tensor (a call's outputs never
    share storage): ``(tokens_per_expert [L], expert_offsets [L + 1], dropped_per_expert [L],
    bytes_sent [R], padded_tokens_per_expert [L])`` int64, ``L = num_experts / ranks``. On the
    device path one launch (triton/counts.py), else copies of the plan's sections."""
    sl = plan_slices(ranks, num_experts)
    if device_path(plan):
        from .triton import counts

        return counts.dispatch_counts(plan, sl)
    offsets = plan[sl["offsets"]]
    return (plan[sl["tokens_per_expert"]].clone(), offsets.clone(), plan[sl["dropped"]].clone(),
            plan[sl["send_bytes"]].clone(), offsets.diff())


@dispatch_counts.register_fake
def _(plan, ranks, num_experts):
    L = num_experts // ranks
    return tuple(plan.new_empty((n,)) for n in (L, L + 1, L, ranks, L))


# ---- dispatch ---------------------------------------------------------------------------------

@torch.library.custom_op("epkit::dispatch_tokens", mutates_args=())
def dispatch_tokens(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    plan: torch.Tensor, plan_host: torch.Tensor, group_name: str, transport: int,
                    send_bytes: int, recv_rows: int, expert_rows: int, workspace: int = -1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack, exchange, unpack: ``(expert_x, row_src, row_weight, send_map, recv_map)``.
    ``plan`` [n] int64 on x's device and ``plan_host`` [n] int64 in host memory (its words, as
    count_exchange returned them: every size and split read on the host comes from it).
    ``workspace``: the Dispatcher's (production/workspace.py; -1: none), the receive buffer's
    home."""
    send = ws_empty(allocator(workspace, SEND), (send_bytes,), torch.uint8, x)
    send_map = C.pack_into(x, topk_idx, topk_weights, plan, transport,
                           int(plan_host[RANKS]), send, plan_host)
    recv = move_dispatch(send, plan_host, group_name, alloc=allocator(workspace, RECV))
    del send  # exchanged: freed before unpack allocates expert_x (a lower peak per step)
    expert_x, row_src, row_weight, recv_map = C.unpack(
        recv, plan, transport, x.shape[1], x.dtype, topk_idx.shape[1], recv_rows, expert_rows,
        plan_host)
    return expert_x, row_src, row_weight, send_map, recv_map


@dispatch_tokens.register_fake
def _(x, topk_idx, topk_weights, plan, plan_host, group_name, transport, send_bytes, recv_rows,
      expert_rows, workspace=-1):
    import torch.distributed as dist

    R = dist.get_world_size(group_from_name(group_name))
    T, K = topk_idx.shape
    cols = by_code(transport).send_map_cols(K, R)
    return (x.new_empty((expert_rows, x.shape[1])),
            x.new_empty((expert_rows, 3), dtype=torch.int64),
            x.new_empty((expert_rows,), dtype=torch.float32),
            x.new_empty((T, cols), dtype=torch.int64),
            x.new_empty((recv_rows, by_code(transport).recv_map_cols(K)), dtype=torch.int64))


# ---- the fused prepare-and-dispatch (the eager path) -----------------------------------------

@torch.library.custom_op("epkit::prepare_dispatch", mutates_args=())
def prepare_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     group_name: str, rank: int, num_experts: int, align: int, capacity: int,
                     transport: int, exchange: int, pre_error: list[int], payload: int,
                     capacity_factor: float = -1.0, ranks_per_node: int = 1,
                     workspace: int = -1
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layout, count exchange, allocation and token exchange in one call.

    Returns ``(expert_x, row_src, row_weight, send_map, recv_map, plan, plan_host)``. The received sizes
    are read from the plan inside the op (host memory on CPU), so the caller makes no host read
    at all. Its fake kernel declares the two routing-dependent sizes as unbacked (new, not
    guessed); under torch.compile the split ops (prepare / count_exchange / dispatch_tokens) are
    used instead, with the sizes passed in as SymInts.
    """
    words = C.prepare(x, topk_idx, topk_weights, num_experts,
                      _world(group_name), pre_error, payload)
    plan, hp = count_exchange(words, group_name, rank, num_experts, align, capacity, transport,
                              exchange, -1, None, capacity_factor, topk_idx, ranks_per_node)
    if exchange == abi.EXCHANGE_CODES["equal"] and not int(hp[UNIFORM]):
        raise error(int(hp[NONUNIFORM_RANK]), Reason.EQUAL_NONUNIFORM)
    SB, N, M = (int(hp[f]) for f in (SEND_BYTES, RECV_ROWS, EXPERT_ROWS))  # host words
    return (*dispatch_tokens(x, topk_idx, topk_weights, plan, hp, group_name, transport, SB, N, M,
                             workspace), plan, hp)


def _world(group_name: str) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group_from_name(group_name))


@prepare_dispatch.register_fake
def _(x, topk_idx, topk_weights, group_name, rank, num_experts, align, capacity, transport,
      exchange, pre_error, payload, capacity_factor=-1.0, ranks_per_node=1, workspace=-1):
    ctx = torch.library.get_ctx()
    N, M = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    R = _world(group_name)
    T, K = topk_idx.shape
    return (x.new_empty((M, x.shape[1])), x.new_empty((M, 3), dtype=torch.int64),
            x.new_empty((M,), dtype=torch.float32),
            x.new_empty((T, by_code(transport).send_map_cols(K, R)), dtype=torch.int64),
            x.new_empty((N, by_code(transport).recv_map_cols(K)), dtype=torch.int64),
            x.new_empty((plan_size(R, num_experts),), dtype=torch.int64),
            torch.empty((plan_size(R, num_experts),), dtype=torch.int64, device="cpu"))


def _fused_setup(ctx, inputs, output):
    x, topk_idx, _, group_name, _, _, _, _, transport, *_ = inputs
    expert_x, _, _, send_map, recv_map, plan, plan_host = output
    ctx.save_for_backward(send_map, recv_map, topk_idx, plan, plan_host)
    ctx.meta = (group_name, transport, x.dtype, inputs[-1])
    unmaterialized(ctx, expert_x)


def unmaterialized(ctx, expert_x) -> None:
    """The backward gets None, not a zero tensor autograd fills, for the outputs the loss does
    not reach (row_weight, the integer maps): a zero fill is a kernel launch each on a GPU.
    ``expert_x``'s shape is kept for the rare loss that does not reach it."""
    ctx.set_materialize_grads(False)
    ctx.expert_shape = (expert_x.shape, expert_x.dtype)


def grad_or_zeros(ctx, grad_expert_x):
    """``grad_expert_x``, or zeros of expert_x's shape where the loss does not reach it."""
    if grad_expert_x is None:
        shape, dtype = ctx.expert_shape
        return ctx.saved_tensors[0].new_zeros(shape, dtype=dtype)
    return grad_expert_x.contiguous()


def _fused_backward(ctx, grad_expert_x, _gs, grad_row_weight, *_):
    grad_x, _, grad_w, *_rest = _dispatch_backward(ctx, grad_expert_x, None, grad_row_weight,
                                                    None, None)
    return grad_x, None, grad_w, *([None] * 12)


def _agree_backward(group_name: str, op: int, grad: torch.Tensor, what: str) -> None:
    """A backward pass's call header (production/agree.py): every rank is in the same pass, and the
    gradient rows that share its exchange have one dtype. (Its weight-gradient exchange runs on
    every rank: autograd hands a zero gradient for an unused row_weight, never None.)"""
    agree(group_from_name(group_name), header(op, NO_OPTIONS, (0, 0, 0), dtype_code(grad.dtype)),
          f"{what} (call header)")


@torch.library.custom_op("epkit::dispatch_tokens_backward", mutates_args=())
def dispatch_tokens_backward(grad_expert_x: torch.Tensor, grad_row_weight: Optional[torch.Tensor],
                             send_map: torch.Tensor, recv_map: torch.Tensor,
                             topk_idx: torch.Tensor, plan: torch.Tensor,
                             plan_host: torch.Tensor, group_name: str,
                             transport: int, x_dtype: torch.dtype,
                             workspace: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x [T, H] x dtype, grad_topk_weights [T, K] float32)``.

    grad_x[t] is combine's sum (k ascending per rank, the ranks' partials into node partials
    and those over nodes ascending, ``ranks_per_node`` from the plan) of its slots' gradient
    rows, unweighted; the weight gradient of each slot travels back as one float32.
    """
    with serial(group_from_name(group_name)):  # the call lock (production/workspace.py)
        _agree_backward(group_name, DISPATCH_BACKWARD, grad_expert_x, "epkit.dispatch backward")
        empty_w = grad_expert_x.new_empty((0,), dtype=torch.float32)  # (no weights)
        back = move_back(grad_expert_x, empty_w, topk_idx, send_map, recv_map, plan, plan_host,
                         group_name, transport, False, what="epkit.dispatch backward",
                         ws=workspace)
        grad_x = reduce_back(back, send_map, empty_w, plan_host, transport, False, x_dtype)
        idx = back.idx
        if grad_row_weight is None:
            return grad_x, torch.zeros(topk_idx.shape, dtype=torch.float32,
                                       device=topk_idx.device)
        return grad_x, move_slot_values(grad_row_weight.contiguous(), send_map, recv_map, idx,
                                        plan, plan_host, group_name, transport,
                                        "epkit.dispatch backward (weight gradients)")


@dispatch_tokens_backward.register_fake
def _(grad_expert_x, grad_row_weight, send_map, recv_map, topk_idx, plan, plan_host, group_name,
      transport, x_dtype, workspace=-1):
    T, K = topk_idx.shape
    return (grad_expert_x.new_empty((T, grad_expert_x.shape[1]), dtype=x_dtype),
            grad_expert_x.new_empty((T, K), dtype=torch.float32))


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_weights, plan, plan_host, group_name, transport, *_ = inputs
    expert_x, _, _, send_map, recv_map = output
    ctx.save_for_backward(send_map, recv_map, topk_idx, plan, plan_host)
    ctx.meta = (group_name, transport, x.dtype, inputs[-1])
    unmaterialized(ctx, expert_x)


def _dispatch_backward(ctx, grad_expert_x, _grad_src, grad_row_weight, _gs, _gr):
    send_map, recv_map, topk_idx, plan, plan_host = ctx.saved_tensors
    group_name, transport, x_dtype, ws = ctx.meta
    grad_x, grad_w = dispatch_tokens_backward(
        grad_or_zeros(ctx, grad_expert_x), grad_row_weight, send_map, recv_map, topk_idx, plan,
        plan_host, group_name, transport, x_dtype, ws)
    return grad_x, None, grad_w, *([None] * 8)


dispatch_tokens.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
prepare_dispatch.register_autograd(_fused_backward, setup_context=_fused_setup)


# ---- combine ----------------------------------------------------------------------------------

@torch.library.custom_op("epkit::combine_tokens", mutates_args=())
def combine_tokens(expert_y: torch.Tensor, row_weight: torch.Tensor, topk_idx: torch.Tensor,
                   topk_weights: torch.Tensor, send_map: torch.Tensor, recv_map: torch.Tensor,
                   plan: torch.Tensor, plan_host: torch.Tensor, group_name: str, transport: int,
                   weighted: bool, out_dtype: torch.dtype, check: list[int],
                   workspace: int = -1) -> torch.Tensor:
    """``out [T, H]`` in x's dtype: the fixed-order weighted (or plain) sum of expert rows.

    dedup: per token row with n kept slots the expert side sends its n rows of expert_y when
    ``n * itemsize <= 4``, else the float32 partial P_d(t) it forms; pairs: each slot's row. The
    source forms the partials of the raw rows (with its own copy of the weights,
    bit-identical to ``row_weight``) and adds them over d ascending, into node partials first
    when the plan's ``ranks_per_node`` is above 1 (arith.grouped_total_sum).

    ``plan_host``: the plan's words in host memory (the return path's sizes and splits).
    ``check`` is this rank's call header (production/agree.py) when the ranks agree inside the op
    (under torch.compile, so no data-dependent branch is traced); empty when the caller
    agreed already (the eager path).
    """
    if check:
        agree(group_from_name(group_name), check, "epkit.combine (call header)")
    back = move_back(expert_y.contiguous(), row_weight, topk_idx, send_map, recv_map, plan,
                     plan_host, group_name, transport, weighted, ws=workspace)
    return reduce_back(back, send_map, topk_weights, plan_host, transport, weighted, out_dtype)


@combine_tokens.register_fake
def _(expert_y, row_weight, topk_idx, topk_weights, send_map, recv_map, plan, plan_host,
      group_name, transport, weighted, out_dtype, check, workspace=-1):
    return expert_y.new_empty((topk_idx.shape[0], expert_y.shape[1]), dtype=out_dtype)


@torch.library.custom_op("epkit::combine_tokens_backward", mutates_args=())
def combine_tokens_backward(grad_out: torch.Tensor, expert_y: torch.Tensor,
                            row_weight: torch.Tensor, send_map: torch.Tensor,
                            recv_map: torch.Tensor, plan: torch.Tensor,
                            plan_host: torch.Tensor, group_name: str,
                            weighted: bool, workspace: int = -1
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_expert_y [M, H] y dtype, grad_row_weight [M] float32)``.

    grad_out rows travel the dispatch way (per slot for pairs, per token and rank for dedup);
    the expert side forms ``cast(c * g)`` and ``<g, y>`` for every row; padding rows get 0.
    """
    with serial(group_from_name(group_name)):  # the call lock (production/workspace.py)
        _agree_backward(group_name, COMBINE_BACKWARD, grad_out, "epkit.combine backward")
        # the gradient rows in the order they leave (send rows, as the dispatch sent its own)
        send_rows = ws_empty(allocator(workspace, SEND),
                             (int(plan_host[SEND_ROWS]), grad_out.shape[1]), grad_out.dtype,
                             grad_out)
        C.scatter_rows_into(grad_out.contiguous(), send_map, send_rows)
        recv = move_rows(send_rows, plan_host, group_name, reverse=False,
                         what="epkit.combine backward", alloc=allocator(workspace, RECV))
        del send_rows  # exchanged: freed before combine_backward_dest allocates grad_y
        return C.combine_backward_dest(recv, recv_map, row_weight, expert_y.contiguous(), weighted)


@combine_tokens_backward.register_fake
def _(grad_out, expert_y, row_weight, send_map, recv_map, plan, plan_host, group_name, weighted,
      workspace=-1):
    return torch.empty_like(expert_y), expert_y.new_empty((expert_y.shape[0],), dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    (expert_y, row_weight, _, _, send_map, recv_map, plan, plan_host, group_name, _, weighted,
     *_) = inputs
    ctx.save_for_backward(expert_y, row_weight, send_map, recv_map, plan, plan_host)
    ctx.meta = (group_name, weighted, inputs[-1])


def _combine_backward(ctx, grad_out):
    expert_y, row_weight, send_map, recv_map, plan, plan_host = ctx.saved_tensors
    group_name, weighted, ws = ctx.meta
    grad_y, grad_w = combine_tokens_backward(grad_out, expert_y, row_weight, send_map, recv_map,
                                             plan, plan_host, group_name, weighted, ws)
    return grad_y, (grad_w if weighted else None), *([None] * 12)


combine_tokens.register_autograd(_combine_backward, setup_context=_combine_setup)
