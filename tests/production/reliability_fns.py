"""Per-rank functions for test_reliability.py, run on the test group
(group.py). NumPy in, NumPy out; a broken guarantee raises AssertionError on the rank that saw it.

- Inputs never modified: every input tensor's whole storage is snapshotted byte for byte and
  compared after every call (dispatch, combine, backward, and the calls that raise).
- Outputs never alias: no two outputs, and no output and an input, share storage bytes; nor do
  the outputs of two successive dispatches, and the first round's outputs keep their bytes while
  the second round runs (nothing is a reused internal buffer).
"""

from __future__ import annotations

import numpy as np
import torch

import epkit
from rank_fns import to_numpy, to_torch

YDT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- inputs never modified ---------------------------------------------------------------------

def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage (not only the bytes the view covers)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s).clone()


class Untouched:
    """Snapshots named tensors' storages; ``check(when)`` asserts not one byte changed."""

    def __init__(self, rank, **tensors):
        self.rank = rank
        self.tensors = {k: v for k, v in tensors.items() if v is not None}
        self.saved = {k: _storage_bytes(v) for k, v in self.tensors.items()}
        self.checks = 0

    def check(self, when: str):
        for name, t in self.tensors.items():
            now = _storage_bytes(t)
            assert torch.equal(now, self.saved[name]), (
                f"rank {self.rank}: input {name} was modified by {when}")
        self.checks += 1


# ---- outputs never alias -----------------------------------------------------------------------

def _span(t: torch.Tensor):
    s = t.untyped_storage()
    return (s.data_ptr(), s.data_ptr() + s.nbytes()) if s.nbytes() else None


def assert_disjoint(rank, where: str, groups: dict):
    """``groups``: name -> tensor; no two (non-empty) storages may overlap."""
    spans = [(n, _span(t)) for n, t in groups.items() if t is not None]
    spans = [(n, s) for n, s in spans if s is not None]
    for i, (a, (a0, a1)) in enumerate(spans):
        for b, (b0, b1) in spans[i + 1:]:
            assert a1 <= b0 or b1 <= a0, f"rank {rank} {where}: {a} and {b} share storage"


def dispatch_outputs(d, prefix=""):
    names = ("expert_x", "tokens_per_expert", "expert_offsets", "row_src", "row_weight",
             "dropped_per_expert", "bytes_sent", "expert_scale", "expert_x_hp")
    return {prefix + n: getattr(d, n) for n in names}


# ---- one round: dispatch -> expert_y -> combine -> backward, every guarantee checked ----------

def make_inputs(x, idx, w, gout, views):
    """Torch tensors from NumPy; ``views`` makes them non-contiguous with the same values:
    x column-major (a transposed view), or expanded (stride 0) when every row is the same;
    topk_idx every other column of a wider tensor; topk_weights transposed; grad_out
    column-major."""
    xt, it, wt, gt = to_torch(x), to_torch(idx), to_torch(w), to_torch(gout)
    if views:
        xt = xt.t().contiguous().t()
        wide = torch.full((it.shape[0], 2 * it.shape[1]), 7, dtype=it.dtype)
        wide[:, ::2] = it
        it = wide[:, ::2]
        wt = wt.t().contiguous().t()
        gt = gt.t().contiguous().t()
    return xt, it, wt, gt


def y_of(d, y_dtype, views):
    """The experts' output: where(padding, NaN, expert_x * 2) in ``y_dtype`` (what
    cases.expected assumes); column-major when ``views``."""
    ex = d.expert_x_hp if d.expert_x_hp is not None else d.expert_x.float()
    pad = (d.row_src[:, 0] < 0).unsqueeze(1)
    y = torch.where(pad, torch.tensor(float("nan")), ex * 2.0).to(YDT[y_dtype])
    if views:
        y = y.t().contiguous().t()
    return y


def round_trip(group, rank, xt, it, wt, gt, opts, dispatcher=None, check=True):
    """dispatch -> y -> combine -> backward on torch inputs; returns (NumPy results, torch
    outputs). With ``check``: inputs byte-compared after every step, aliasing asserted."""
    xt = xt.detach().requires_grad_(True)
    wt = wt.detach().requires_grad_(True)
    guard = Untouched(rank, x=xt, topk_idx=it, topk_weights=wt, grad_out=gt)
    if dispatcher is None:
        dispatcher = epkit.Dispatcher(
            group, opts["E"], align=opts["align"], capacity=opts["capacity"],
            transport=opts["transport"], exchange=opts["exchange"],
            payload=opts.get("payload"), max_tokens_per_rank=opts.get("max_tokens_per_rank"))
    d = dispatcher.dispatch(xt, it, wt)
    if opts["exchange"] == "lazy":
        d = d.wait()
    if check:
        guard.check("dispatch")
    y = y_of(d, opts["y_dtype"], opts.get("views", False))
    y.retain_grad()
    guard.tensors["expert_y"], guard.saved["expert_y"] = y, _storage_bytes(y)
    out = dispatcher.combine(y, d, weighted=opts["weighted"])
    if opts["exchange"] == "lazy":
        out = out.wait()
    if check:
        guard.check("combine")
    out.backward(gt.to(out.dtype) if gt.dtype != out.dtype else gt)
    if check:
        guard.check("backward")
        outs = dict(dispatch_outputs(d), out=out, grad_x=xt.grad, grad_w=wt.grad,
                    grad_y=y.grad)
        ins = dict(x=xt, topk_idx=it, topk_weights=wt, expert_y=y, grad_out=gt)
        assert_disjoint(rank, "outputs and inputs", {**outs, **ins})
    res = {k: to_numpy(v) for k, v in dispatch_outputs(d).items()
           if v is not None and v.dtype != torch.float8_e4m3fn
           and k not in ("expert_x_hp", "expert_scale")}
    res.update(out=to_numpy(out), grad_x=to_numpy(xt.grad), grad_w=to_numpy(wt.grad))
    if d.expert_scale is not None:  # MXFP8: the E4M3 bytes and the codes of the canonical rows
        M = int(d.expert_offsets[-1])
        res["expert_x"] = d.expert_x.view(torch.uint8)[:M].numpy().copy()
        res["scale"] = d.expert_scale[:M].numpy().copy()
    torch_outs = dict(dispatch_outputs(d), out=out, grad_x=xt.grad, grad_w=wt.grad,
                      grad_y=y.grad)
    return res, torch_outs


def guarded_round(group, rank, x, idx, w, gout, opts):
    """One checked round (round_trip), then a second one on the same inputs: its outputs share
    no storage with the first round's, which keep every byte (no reused internal buffer)."""
    xt, it, wt, gt = make_inputs(x, idx, w, gout, opts.get("views", False))
    res, first = round_trip(group, rank, xt, it, wt, gt, opts)
    kept = {k: _storage_bytes(v) for k, v in first.items() if v is not None}
    res2, second = round_trip(group, rank, xt, it, wt, gt, opts)
    assert_disjoint(rank, "two successive rounds",
                    {**{"1st " + k: v for k, v in first.items()},
                     **{"2nd " + k: v for k, v in second.items()}})
    for k, b in kept.items():
        assert torch.equal(_storage_bytes(first[k]), b), (
            f"rank {rank}: the first round's {k} changed during the second round")
    for k in res:
        assert _bits(res[k]) == _bits(res2[k]), f"rank {rank}: {k} differs between two rounds"
    return res


def edge_round(group, rank, x, idx, w, gout, opts):
    """One round with every check (for the edge cases); non-contiguous inputs with
    ``opts['views']``."""
    xt, it, wt, gt = make_inputs(x, idx, w, gout, opts.get("views", False))
    if opts.get("expand_x"):  # every row of x the same: a stride-0 view
        xt = xt[:1].expand(xt.shape[0], xt.shape[1]) if xt.shape[0] else xt
        assert xt.stride(0) == 0 or xt.shape[0] == 0
    if opts.get("views") and min(xt.shape) > 1:
        assert not (xt.is_contiguous() or it.is_contiguous() or wt.is_contiguous())
    return round_trip(group, rank, xt, it, wt, gt, opts)[0]


# ---- a failed call leaves everything usable ----------------------------------------------------

def failures_then_valid(group, rank, x, idx, w, gout, bad, bad_y, opts):
    """One Dispatcher through: a bad dispatch (``bad``: this rank's (idx, w)), a valid
    dispatch, two combines where ranks with ``bad_y`` pass a bad expert_y (a row too many, then
    a column too many), then the valid combine and backward. Every error is an InputError
    (returned as (rank named, code)) and leaves the inputs it was given untouched; the valid
    calls' results are returned for the reference."""
    disp = epkit.Dispatcher(group, opts["E"], align=opts["align"], capacity=opts["capacity"],
                            transport=opts["transport"], exchange=opts["exchange"],
                            max_tokens_per_rank=opts.get("max_tokens_per_rank"))
    errors = []
    xt, it, wt, gt = make_inputs(x, idx, w, gout, False)
    bi, bw = (to_torch(bad[0]), to_torch(bad[1])) if bad is not None else (it, wt)
    guard = Untouched(rank, x=xt, topk_idx=bi, topk_weights=bw)
    try:
        disp.dispatch(xt, bi, bw)
        errors.append(None)
    except epkit.InputError as exc:
        errors.append((exc.rank, int(exc.code)))
    guard.check("a failed dispatch")

    xg = xt.detach().requires_grad_(True)
    wg = wt.detach().requires_grad_(True)
    guard = Untouched(rank, x=xg, topk_idx=it, topk_weights=wg, grad_out=gt)
    d = disp.dispatch(xg, it, wg)
    if opts["exchange"] == "lazy":
        d = d.wait()
    y = y_of(d, opts["y_dtype"], False)
    for wrong in (torch.cat([y, y[:1]]), torch.cat([y, y[:, :1]], 1)):
        y_in = wrong if bad_y else y
        g2 = Untouched(rank, expert_y=y_in)
        try:
            out = disp.combine(y_in, d, weighted=opts["weighted"])
            if opts["exchange"] == "lazy":
                out.wait()
            errors.append(None)
        except epkit.InputError as exc:
            errors.append((exc.rank, int(exc.code)))
        g2.check("a failed combine")
    out = disp.combine(y, d, weighted=opts["weighted"])
    if opts["exchange"] == "lazy":
        out = out.wait()
    out.backward(gt.to(out.dtype))
    guard.check("the valid calls after failures")
    res = {k: to_numpy(v) for k, v in dispatch_outputs(d).items() if v is not None}
    res.update(out=to_numpy(out), grad_x=to_numpy(xg.grad), grad_w=to_numpy(wg.grad))
    return errors, res


# ---- determinism -------------------------------------------------------------------------------

def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8).tobytes() if a.size else b""


def repeated(group, rank, x, idx, w, gout, opts, n):
    """``n`` rounds through one Dispatcher (and ``n`` through fresh ones via epkit.dispatch's
    path, alternating); every result bitwise equal to the first."""
    xt, it, wt, gt = make_inputs(x, idx, w, gout, False)
    disp = epkit.Dispatcher(group, opts["E"], align=opts["align"], capacity=opts["capacity"],
                            transport=opts["transport"], exchange=opts["exchange"],
                            max_tokens_per_rank=opts.get("max_tokens_per_rank"))
    first = None
    for i in range(n):
        res, _ = round_trip(group, rank, xt, it, wt, gt, opts,
                            dispatcher=disp if i % 2 else None, check=False)
        if first is None:
            first = res
            continue
        for k, v in res.items():
            assert _bits(v) == _bits(first[k]), f"rank {rank}: call {i}: {k} differs from call 0"
    return first


def with_threads(group, rank, x, idx, w, gout, opts, nthreads):
    """One round with torch's intra-op pool at ``nthreads`` (at::parallel_for splits the rows
    of pack / unpack / combine / backward into grains of 16 when it has more than one)."""
    old = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        assert torch.get_num_threads() == nthreads
        xt, it, wt, gt = make_inputs(x, idx, w, gout, False)
        return round_trip(group, rank, xt, it, wt, gt, opts, check=False)[0]
    finally:
        torch.set_num_threads(old)


def variants(group, rank, x, idx, w, gout, opts, combos):
    """One round per (transport, exchange) in ``combos``; static results cut to the canonical
    rows (``expert_offsets[-1]``)."""
    xt, it, wt, gt = make_inputs(x, idx, w, gout, False)
    out = {}
    for transport, exchange in combos:
        o = dict(opts, transport=transport, exchange=exchange)
        if exchange == "static":
            o["max_tokens_per_rank"] = opts["max_tokens_per_rank"]
        res, _ = round_trip(group, rank, xt, it, wt, gt, o, check=False)
        M = int(res["expert_offsets"][-1])
        for k in ("expert_x", "row_src", "row_weight"):
            res[k] = res[k][:M]
        res.pop("bytes_sent")
        out[(transport, exchange)] = res
    return out


# ---- the Dispatcher's workspace: reused buffers never reach a caller ------------------------

def _dispatcher(group, opts, **kw):
    return epkit.Dispatcher(group, opts["E"], align=opts["align"], capacity=opts["capacity"],
                            transport=opts["transport"], exchange=opts["exchange"],
                            payload=opts.get("payload"),
                            max_tokens_per_rank=opts.get("max_tokens_per_rank"), **kw)


def _forward(disp, xt, it, wt, opts):
    xt = xt.detach().requires_grad_(True)
    wt = wt.detach().requires_grad_(True)
    d = disp.dispatch(xt, it, wt)
    if opts["exchange"] == "lazy":
        d = d.wait()
    y = y_of(d, opts["y_dtype"], False)
    y.retain_grad()
    out = disp.combine(y, d, weighted=opts["weighted"])
    if opts["exchange"] == "lazy":
        out = out.wait()
    return d, xt, wt, y, out


def workspace_rounds(group, rank, x, idx, w, gout, opts):
    """Two steps through one Dispatcher with its workspace, interleaved the way activation
    checkpointing or pipelining does: forward A, forward B, backward A, backward B. Both equal
    a workspace-free Dispatcher's results bit for bit; no output, gradient or saved tensor
    shares storage with a workspace buffer; release() frees it all and the next step agrees.
    Returns step A's results (for the reference)."""
    xt, it, wt, gt = make_inputs(x, idx, w, gout, False)
    xb = (xt.float() * -3.0).to(xt.dtype)  # step B: other tokens, the same routing
    plain = _dispatcher(group, opts, workspace=False)
    want_a, _ = round_trip(group, rank, xt, it, wt, gt, opts, dispatcher=plain, check=False)
    want_b, _ = round_trip(group, rank, xb, it, wt, gt, opts, dispatcher=plain, check=False)
    assert plain.workspace_bytes == 0
    disp = _dispatcher(group, opts)
    a = _forward(disp, xt, it, wt, opts)
    b = _forward(disp, xb, it, wt, opts)
    g = gt.to(a[4].dtype)
    a[4].backward(g)
    b[4].backward(g)
    held = disp._workspace.buffers() if disp._workspace is not None else []
    if opts["exchange"] != "lazy":  # the lazy schedule's buffers are always fresh
        assert disp.workspace_bytes > 0 and held, f"rank {rank}: the workspace was not used"
    for name, (d, xg, wg, y, out) in (("A", a), ("B", b)):
        outs = {f"{name} {k}": v for k, v in dispatch_outputs(d).items()}
        outs.update({f"{name} out": out, f"{name} grad_x": xg.grad, f"{name} grad_w": wg.grad,
                     f"{name} grad_y": y.grad, f"{name} send_map": d.handle.send_map,
                     f"{name} recv_map": d.handle.recv_map, f"{name} plan": d.handle.plan,
                     f"{name} plan_host": d.handle.plan_host})
        assert_disjoint(rank, "outputs and the workspace",
                        {**outs, **{f"workspace {i}": t for i, t in enumerate(held)}})
        want = want_a if name == "A" else want_b
        got = {"out": out, "grad_x": xg.grad, "grad_w": wg.grad, "expert_x": d.expert_x}
        for k, v in got.items():
            assert _bits(to_numpy(v)) == _bits(want[k]), (
                f"rank {rank}: step {name}'s {k} differs with the workspace")
    disp.release()
    assert disp.workspace_bytes == 0
    again, _ = round_trip(group, rank, xt, it, wt, gt, opts, dispatcher=disp, check=False)
    for k, v in again.items():
        assert _bits(v) == _bits(want_a[k]), f"rank {rank}: {k} differs after release()"
    return want_a
