"""The lazy exchange: issue the token exchange now, wait for it later.

``epkit.dispatch(..., exchange="lazy")`` returns a :class:`PendingDispatch`; independent work
placed between the call and ``wait()`` overlaps the transfer (``async_op=True`` work on gloo).
A pending object holds no tensor of the result, so nothing can be read before ``wait()``.
``wait()`` unpacks and returns the ordinary :class:`epkit.Dispatch` (with a quantized payload
too: quantized at issue time, dequantized straight-through at wait); ``epkit.combine`` on it
returns a :class:`PendingCombine` in the same way. Autograd flows through waited results: the
backward passes are the same ops as the eager path's (synchronous).
"""

from __future__ import annotations

import torch

from . import moves, ops
from . import plan as W
from .streams import Side

C = ops.C


class _DispatchWait(torch.autograd.Function):
    """x, topk_weights -> expert_x, row_weight; the rows already travelled, this finishes them."""

    @staticmethod
    def forward(ctx, x, topk_weights, state):
        recv, state["finish"] = state["finish"](), None  # the work is done: let it go
        H, pl = x.shape[1], state["payload"]
        expert_x, row_src, row_weight, recv_map = C.unpack(
            recv, state["plan"], state["transport"], pl.row_bytes(H, 1) if pl.quantized else H,
            torch.uint8 if pl.quantized else x.dtype, state["topk_idx"].shape[1],
            int(state["plan_host"][W.RECV_ROWS]), state["expert_rows"], state["plan_host"])
        q = scale = expert_x.new_empty((0,))
        if pl.quantized:  # E4M3 bytes | scales; the differentiable output: the dequantized rows
            q, scale, expert_x = pl.from_rows(expert_x, H)
        ctx.save_for_backward(state["send_map"], recv_map, state["topk_idx"], state["plan"],
                              state["plan_host"])
        ctx.meta = (state["group_name"], state["transport"], x.dtype)
        ctx.mark_non_differentiable(row_src, recv_map, q, scale)
        return expert_x, row_weight, row_src, recv_map, q, scale

    @staticmethod
    def backward(ctx, grad_expert_x, grad_row_weight, *_):
        send_map, recv_map, topk_idx, plan, plan_host = ctx.saved_tensors
        group_name, transport, x_dtype = ctx.meta
        grad_x, grad_w = ops.dispatch_tokens_backward(
            grad_expert_x.contiguous(), grad_row_weight, send_map, recv_map, topk_idx, plan,
            plan_host, group_name, transport, x_dtype)
        return grad_x, grad_w, None


def _not_yet(pending, name: str, result: str, var: str):
    """The AttributeError for a result's attribute read on the pending object."""
    what = type(pending).__name__
    return AttributeError(
        f"'{what}' object has no attribute '{name}': it is the {result} in flight "
        f"(exchange='lazy'); call its wait() first, which returns the {result}: "
        f"{var} = pending.wait(); {var}.{name}")


class PendingDispatch:
    """A dispatch in flight. ``wait()`` returns the :class:`epkit.Dispatch` (once)."""

    def __getattr__(self, name):  # only for names it lacks: a Dispatch's, read too early
        if name.startswith("_"):
            raise AttributeError(name)
        raise _not_yet(self, name, "epkit.Dispatch", "d")

    def __init__(self, x, topk_weights, state, build):
        self._args = (x, topk_weights, state)
        self._build = build
        self._done = None

    def wait(self):
        if self._done is None:
            x, w, state = self._args
            expert_x, row_weight, row_src, recv_map, q, scale = _DispatchWait.apply(x, w, state)
            if state["payload"].quantized:
                self._done = self._build(q, row_src, row_weight, state["send_map"], recv_map,
                                         scale, expert_x)
            else:
                self._done = self._build(expert_x, row_src, row_weight, state["send_map"],
                                         recv_map)
            self._args = None
        return self._done


def issue_dispatch(x, topk_idx, topk_weights, plan, plan_host, group_name, transport,
                   expert_rows, build, payload):
    """Issue the token exchange; ``payload``: the call's ``epkit.payloads`` entry."""
    hp = plan_host
    with Side(x, topk_idx, topk_weights, plan) as side:  # CUDA: a side stream
        # quantized payloads: at the source, rows of E4M3 bytes then the scales' bytes
        rows = payload.to_rows(x) if payload.quantized else x
        send, send_map = C.pack(rows, topk_idx, topk_weights.detach(), plan, transport,
                                int(hp[W.RANKS]), int(hp[W.SEND_BYTES]), hp)
        finish = moves.move_dispatch(send, hp, group_name, async_op=True)
    state = dict(finish=side.wrap(finish, send_map), plan=plan, plan_host=hp, transport=transport,
                 topk_idx=topk_idx, expert_rows=expert_rows, send_map=send_map,
                 group_name=group_name, payload=payload)
    return PendingDispatch(x, topk_weights, state, build)


class _CombineWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_y, row_weight, state):
        back, state["finish"] = state["finish"](), None  # the work is done: let it go
        h = state["dispatch"].handle
        out = moves.reduce_back(back, h.send_map, h.topk_weights, h.plan_host,
                                state["transport"], state["weighted"], h.x_dtype)
        ctx.save_for_backward(expert_y, row_weight, h.send_map, h.recv_map, h.plan, h.plan_host)
        ctx.meta = (state["group_name"], state["weighted"])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        expert_y, row_weight, send_map, recv_map, plan, plan_host = ctx.saved_tensors
        group_name, weighted = ctx.meta
        grad_y, grad_w = ops.combine_tokens_backward(grad_out, expert_y, row_weight, send_map,
                                                     recv_map, plan, plan_host, group_name,
                                                     weighted)
        return grad_y, (grad_w if weighted else None), None


class PendingCombine:
    """A combine in flight. ``wait()`` returns ``out [T, H]`` (once)."""

    def __getattr__(self, name):  # only for names it lacks: the output tensor's, read too early
        if name.startswith("_"):
            raise AttributeError(name)
        raise _not_yet(self, name, "combine's output tensor", "out")

    def __init__(self, expert_y, row_weight, state):
        self._args = (expert_y, row_weight, state)
        self._done = None

    def wait(self) -> torch.Tensor:
        if self._done is None:
            self._done = _CombineWait.apply(*self._args)
            self._args = None
        return self._done


def issue_combine(expert_y, d, group_name, transport, weighted):
    h = d.handle
    with Side(expert_y, h.recv_map, d.row_weight) as side:  # CUDA: a side stream
        finish = moves.move_back(expert_y.contiguous(), d.row_weight.detach(), h.topk_idx,
                               h.send_map, h.recv_map, h.plan, h.plan_host, group_name,
                               transport, weighted, async_op=True, what="epkit.combine (lazy)")
    state = dict(finish=side.wrap(finish), dispatch=d, transport=transport, weighted=weighted,
                 group_name=group_name)
    return PendingCombine(expert_y, d.row_weight, state)
