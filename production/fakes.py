"""Fake kernels of the C++ ops (``csrc/``): output shapes and dtypes for ``torch.compile`` and
meta tensors. Every routing-dependent size arrives as a SymInt argument; none is guessed.

Each fake first runs the op's metadata checks, the very functions the Triton kernels open with
(``epkit.triton.rowchecks`` / ``wirechecks``, written once; they import no Triton), up to the
first check that needs the plan's words or the tensors' data: a bad call raises the C++ kernel's
message while tracing, not a KeyError or a negative size (tests/triton/test_arg_messages.py)."""

from __future__ import annotations

import torch

from .plan import WORD_HEADER, plan_size
from .transports import by_code
from .triton import rowchecks as ck
from .triton import wirechecks as wc
from epkit.reference import abi

@torch.library.register_fake("epkit::layout")
def _(topk_idx, num_experts, num_ranks):
    ck.check_layout_args(topk_idx, num_experts, num_ranks)
    T = topk_idx.shape[0]
    long = dict(dtype=torch.int64, device=topk_idx.device)
    return (topk_idx.new_empty((num_experts,), **long), topk_idx.new_empty((num_ranks,), **long),
            topk_idx.new_empty((num_ranks,), **long),
            topk_idx.new_empty((T, num_ranks), dtype=torch.bool))


@torch.library.register_fake("epkit::prepare")
def _(x, topk_idx, topk_weights, num_experts, num_ranks, pre_error, payload):
    wc.check_prepare_args(x, topk_idx, topk_weights, num_experts, num_ranks, pre_error, payload)
    return topk_idx.new_empty((WORD_HEADER + num_experts + num_ranks,), dtype=torch.int64)


@torch.library.register_fake("epkit::plan")
def _(words, rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank):
    wc.check_plan_args(words, rank, num_experts, transport, exchange)
    return words.new_empty((plan_size(words.shape[0], num_experts),))


@torch.library.register_fake("epkit::pack")
def _(x, topk_idx, topk_weights, plan, transport, num_ranks, send_bytes, plan_host=None):
    wc.check_pack_args("epkit.pack", x, topk_idx, topk_weights, plan, transport, send_bytes,
                       plan_host)
    T, K = topk_idx.shape
    cols = by_code(transport).send_map_cols(K, num_ranks)
    return x.new_empty((send_bytes,), dtype=torch.uint8), x.new_empty((T, cols), dtype=torch.int64)


@torch.library.register_fake("epkit::pack_into")
def _(x, topk_idx, topk_weights, plan, transport, num_ranks, send, plan_host=None):
    op = "epkit.pack_into"
    wc.check_send_buffer(op, send, x.device)
    wc.check_pack_args(op, x, topk_idx, topk_weights, plan, transport, send.numel(), plan_host)
    T, K = topk_idx.shape  # send (the workspace's buffer) is written in place
    return x.new_empty((T, by_code(transport).send_map_cols(K, num_ranks)), dtype=torch.int64)


@torch.library.register_fake("epkit::unpack")
def _(recv, plan, transport, hidden, dtype, topk, recv_rows, expert_rows, plan_host=None):
    wc.check_unpack_args(recv, plan, transport, hidden, plan_host)
    cols = by_code(transport).recv_map_cols(topk)
    return (recv.new_empty((expert_rows, hidden), dtype=dtype),
            recv.new_empty((expert_rows, 3), dtype=torch.int64),
            recv.new_empty((expert_rows,), dtype=torch.float32),
            recv.new_empty((recv_rows, cols), dtype=torch.int64))


@torch.library.register_fake("epkit::gather_rows")
def _(expert_y, recv_map, row_weight, transport, weighted):
    ck.check_expert_side("epkit.gather_rows", expert_y, recv_map)
    wc.check_transport("epkit.gather_rows", transport)
    dtype = by_code(transport).back_dtype(expert_y.dtype)
    return expert_y.new_empty((recv_map.shape[0], expert_y.shape[1]), dtype=dtype)


@torch.library.register_fake("epkit::gather_units")
def _(expert_y, recv_map, row_weight, transport, weighted, first, out):
    ck.check_expert_side("epkit.gather_units", expert_y, recv_map)
    wc.check_transport("epkit.gather_units", transport)
    return None  # writes out (the return path's send buffer) in place


@torch.library.register_fake("epkit::reduce_tokens")
def _(back, send_map, topk_idx, topk_weights, num_experts, num_ranks, transport, weighted, out_dtype,
      ranks_per_node=1, first=None):
    ck.check_reduce_options("epkit.reduce_tokens", num_experts, num_ranks, ranks_per_node)
    wc.check_transport("epkit.reduce_tokens", transport)
    # dedup without first: back [S, 4 H / itemsize] in y's dtype (one float32 row per token row)
    compact = first is not None or by_code(transport).back_dtype(back.dtype) == back.dtype
    H = back.shape[1] if compact else back.shape[1] * back.element_size() // 4
    return back.new_empty((send_map.shape[0], H), dtype=out_dtype)


@torch.library.register_fake("epkit::scatter_rows")
def _(src, send_map, send_rows):
    wc.check_scatter_args("epkit.scatter_rows", src, send_map, send_rows)
    return src.new_empty((send_rows, src.shape[1]))


@torch.library.register_fake("epkit::empty_large")
def _(like, size, dtype):
    return like.new_empty(size, dtype=dtype)


@torch.library.register_fake("epkit::scatter_rows_into")
def _(src, send_map, out):
    wc.check_scatter_into_args("epkit.scatter_rows_into", src, send_map, out)
    return None  # writes out (the workspace's buffer) in place


@torch.library.register_fake("epkit::combine_backward_dest")
def _(recv, recv_map, row_weight, expert_y, weighted):
    ck.check_combine_backward_dest_args(recv, recv_map, row_weight, expert_y, weighted)
    return torch.empty_like(expert_y), expert_y.new_empty((expert_y.shape[0],), dtype=torch.float32)


@torch.library.register_fake("epkit::quantize_mxfp8")
def _(x):
    ck.check_quantize_args("epkit.quantize_mxfp8", x, abi.MXFP8_BLOCK)
    T, H = x.shape
    return (x.new_empty((T, H), dtype=torch.float8_e4m3fn),
            x.new_empty((T, H // abi.MXFP8_BLOCK), dtype=torch.uint8))


@torch.library.register_fake("epkit::quantize_fp8_block128")
def _(x):
    ck.check_quantize_args("epkit.quantize_fp8_block128", x, abi.FP8_BLOCK128_BLOCK)
    T, H = x.shape
    return (x.new_empty((T, H), dtype=torch.float8_e4m3fn),
            x.new_empty((T, H // abi.FP8_BLOCK128_BLOCK), dtype=torch.float32))


@torch.library.register_fake("epkit::gather_slot_values")
def _(values, recv_map, first, out_rows):
    ck.check_gather_slot_values_args(values, recv_map, first, out_rows)
    return values.new_empty((out_rows,), dtype=torch.float32)


@torch.library.register_fake("epkit::scatter_slot_values")
def _(back, send_map, topk_idx, first, num_experts, num_ranks, transport):
    ck.check_experts_ranks("epkit.scatter_slot_values", num_experts, num_ranks)
    wc.check_transport("epkit.scatter_slot_values", transport)
    return back.new_empty(topk_idx.shape, dtype=torch.float32)


