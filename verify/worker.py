"""What one rank does with one case: drive an adapter forward and backward, return NumPy.

Runs inside a pool worker (or every ``torchrun`` process). Every rank of the case's group runs
the same stages in the same order, so the collectives inside the adapter line up; a stage that
raises ends the case on that rank, and the error is reported with the stage's name.
"""

from __future__ import annotations

import functools
import time
import traceback

import numpy as np
import torch

from .adapters import load_factory
from .cases import STAGES, TAG_GRAD_X, TAG_Y, Case, ModeSpec, np_dtype, sane_row_src

__all__ = ["STAGES", "load_factory", "make_adapter", "run_rank", "to_numpy", "to_torch"]

FIELDS = ("expert_x", "tokens_per_expert", "expert_offsets", "row_src", "row_weight")
OPTIONAL_FIELDS = ("dropped_per_expert", "expert_scale")
# A rank-major result (DeepEP's normal-mode layout) has these instead of FIELDS.
RANK_MAJOR_FIELDS = ("recv_x", "recv_scale", "recv_topk_idx", "recv_topk_weights", "recv_src")

def to_torch(a: np.ndarray, device="cpu") -> torch.Tensor:
    """NumPy (ml_dtypes included) -> torch, bit for bit."""
    a = np.ascontiguousarray(a)
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def to_numpy(t) -> np.ndarray | None:
    """torch (or anything array-like) -> NumPy, bit for bit; bfloat16 / float8 via ml_dtypes."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        a = np.asarray(t)
        if a.dtype == object:
            raise TypeError(f"expected a tensor, got {type(t).__name__}")
        return a
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np_dtype("bfloat16"))
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(np_dtype("float8_e4m3fn"))
    return t.numpy()


def make_adapter(impl: str, mode: ModeSpec, case: Case, group):
    factory = load_factory(impl)
    kwargs = mode.factory_kwargs(case)
    return functools.partial(factory, **kwargs)(group) if kwargs else factory(group)


class _Stage:
    """Records which stage is running so an exception can name it."""

    def __init__(self):
        self.name = None


class Handed:
    """Everything the harness hands an adapter (x, topk_idx, topk_weights, the gradients and
    expert_y it feeds), each with the harness's own copy of its bytes. :meth:`check` after
    every call records, in ``out["tampered"]``, the first call after which an input no longer
    holds those bytes: ``(stage, name)``. The adapter gets tensors over its own memory, so the
    copies the parent reads back (``expert_y``, ``grad_out``, ...) stay the case's."""

    def __init__(self, out: dict, device):
        self.out, self.device, self.items = out, device, []

    def give(self, name: str, a: np.ndarray) -> torch.Tensor:
        a = np.ascontiguousarray(a)
        t = to_torch(a.copy(), self.device)
        self.items.append((name, t, a))
        return t

    def check(self, stage: str):
        seen = {n for _, n in self.out.get("tampered", ())}
        for name, t, want in self.items:
            if name in seen:
                continue
            got = to_numpy(t)
            if (got.shape != want.shape or got.dtype != want.dtype
                    or got.tobytes() != want.tobytes()):
                self.out.setdefault("tampered", []).append((stage, name))


def run_rank(case: Case, mode: ModeSpec, adapter, rank: int, device="cpu") -> dict:
    """Run ``case`` on this rank through ``adapter``; a dict of NumPy outputs and the error."""
    out: dict = {"rank": rank, "error": None}
    stage = _Stage()
    t0 = time.perf_counter()
    try:
        _run(case, mode, adapter, rank, device, out, stage)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        if isinstance(exc, KeyboardInterrupt):
            raise
        out["error"] = {
            "stage": stage.name,
            "type": type(exc).__name__,
            "unsupported": isinstance(exc, NotImplementedError),
            "input_error": isinstance(exc, ValueError),
            "message": str(exc),
            "traceback": traceback.format_exc(limit=-8),
        }
    out["seconds"] = time.perf_counter() - t0
    return out


def _waited(obj, field=None):
    """A pending handle (lazy exchange) is waited for; a result is returned as it is."""
    if isinstance(obj, torch.Tensor) or (field is not None and hasattr(obj, field)):
        return obj
    return obj.wait() if hasattr(obj, "wait") else obj


def _run(case, mode, adapter, rank, device, out, stage):
    x_np, idx_np, w_np = case.inputs(rank)
    handed = Handed(out, device)
    x = handed.give("x", x_np).requires_grad_(True)
    idx = handed.give("topk_idx", idx_np)
    w = handed.give("topk_weights", w_np).requires_grad_(case.weighted)

    stage.name = "dispatch"
    d = adapter.dispatch(
        x, idx, w, num_experts=case.num_experts, align=case.align, capacity=case.capacity
    )
    d = _waited(d, "expert_x")
    handed.check("dispatch")
    if getattr(d, "expert_x", None) is None and getattr(d, "recv_x", None) is not None:
        return _run_rank_major(case, adapter, d, x, rank, device, out, stage, handed)
    got = {name: to_numpy(getattr(d, name)) for name in FIELDS}
    for name in OPTIONAL_FIELDS:
        got[name] = to_numpy(getattr(d, name, None))
    out["dispatch"] = got
    # Under a quantized payload the differentiable rows are the dequantized ones
    # (``expert_x_hp``, straight-through), and their gradient is float32.
    expert_x, g_dtype = d.expert_x, case.dtype
    if case.payload is not None and getattr(d, "expert_x_hp", None) is not None:
        expert_x, g_dtype = d.expert_x_hp, "float32"
        got["expert_x_hp"] = to_numpy(expert_x)
    # The rows fed back are keyed by the implementation's own row_src (cases.slot_rows): any
    # row order is handed the same row for the same slot.
    src = sane_row_src(got["row_src"], int(d.expert_x.shape[0]))

    stage.name = "dispatch_backward"
    g = case.slot_rows(rank, TAG_GRAD_X, src, g_dtype)
    out["grad_expert_x"] = g
    if expert_x.requires_grad:
        (gx,) = torch.autograd.grad(expert_x, x, handed.give("grad_expert_x", g),
                                    retain_graph=True)
        handed.check("dispatch_backward")
        out["grad_x"] = to_numpy(gx)
    elif case.payload is None:
        raise AssertionError("expert_x does not require grad: dispatch is not differentiable")
    else:
        out["grad_x"] = "unsupported"

    stage.name = "combine"
    y_np = case.slot_rows(rank, TAG_Y, src, case.y_dtype)
    out["expert_y"] = y_np
    y = handed.give("expert_y", y_np).requires_grad_(True)
    o = _waited(adapter.combine(y, d, weighted=case.weighted))
    handed.check("combine")
    out["out"] = to_numpy(o)

    stage.name = "combine_backward"
    go = case.grad_out(rank)
    out["grad_out"] = go
    inputs = [y, w] if case.weighted else [y]
    grads = torch.autograd.grad(o, inputs, handed.give("grad_out", go), allow_unused=True)
    handed.check("combine_backward")
    out["grad_y"] = to_numpy(grads[0])
    out["grad_w"] = to_numpy(grads[1]) if case.weighted else None
    stage.name = None


def _run_rank_major(case, adapter, d, x, rank, device, out, stage, handed):
    """The stages for a rank-major result: one row per token and destination rank. The rows
    fed back are keyed by ``recv_src``; combine sums the per-rank rows of each token (the expert
    side applied the weights), so it is called with ``weighted=False``."""
    got = {name: to_numpy(getattr(d, name, None)) for name in RANK_MAJOR_FIELDS}
    out["dispatch"] = got
    out["layout"] = "rank_major"
    src = sane_row_src(got["recv_src"], int(d.recv_x.shape[0]), width=2)

    stage.name = "dispatch_backward"
    g = case.token_rows(rank, TAG_GRAD_X, src, case.dtype)
    out["grad_expert_x"] = g
    if not d.recv_x.requires_grad:
        raise AssertionError("recv_x does not require grad: dispatch is not differentiable")
    (gx,) = torch.autograd.grad(d.recv_x, x, handed.give("grad_expert_x", g),
                                retain_graph=True)
    handed.check("dispatch_backward")
    out["grad_x"] = to_numpy(gx)

    stage.name = "combine"
    y_np = case.token_rows(rank, TAG_Y, src, case.y_dtype)
    out["expert_y"] = y_np
    y = handed.give("expert_y", y_np).requires_grad_(True)
    o = _waited(adapter.combine(y, d, weighted=False))
    handed.check("combine")
    out["out"] = to_numpy(o)

    stage.name = "combine_backward"
    go = case.grad_out(rank)
    out["grad_out"] = go
    (gy,) = torch.autograd.grad(o, [y], handed.give("grad_out", go), allow_unused=True)
    handed.check("combine_backward")
    out["grad_y"] = to_numpy(gy)
    out["grad_w"] = None
    stage.name = None
