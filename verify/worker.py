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
from .cases import (ORDERS, STAGES, TAG_GRAD_X, TAG_Y, Case, ModeSpec, np_dtype,
                    sane_row_src)

__all__ = ["STAGES", "first_error", "load_factory", "make_adapter", "run_rank", "schedule",
           "to_numpy", "to_torch"]

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
    """Records which stage is running (and of which batch) so an exception can name it."""

    def __init__(self):
        self.name = None
        self.batch = None


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
    """Run ``case`` on this rank through ``adapter``; a dict of NumPy outputs and the error.

    The calls come in the case's ``order`` (``training``: dispatch, combine, then one
    backward over both; ``stages``: each backward right after its forward). A case with a
    ``sequence`` runs with its twin (:meth:`Case.twin`: the same shapes, a fresh routing) on
    the same adapter, interleaved as the sequence says; the twin's outputs are the dict's
    ``"twin"``, a dict of the same kind."""
    stage = _Stage()
    t0 = time.perf_counter()
    batches = [_Batch(case, adapter, rank, device, stage)]
    if case.sequence != "single":
        batches.append(_Batch(case.twin(), adapter, rank, device, stage))
    try:
        for n, step in schedule(case):
            batches[n].run(step)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        if isinstance(exc, KeyboardInterrupt):
            raise
        err = {
            "stage": stage.name,
            "type": type(exc).__name__,
            "unsupported": isinstance(exc, NotImplementedError),
            "input_error": isinstance(exc, ValueError),
            "message": str(exc),
            "traceback": traceback.format_exc(limit=-8),
        }
        raising = stage.batch or batches[0]
        raising.out["error"] = err
        for b in batches:  # the other batch stops where it stood, for the same reason
            if b is not raising and b.left and b.out["error"] is None:
                b.out["error"] = dict(err, stage=b.left[0], copied=True, message="the other "
                                      f"batch of the sequence raised first: {err['message']}")
    out = batches[0].out
    if len(batches) > 1:
        out["twin"] = batches[1].out
    out["seconds"] = time.perf_counter() - t0
    return out


def first_error(result: dict) -> dict | None:
    """The error of a rank's result, or of its twin's (a sequence)."""
    return result.get("error") or (result.get("twin") or {}).get("error")


def schedule(case: Case) -> list:
    """``(batch, step)`` in the order a rank runs them: the case's steps (its ``order``), or
    with a ``sequence`` those of the case (batch 0) and its twin (batch 1) interleaved:
    ``repeat`` one after the other; ``overlap`` (two batches in flight: dual-batch overlap,
    DualPipe) both dispatches, then combine 0, combine 1, backward 0, backward 1;
    ``overlap_reversed`` both dispatches, then combine 1, combine 0, backward 1, backward 0."""
    steps = ORDERS[case.order]
    if case.sequence == "single":
        return [(0, s) for s in steps]
    if case.sequence == "repeat":
        return [(0, s) for s in steps] + [(1, s) for s in steps]
    first, second = (0, 1) if case.sequence == "overlap" else (1, 0)
    return [(0, "dispatch"), (1, "dispatch"), (first, "combine"), (second, "combine"),
            (first, "backward"), (second, "backward")]


def _waited(obj, field=None):
    """A pending handle (lazy exchange) is waited for; a result is returned as it is."""
    if isinstance(obj, torch.Tensor) or (field is not None and hasattr(obj, field)):
        return obj
    return obj.wait() if hasattr(obj, "wait") else obj


class _Batch:
    """One case's calls on one rank, a step at a time (a sequence interleaves two batches):
    its inputs, what the adapter returned, and ``out``, the result dict."""

    def __init__(self, case, adapter, rank, device, stage):
        self.case, self.adapter, self.rank, self.device, self.stage = (case, adapter, rank,
                                                                       device, stage)
        self.out = {"rank": rank, "error": None}
        self.handed = Handed(self.out, device)
        self.left = list(ORDERS[case.order])  # the steps not yet run
        self.rank_major = False

    def run(self, step: str):
        self.stage.batch = self
        self.left.remove(step)
        if not self.rank_major:  # a rank-major result ran its stages at dispatch
            getattr(self, "_" + step)()
        self.stage.name = None

    def _at(self, name):
        self.stage.name = name

    def _dispatch(self):
        case, h, out = self.case, self.handed, self.out
        x_np, idx_np, w_np = case.inputs(self.rank)
        self.x = h.give("x", x_np).requires_grad_(True)
        idx = h.give("topk_idx", idx_np)
        self.w = h.give("topk_weights", w_np).requires_grad_(case.weighted)
        self._at("dispatch")
        d = self.adapter.dispatch(self.x, idx, self.w, num_experts=case.num_experts,
                                  align=case.align, capacity=case.capacity)
        d = _waited(d, "expert_x")
        h.check("dispatch")
        if getattr(d, "expert_x", None) is None and getattr(d, "recv_x", None) is not None:
            self.rank_major = True
            return _run_rank_major(case, self.adapter, d, self.x, self.rank, self.device, out,
                                   self.stage, h)
        got = {name: to_numpy(getattr(d, name)) for name in FIELDS}
        for name in OPTIONAL_FIELDS:
            got[name] = to_numpy(getattr(d, name, None))
        out["dispatch"] = got
        # Under a quantized payload the differentiable rows are the dequantized ones
        # (``expert_x_hp``, straight-through), and their gradient is float32.
        self.d, self.expert_x, self.g_dtype = d, d.expert_x, case.dtype
        if case.payload is not None and getattr(d, "expert_x_hp", None) is not None:
            self.expert_x, self.g_dtype = d.expert_x_hp, "float32"
            got["expert_x_hp"] = to_numpy(self.expert_x)
        # The rows fed back are keyed by the implementation's own row_src (cases.slot_rows):
        # any row order is handed the same row for the same slot.
        self.src = sane_row_src(got["row_src"], int(d.expert_x.shape[0]))

    def _grad_rows(self):
        """The gradient fed to expert_x, or None where dispatch under a quantized payload
        offers no differentiable rows (a refusal of its backward)."""
        g = self.case.slot_rows(self.rank, TAG_GRAD_X, self.src, self.g_dtype)
        self.out["grad_expert_x"] = g
        if self.expert_x.requires_grad:
            return g
        if self.case.payload is None:
            raise AssertionError("expert_x does not require grad: dispatch is not "
                                 "differentiable")
        self.out["grad_x"] = "unsupported"
        return None

    def _dispatch_backward(self):
        self._at("dispatch_backward")
        g = self._grad_rows()
        if g is not None:
            (gx,) = torch.autograd.grad(self.expert_x, self.x, self.handed.give(
                "grad_expert_x", g), retain_graph=True)
            self.handed.check("dispatch_backward")
            self.out["grad_x"] = to_numpy(gx)

    def _combine(self):
        case = self.case
        self._at("combine")
        y_np = case.slot_rows(self.rank, TAG_Y, self.src, case.y_dtype)
        self.out["expert_y"] = y_np
        self.y = self.handed.give("expert_y", y_np).requires_grad_(True)
        self.o = _waited(self.adapter.combine(self.y, self.d, weighted=case.weighted))
        self.handed.check("combine")
        self.out["out"] = to_numpy(self.o)

    def _combine_backward(self):
        self._at("combine_backward")
        self._grads([self.o], [self._grad_out()], [self.y, self.w], "combine_backward")

    def _backward(self):
        """Training's backward: one ``autograd.grad`` over (out, expert_x) into (x, expert_y,
        topk_weights), after combine."""
        self._at("backward")
        g = self._grad_rows()
        outputs, fed = [self.o], [self._grad_out()]
        if g is not None:
            outputs.append(self.expert_x)
            fed.append(self.handed.give("grad_expert_x", g))
        gx = self._grads(outputs, fed, [self.y, self.w, self.x] if g is not None
                         else [self.y, self.w], "backward")
        if g is not None:
            self.out["grad_x"] = to_numpy(gx)

    def _grad_out(self):
        go = self.case.grad_out(self.rank)
        self.out["grad_out"] = go
        return self.handed.give("grad_out", go)

    def _grads(self, outputs, fed, inputs, stage):
        """``autograd.grad`` of ``outputs`` (fed ``fed``) into ``inputs`` (expert_y, the
        weights, x); records the gradients of expert_y and the weights; returns x's."""
        weighted = self.case.weighted
        wanted = [inputs[0]] + ([inputs[1]] if weighted else []) + inputs[2:]
        grads = torch.autograd.grad(outputs, wanted, fed, allow_unused=True)
        self.handed.check(stage)
        self.out["grad_y"] = to_numpy(grads[0])
        self.out["grad_w"] = to_numpy(grads[1]) if weighted else None
        return grads[-1] if len(wanted) > 1 + weighted else None


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
