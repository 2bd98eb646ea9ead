"""The argument checks of the row-arithmetic ops and the quantizers (csrc/checks.h, the same
kinds of message: ``epkit.<op>: <argument> ...``), in Python before any launch.

Two kinds, as in checks.h:
- metadata checks (dims, dtypes, devices, shapes, options): they read no tensor data, so they
  run on every device;
- map-range reports (``first_bad``): the C++ kernels raise for a map entry out of range, which
  needs the data on the host. Off the device path (``on_host``: a Triton op called directly on
  CPU tensors) that read is free, so the Triton ops raise the C++ kernel's error there too; on
  the device path (a GPU, or the interpreter standing in for one) it would be a host read, so
  the kernels mask instead (an entry out of range reads and writes nothing) and nothing is
  raised.

The primitives (``fail``, ``check_dim``, ``check_dtype``, ...) are the one Python body of
checks.h's helpers: wirechecks.py (pack / unpack), layout.py and plan.py use them. The checks that differ by transport are the paths'
(pairs.py, dedup.py); the shared ones here take the path an op resolved and ask it, and each
op resolves it where checks.h checks the transport code, so the errors come in checks.h's
order.
"""

from __future__ import annotations

import torch

from ..memory import device_path

MAX_RANKS = 1 << 20
MAX_EXPERTS = (1 << 31) - 1
FLOATS = (torch.float32, torch.bfloat16)


def fail(op: str, msg: str):
    raise RuntimeError(f"{op}: {msg}")


def check_dim(op, name, t, dim):
    if t.dim() != dim:
        fail(op, f"{name} must be {dim}-D, got {t.dim()}-D of shape {list(t.shape)}")


def check_dtype(op, name, t, dt):
    if t.dtype != dt:
        fail(op, f"{name} must be {dt}, got {t.dtype}")


def check_float_dtype(op, name, dt):
    if dt not in FLOATS:
        fail(op, f"{name} must be float32 or bfloat16, got {dt}")


def check_index_dtype(op, name, t):
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        fail(op, f"{name} must have an integer dtype, got {t.dtype}")


def check_device(op, name, t, dev):
    if t.device != dev:
        fail(op, f"{name} is on {t.device}, expected {dev}")


def check_size(op, name, t, d, want, what):
    if t.shape[d] != want:
        fail(op, f"{name} must have size({d}) == {want} ({what}), got shape {list(t.shape)}")


def check_map(op, name, t, dim=2):
    check_dim(op, name, t, dim)
    check_dtype(op, name, t, torch.int64)


def check_nonneg(op, name, v):
    if v < 0:
        fail(op, f"{name} must be >= 0, got {v}")


def check_num_ranks(op, R):
    if not 1 <= R <= MAX_RANKS:
        fail(op, f"num_ranks must be in [1, {MAX_RANKS}], got {R}")


def check_experts_ranks(op, E, R):
    """num_experts E >= 1, a multiple of num_ranks R (checks.h check_experts_ranks)."""
    check_num_ranks(op, R)
    if not 1 <= E <= MAX_EXPERTS:
        fail(op, f"num_experts must be in [1, {MAX_EXPERTS}], got {E}")
    if E % R:
        fail(op, f"num_experts {E} is not a multiple of num_ranks {R}")


def check_layout_args(topk_idx, E, R):
    """checks.h check_layout_args."""
    op = "epkit.layout"
    check_dim(op, "topk_idx", topk_idx, 2)
    check_index_dtype(op, "topk_idx", topk_idx)
    check_experts_ranks(op, E, R)


def check_weights_1d(op, row_weight, y):
    check_dim(op, "row_weight", row_weight, 1)
    check_dtype(op, "row_weight", row_weight, torch.float32)
    check_device(op, "row_weight", row_weight, y.device)
    check_size(op, "row_weight", row_weight, 0, y.shape[0], "rows of expert_y")


def check_expert_side(op, y, recv_map):
    """What the expert-side ops check before the transport: expert_y [M, H], recv_map [N, C]
    int64 on its device."""
    check_dim(op, "expert_y", y, 2)
    check_map(op, "recv_map", recv_map)
    check_device(op, "recv_map", recv_map, y.device)


def check_units_out(op, out, y):
    """gather_units' out: [*, H] of expert_y's dtype, on its device, contiguous."""
    check_dim(op, "out", out, 2)
    check_dtype(op, "out", out, y.dtype)
    check_device(op, "out", out, y.device)
    if not out.is_contiguous():
        fail(op, "out must be contiguous")
    check_size(op, "out", out, 1, y.shape[1], "hidden of expert_y")


def check_send_map_args(op, back, send_map, topk_idx, R, path):
    check_map(op, "send_map", send_map)
    check_device(op, "send_map", send_map, back.device)
    check_dim(op, "topk_idx", topk_idx, 2)
    check_index_dtype(op, "topk_idx", topk_idx)
    check_device(op, "topk_idx", topk_idx, back.device)
    check_size(op, "topk_idx", topk_idx, 0, send_map.shape[0], "tokens of send_map")
    check_size(op, "send_map", send_map, 1, path.send_map_cols(topk_idx.shape[1], R),
               path.SEND_MAP)


def check_reduce_options(op, E, R, G):
    """What reduce_tokens checks before the transport."""
    check_experts_ranks(op, E, R)
    if G < 1 or R % G:
        fail(op, f"ranks_per_node {G} must be >= 1 and divide {R}")


def check_reduce_tokens_args(back, send_map, topk_idx, topk_weights, R, path, weighted,
                             out_dtype, first):
    """reduce_tokens' checks after the transport (check_reduce_options before it)."""
    op = "epkit.reduce_tokens"
    check_dim(op, "back", back, 2)
    check_float_dtype(op, "back", back.dtype)
    check_float_dtype(op, "out_dtype", out_dtype)
    check_send_map_args(op, back, send_map, topk_idx, R, path)
    path.check_first(op, first, -1, "", back.device)
    path.check_back(op, back, first)
    if weighted:
        check_dim(op, "topk_weights", topk_weights, 2)
        check_dtype(op, "topk_weights", topk_weights, torch.float32)
        check_device(op, "topk_weights", topk_weights, back.device)
        if topk_weights.shape != topk_idx.shape:
            fail(op, f"topk_weights must have the shape of topk_idx {list(topk_idx.shape)}, "
                     f"got {list(topk_weights.shape)}")


def check_combine_backward_dest_args(recv, recv_map, row_weight, y, weighted):
    op = "epkit.combine_backward_dest"
    check_dim(op, "expert_y", y, 2)
    check_float_dtype(op, "expert_y", y.dtype)
    check_dim(op, "recv", recv, 2)
    check_float_dtype(op, "recv", recv.dtype)
    check_device(op, "recv", recv, y.device)
    check_map(op, "recv_map", recv_map)
    check_device(op, "recv_map", recv_map, y.device)
    check_size(op, "recv", recv, 0, recv_map.shape[0], "rows of recv_map")
    check_size(op, "recv", recv, 1, y.shape[1], "hidden of expert_y")
    if weighted:
        check_weights_1d(op, row_weight, y)


def check_quantize_args(op, x, block):
    check_dim(op, "x", x, 2)
    check_float_dtype(op, "x", x.dtype)
    if x.shape[1] % block:
        fail(op, f"x must be [T, H] with H % {block} == 0, got H = {x.shape[1]}")


def check_gather_slot_values_args(values, recv_map, first, out_rows):
    op = "epkit.gather_slot_values"
    check_dim(op, "values", values, 1)
    check_dtype(op, "values", values, torch.float32)
    check_map(op, "recv_map", recv_map)
    check_device(op, "recv_map", recv_map, values.device)
    check_map(op, "first", first, 1)
    check_device(op, "first", first, values.device)
    check_size(op, "first", first, 0, recv_map.shape[0], "rows of recv_map")
    check_nonneg(op, "out_rows", out_rows)


def check_scatter_slot_values_args(back, send_map, topk_idx, first, R, path):
    """scatter_slot_values' checks after the transport (check_experts_ranks before it)."""
    op = "epkit.scatter_slot_values"
    check_dim(op, "back", back, 1)
    check_dtype(op, "back", back, torch.float32)
    check_send_map_args(op, back, send_map, topk_idx, R, path)
    check_map(op, "first", first, 1)
    check_device(op, "first", first, back.device)


# ---- data checks: CPU tensors only (a host read elsewhere) ---------------------------------
def on_host(t: torch.Tensor) -> bool:
    """Whether t's data may be read for an error message without a host read: off the device
    path only (``epkit.memory.device_path``: a CUDA tensor, or any unmarked CPU tensor while the
    Triton kernels stand in for the GPU's under ``EPKIT_KERNELS=triton``). A Triton op called
    directly on CPU tensors (the tests, the group simulation) raises the C++ errors; on the
    device path it masks, as on a GPU, and reads nothing back."""
    return not device_path(t)


def first_bad(bad: torch.Tensor) -> int:
    """The flat index of the first True of bad (a CPU bool tensor), or -1."""
    flat = bad.reshape(-1)
    return int(flat.to(torch.uint8).argmax()) if bool(flat.any()) else -1


def check_map_range(op, name, m: torch.Tensor, rows: int, what: str):
    """checks.h check_map_range: raises for the first entry of m outside [-1, rows)."""
    i = first_bad((m < -1) | (m >= rows))
    if i >= 0:
        fail(op, f"{name} entry {i} is {int(m.reshape(-1)[i])}, outside [-1, {rows}) ({what})")


def check_expert_range(op, idx: torch.Tensor, E: int):
    i = first_bad((idx < -1) | (idx >= E))
    if i >= 0:
        fail(op, f"topk_idx entry {i} is {int(idx.reshape(-1)[i])}, outside [-1, {E})")
