"""The MXFP8 payload: quantize at the source, move E4M3 bytes and E8M0 codes, backward unquantized.

Each token row travels as ``H`` E4M3 bytes followed by ``H // 32`` scale codes (gloo has no
float8 type: rows move as uint8). The expert side gets ``expert_x`` as ``float8_e4m3fn`` and
``expert_scale`` uint8, exactly ``epkit.reference``'s rows; and ``expert_x_hp`` ``[M, H]``
float32, the dequantized values, through which the gradient flows back *unquantized*
(straight-through): the backward is the ordinary dispatch backward of that gradient.
"""

from __future__ import annotations

import torch

from epkit import ops
from epkit.reference.abi import MXFP8_BLOCK

C = ops.C


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` float32/bfloat16 (finite, ``H % 32 == 0``) -> ``(q [T, H] float8_e4m3fn,
    codes [T, H // 32] uint8)``, bit for bit ``epkit.reference.quantize_mxfp8``."""
    return C.quantize_mxfp8(x.contiguous())


def dequantize_mxfp8(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``q [T, H]`` E4M3, ``codes [T, H // 32]`` uint8 -> ``[T, H]`` float32, ``q * 2**(code - 127)``
    (exact: a 4-bit significand times a power of two fits float32)."""
    # 2**(code - 127) built from its bits: code << 23 is that float32 for code >= 1; code 0 is
    # the subnormal 2**-127 (0x00400000).
    c = codes.to(torch.int32)
    scale = torch.where(c == 0, torch.tensor(0x00400000, dtype=torch.int32), c << 23)
    scale = scale.view(torch.float32)
    B = MXFP8_BLOCK
    return (q.float().view(q.shape[0], q.shape[1] // B, B) * scale.unsqueeze(-1)).view(q.shape)


class _MXDispatch(torch.autograd.Function):
    """x, topk_weights -> (expert_x_hp, row_weight | q, scale, row_src, send_map, recv_map)."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, plan, group_name, transport, exchange, sizes):
        S, N, M = sizes
        H = x.shape[1]
        q, codes = C.quantize_mxfp8(x)
        rows = torch.cat([q.view(torch.uint8), codes], dim=1)  # [T, H + H/32] bytes
        payload, row_src, row_weight, send_map, recv_map = ops.dispatch_tokens(
            rows, topk_idx, topk_weights.detach(), plan, group_name, transport, exchange, S, N, M)
        expert_x = payload[:, :H].contiguous().view(torch.float8_e4m3fn)
        expert_scale = payload[:, H:].contiguous()
        hp = dequantize_mxfp8(expert_x, expert_scale)
        ctx.save_for_backward(send_map, recv_map, topk_idx, plan)
        ctx.meta = (group_name, transport, exchange, x.dtype)
        ctx.mark_non_differentiable(expert_x, expert_scale, row_src, send_map, recv_map)
        return hp, row_weight, expert_x, expert_scale, row_src, send_map, recv_map

    @staticmethod
    def backward(ctx, grad_hp, grad_row_weight, *_):
        send_map, recv_map, topk_idx, plan = ctx.saved_tensors
        group_name, transport, exchange, x_dtype = ctx.meta
        grad_x, grad_w = ops.dispatch_tokens_backward(
            grad_hp.contiguous(), grad_row_weight, send_map, recv_map, topk_idx, plan,
            group_name, transport, exchange, x_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def dispatch_mxfp8(x, topk_idx, topk_weights, plan, group_name, transport, exchange, sizes):
    return _MXDispatch.apply(x, topk_weights, topk_idx, plan, group_name, transport, exchange,
                             sizes)
