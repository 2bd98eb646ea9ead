"""The payload table (production): how a token row travels, one entry per ``payload=`` value.

The mirror of ``epkit.reference.payloads`` (the spec; its docstring has the table). A quantized
payload is quantized at the source by its kernel (``C.quantize_<payload>``), its row put on the
wire as ``H`` E4M3 bytes then its ``H / block`` scales (gloo has no float8 type: rows move as
uint8), split again on arrival: ``expert_x`` float8_e4m3fn ``[M, H]``, ``expert_scale``
``[M, H / block]`` in the payload's scale dtype, and ``expert_x_hp`` ``[M, H]`` float32, the
dequantized rows, through which the gradient flows back *unquantized* (straight-through): the
backward is the ordinary dispatch backward of that gradient.

Adding a payload: its module here (quantize / dequantize), its kernels (csrc/cpu, epkit/triton,
registered like ``quantize_mxfp8``), a row in :data:`TABLE`; the reference first
(reference/payloads.py, abi.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import ops
from ..memory import device_path
from . import fp8_block128, mxfp8
from epkit.reference.abi import PAYLOAD_CODES, payload_bytes
from epkit.reference.abi import PayloadCodes as Codes

__all__ = ["Payload", "TABLE", "NAMES", "of", "dispatch_quantized", "round_trip"]


@dataclass(frozen=True)
class Payload(Codes):
    """One row of the table (code, block, quantized: the reference's :class:`Codes`). ``quantize``: x [T, H] float32/bfloat16 -> (q [T, H] float8_e4m3fn,
    scale [T, H / block] scale_dtype); ``dequantize``: (q, scale) -> [T, H] float32."""

    name: Optional[str]
    scale_dtype: Optional[torch.dtype] = None
    quantize: Optional[Callable] = None
    dequantize: Optional[Callable] = None

    def row_bytes(self, hidden: int, itemsize: int) -> int:
        """``P``: bytes of one token's payload on the wire (abi.payload_bytes)."""
        return payload_bytes(hidden, itemsize, self.name)

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the wire rows uint8 [T, P]: quantized at the source, E4M3 bytes then the
        scales' bytes (little-endian, as the host and the device store them)."""
        return quantize_rows(x, self.name)

    def from_rows(self, rows: torch.Tensor, hidden: int):
        """uint8 [M, P] wire rows -> (q [M, H] float8_e4m3fn, scale [M, H / block], the
        dequantized rows [M, H] float32)."""
        return dequantize_rows(rows, hidden, self.name)


# ---- the wire rows as ops: one launch each way on the device path (triton/<payload>.py), the
# payload's quantize / dequantize and a copy on the host

@torch.library.custom_op("epkit::quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor, payload: str) -> torch.Tensor:
    """``x [T, H]`` float32/bfloat16 -> the wire rows ``uint8 [T, P]`` of ``payload``: E4M3
    bytes, then the scales' bytes."""
    if device_path(x):
        return _kernels(payload).quantize_rows(x)
    q, scale = TABLE[payload].quantize(x)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


@quantize_rows.register_fake
def _(x, payload):
    return x.new_empty((x.shape[0], payload_bytes(x.shape[1], 1, payload)), dtype=torch.uint8)


@torch.library.custom_op("epkit::dequantize_rows", mutates_args=())
def dequantize_rows(rows: torch.Tensor, hidden: int, payload: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wire rows ``uint8 [M, P]`` -> ``(q [M, H] float8_e4m3fn, scale [M, H / block] the
    payload's scale dtype, [M, H] float32 the payload's dequantize of them)``."""
    if device_path(rows):
        return _kernels(payload).dequantize_rows(rows, hidden)
    pl = TABLE[payload]
    # copies, always: a slice of a single row is contiguous already, and an op's output may
    # not alias its input
    q = rows[:, :hidden].clone().view(torch.float8_e4m3fn)
    scale = rows[:, hidden:].clone().view(pl.scale_dtype)
    return q, scale, pl.dequantize(q, scale)


@dequantize_rows.register_fake
def _(rows, hidden, payload):
    M, pl = rows.shape[0], TABLE[payload]
    return (rows.new_empty((M, hidden), dtype=torch.float8_e4m3fn),
            rows.new_empty((M, hidden // pl.block), dtype=pl.scale_dtype),
            rows.new_empty((M, hidden), dtype=torch.float32))


def _kernels(payload: str):
    """The payload's Triton module (epkit.triton.<payload>: quantize_rows, dequantize_rows)."""
    import importlib

    return importlib.import_module(f"epkit.triton.{payload}")


TABLE = {
    None: Payload(None),
    "mxfp8": Payload("mxfp8", torch.uint8, mxfp8.quantize_mxfp8, mxfp8.dequantize_mxfp8),
    "fp8_block128": Payload("fp8_block128", torch.float32, fp8_block128.quantize_fp8_block128,
                            fp8_block128.dequantize_fp8_block128),
}
assert set(TABLE) == set(PAYLOAD_CODES), "abi.PAYLOAD_CODES and epkit.payloads.TABLE differ"
NAMES = tuple(n for n in TABLE if n is not None)


def of(name) -> Payload:
    """The entry for ``name``; the ``None`` entry for a name outside the table (its OPTION error
    already travels in the call's error words, so the path taken does not matter)."""
    try:
        return TABLE.get(name, TABLE[None])
    except TypeError:  # unhashable
        return TABLE[None]


class _QuantizedDispatch(torch.autograd.Function):
    """x, topk_weights -> (expert_x_hp, row_weight | q, scale, row_src, send_map, recv_map)."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, plan, plan_host, group_name, transport, sizes,
                name):
        S, N, M = sizes
        payload = TABLE[name]
        rows, row_src, row_weight, send_map, recv_map = ops.dispatch_tokens(
            payload.to_rows(x), topk_idx, topk_weights.detach(), plan, plan_host, group_name,
            transport, S, N, M)
        expert_x, expert_scale, hp = payload.from_rows(rows, x.shape[1])
        ctx.save_for_backward(send_map, recv_map, topk_idx, plan, plan_host)
        ctx.meta = (group_name, transport, x.dtype)
        ctx.mark_non_differentiable(expert_x, expert_scale, row_src, send_map, recv_map)
        ops.unmaterialized(ctx, hp)  # None, not zeros (a launch each), where the loss misses
        return hp, row_weight, expert_x, expert_scale, row_src, send_map, recv_map

    @staticmethod
    def backward(ctx, grad_hp, grad_row_weight, *_):
        send_map, recv_map, topk_idx, plan, plan_host = ctx.saved_tensors
        group_name, transport, x_dtype = ctx.meta
        grad_x, grad_w = ops.dispatch_tokens_backward(
            ops.grad_or_zeros(ctx, grad_hp), grad_row_weight, send_map, recv_map, topk_idx, plan,
            plan_host, group_name, transport, x_dtype)
        return grad_x, grad_w, *([None] * 7)


def dispatch_quantized(payload: Payload, x, topk_idx, topk_weights, plan, plan_host, group_name,
                       transport, sizes):
    """The eager dispatch of a quantized payload: ``(expert_x_hp, row_weight, expert_x,
    expert_scale, row_src, send_map, recv_map)``, the gradient straight through expert_x_hp."""
    # The payload travels by name: a string is a constant to torch.compile, a dataclass is not.
    return _QuantizedDispatch.apply(x, topk_weights, topk_idx, plan, plan_host, group_name,
                                    transport, sizes, payload.name)


class _RoundTrip(torch.autograd.Function):
    """``dequantize(quantize(x))`` float32 rows; the gradient passes straight through, cast to
    x's dtype (what a quantized dispatch's backward does)."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.dtype = x.dtype
        payload = TABLE[name]
        return payload.dequantize(*payload.quantize(x))

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def round_trip(payload: Payload, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H] float32 rounded through ``payload`` (DenseMoE's expert inputs)."""
    return _RoundTrip.apply(x, payload.name)
