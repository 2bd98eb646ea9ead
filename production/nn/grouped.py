"""Grouped matrix multiply over expert-major segments.

``grouped_mm(x, w, offsets)`` multiplies every segment ``x[offsets[g]:offsets[g+1]]`` by
``w[g]``. It uses ``torch._grouped_mm`` where the installed torch has it for the device and
dtype and the operands meet its layout rules (16-byte aligned strides), else a loop over
segments. Both give the same rows: each segment is an ordinary matmul.

The loop is a custom op (``epkit_nn::segment_mm``, its weight gradient
``epkit_nn::segment_mm_wgrad``) with fake kernels, so ``torch.compile(fullgraph=True)`` traces
it without reading the offsets (torch 2.13 traces ``torch._grouped_mm`` for bfloat16 only: its
meta kernel mirrors the CUDA kernel's dtype rule, though the CPU kernel also takes float32).
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm", "grouped_mm_backend"]

IMPLS = ("auto", "torch", "loop")

# (device type, dtype) -> bool: did a tiny torch._grouped_mm forward and backward work there?
_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def _compiling() -> bool:
    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run ``torch._grouped_mm`` once, forward and backward, on tiny operands (16-byte strides)."""
    key = (device.type, dtype)
    if key not in _PROBED:
        ok = hasattr(torch, "_grouped_mm")
        if ok and not _compiling():
            try:
                with torch.enable_grad():
                    a = torch.ones(32, 16, device=device, dtype=dtype, requires_grad=True)
                    b = torch.ones(3, 32, 16, device=device, dtype=dtype).transpose(1, 2)
                    b.requires_grad_()
                    # unaligned and empty groups, as routing makes them
                    offs = torch.tensor([5, 5, 32], device=device, dtype=torch.int32)
                    y = torch._grouped_mm(a, b, offs=offs)
                    torch.autograd.grad(y, (a, b), torch.ones_like(y))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        elif ok:
            # Traced before any eager call: the documented support, CPU, or CUDA sm90+ bf16.
            ok = device.type == "cpu" or (
                device.type == "cuda" and dtype == torch.bfloat16
                and torch.cuda.get_device_capability(device) >= (9, 0))
        _PROBED[key] = ok
    return _PROBED[key]


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned strides (and base address, checked eagerly)."""
    size = t.element_size()
    if any(s != 1 and (s * size) % 16 for s in t.stride()):
        return False
    return _compiling() or t.data_ptr() % 16 == 0


def grouped_mm_backend(x: torch.Tensor, w: torch.Tensor, impl: str = "auto") -> str:
    """``"torch"`` (``torch._grouped_mm``) or ``"loop"``: what :func:`grouped_mm` would use."""
    if impl not in IMPLS:
        raise ValueError(f"epkit.nn: grouped_mm impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if x.dtype != w.dtype or not _probe(x.device, x.dtype):
        return "loop"
    if _compiling() and x.dtype != torch.bfloat16:  # the meta kernel's rule (module docstring)
        return "loop"
    return "torch" if _aligned(x) and _aligned(w) and (w.shape[-1] * x.element_size()) % 16 == 0 else "loop"


def _segments(offsets: torch.Tensor):
    bounds = offsets.tolist()
    return [(g, a, b) for g, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]


@torch.library.custom_op("epkit_nn::segment_mm", mutates_args=())
def segment_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[a:b] = x[a:b] @ w[g]`` per segment; rows outside every segment are 0."""
    out = x.new_zeros((x.shape[0], w.shape[-1]))
    for g, a, b in _segments(offsets):
        torch.mm(x[a:b], w[g], out=out[a:b])
    return out


@segment_mm.register_fake
def _(x, w, offsets):
    return x.new_empty((x.shape[0], w.shape[-1]))


@torch.library.custom_op("epkit_nn::segment_mm_wgrad", mutates_args=())
def segment_mm_wgrad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[g] = x[a:b].T @ grad[a:b]`` per segment ``g`` (``[G, K, N]``, 0 for empty ones)."""
    out = x.new_zeros((offsets.shape[0] - 1, x.shape[1], grad.shape[1]))
    for g, a, b in _segments(offsets):
        torch.mm(x[a:b].t(), grad[a:b], out=out[g])
    return out


@segment_mm_wgrad.register_fake
def _(x, grad, offsets):
    return x.new_empty((offsets.shape[0] - 1, x.shape[1], grad.shape[1]))


def _setup(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    gx = segment_mm(grad, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    gw = segment_mm_wgrad(x, grad, offsets) if ctx.needs_input_grad[1] else None
    return gx, gw, None


segment_mm.register_autograd(_backward, setup_context=_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Segment-wise matmul: ``out[offsets[g]:offsets[g+1]] = x[offsets[g]:offsets[g+1]] @ w[g]``.

    Args:
        x: ``[M, K]`` rows in expert-major order.
        w: ``[G, K, N]`` one matrix per segment (a transposed view of ``[G, N, K]`` is fine).
        offsets: ``[G+1]`` integer, segment starts and the end of the last one (an
            ``expert_offsets`` of :class:`epkit.Dispatch`), ``offsets[0] == 0``; rows at or past
            ``offsets[G]`` get zeros (loop) or unspecified values (``torch._grouped_mm``), which
            combine never reads.
        impl: ``"auto"``, ``"torch"`` or ``"loop"``.

    Returns:
        ``[M, N]`` in x's dtype, differentiable in ``x`` and ``w``.
    """
    if grouped_mm_backend(x, w, impl) == "torch":
        return torch._grouped_mm(x, w, offs=offsets[1:].to(device=x.device, dtype=torch.int32))
    return segment_mm(x, w, offsets)
