"""The argument checks of pack, unpack and scatter_rows (csrc/checks.h, same kinds of message:
``epkit.<op>: <argument> ...``), in Python before any launch.

They read tensor metadata and the plan's host words only (the op's ``plan_host``: on the
device path the mirror count_exchange made), never device data: so the checks that depend on
routing data (a token's expert id out of range, a chunk that disagrees with its plan) are not
here; the kernels mask them (pack) or report them through unpack's status word, whose bits
are here too (unpack and the paths' index passes, pairs.py and dedup.py, set them).

The checks that differ by transport take the path (pairs.py or dedup.py, resolved by
``transports.path_of``) and ask it; the path modules import this one, not the other way round.

The ``check_<op>_args`` functions are each op's metadata checks up to the first that needs the
kernel path or the plan's words: the Triton kernels open with them, and the fake kernels
(production/fakes.py) run them too, so a bad call raises the C++ kernel's message under
torch.compile and on meta tensors. Nothing here imports Triton.
"""

from __future__ import annotations

import functools

import torch

from epkit.reference import abi

from .. import plan as W
from ..transports import TABLE as _TRANSPORTS
# The basic checks are rowchecks' (the same checks.h helpers, one body each).
from .rowchecks import (MAX_EXPERTS, MAX_RANKS, check_device, check_dim, check_dtype,  # noqa: F401
                        check_experts_ranks, check_float_dtype, check_index_dtype, check_map,
                        check_nonneg, check_num_ranks, check_size, fail)

__all__ = ["fail", "check_dim", "check_routing_args", "check_plan_tensor", "check_nonneg",
           "check_transport", "check_prepare_args", "check_plan_args", "check_pack_args",
           "check_unpack_args", "check_scatter_args", "check_scatter_into_args",
           "check_plan_header", "check_plan_transport", "check_plan_chunks", "check_send_buffer",
           "check_map", "row_bytes", "STATUS_BITS", "status_bit"]

TRANSPORT, ALIGN = abi.PLAN_FIELDS.index("transport"), abi.PLAN_FIELDS.index("align")
PRE = {name: i for i, name in enumerate(abi.PRE_ERROR_FIELDS)}  # pre_error's fields
BLOCKS = {abi.PAYLOAD_CODES[n]: b for n, b in abi.PAYLOAD_BLOCKS.items()}  # payload code -> block

# The unpack status bits: what the device checks of the received chunks found (the bits of the
# old CUDA kernel; unpack.py's docstring says how they travel).
ST_INBAND, ST_SLOTS, ST_ROWS, ST_SLOT_ROW, ST_EXPERT_ROW, ST_SHAPE, ST_EXPERT_TOTAL = (
    1, 2, 4, 8, 16, 32, 64)
STATUS_BITS = {
    ST_INBAND: "a static chunk's in-band row count differs from the plan's recv_counts",
    ST_SLOTS: "the slots a source sent (in-band or by its rows' n) differ from the plan's "
              "recv_slots",
    ST_ROWS: "the plan's kept blocks (recv_kept) do not cover the rows received",
    ST_SLOT_ROW: "a corrupt slot row (k >= topk or local expert >= L)",
    ST_EXPERT_ROW: "a slot overruns its expert's segment or repeats k",
    ST_SHAPE: "the plan's sizes differ from the buffer, recv_rows or expert_rows",
    ST_EXPERT_TOTAL: "an expert received a count that disagrees with the plan",
}


def status_bit(cond: torch.Tensor, bit: int) -> torch.Tensor:
    """``bit`` where any element of cond holds, else 0 (a 0-d int64 tensor, no host read)."""
    return cond.any().to(torch.int64) * bit


def status_of(bits) -> torch.Tensor:
    """The status word of a list of :func:`status_bit` results: their OR (a check that fails
    twice, or two checks of one kind, set their bit once; a sum would carry into the next
    bit and name another failure)."""
    return functools.reduce(torch.bitwise_or, bits)


# code -> name of the transports that are a kernel path (their rows are their own): made once,
# as the kernel tiers' paths are (every op checks its code against it)
_KERNEL_PATHS = {t.code: t.name for t in sorted(_TRANSPORTS.values(), key=lambda t: t.code)
                 if t.path == t.code}


def check_transport(op, transport: int) -> None:
    """checks.h check_transport: the code names a kernel path."""
    if transport not in _KERNEL_PATHS:
        choices = " or ".join(f"{code} ({name})" for code, name in _KERNEL_PATHS.items())
        fail(op, f"transport must be {choices}, got {transport}")


def check_routing_args(op, x, topk_idx, topk_weights):
    """x [T, H], topk_idx [T, K] of an integer dtype, topk_weights [T, K] float32, one device."""
    check_dim(op, "x", x, 2)
    check_dim(op, "topk_idx", topk_idx, 2)
    check_index_dtype(op, "topk_idx", topk_idx)
    check_device(op, "topk_idx", topk_idx, x.device)
    check_size(op, "topk_idx", topk_idx, 0, x.shape[0], "tokens of x")
    check_dim(op, "topk_weights", topk_weights, 2)
    check_dtype(op, "topk_weights", topk_weights, torch.float32)
    check_device(op, "topk_weights", topk_weights, x.device)
    if topk_weights.shape != topk_idx.shape:
        fail(op, f"topk_weights must have the shape of topk_idx {list(topk_idx.shape)}, got "
                 f"{list(topk_weights.shape)}")


def check_plan_tensor(op, plan, dev):
    check_dim(op, "plan", plan, 1)
    check_dtype(op, "plan", plan, torch.int64)
    check_device(op, "plan", plan, dev)
    if not plan.is_contiguous():
        fail(op, "plan must be contiguous")
    if plan.numel() < W.PLAN_HEADER:
        fail(op, f"plan has {plan.numel()} words, fewer than its {W.PLAN_HEADER}-word header")


def check_prepare_args(x, topk_idx, topk_weights, E, R, pre_error, payload):
    """checks.h check_prepare_args. A nonzero code in ``pre_error`` is the caller's own verdict
    on its arguments, which then travels in the words: the tensors are not looked at."""
    op = "epkit.prepare"
    if len(pre_error) <= PRE["b"]:
        fail(op, "pre_error must be [code, a, b(, x dtype code(, max_tokens_per_rank))], got "
                 f"{len(pre_error)} values")
    check_num_ranks(op, R)
    if payload not in BLOCKS:
        fail(op, f"payload must be one of {abi.PAYLOAD_CHOICES}, got {payload}")
    if pre_error[PRE["code"]] != 0:
        if not -R <= E <= MAX_EXPERTS:
            fail(op, f"num_experts {E} leaves no room for the count words' header (num_ranks {R})")
        return
    check_experts_ranks(op, E, R)
    check_routing_args(op, x, topk_idx, topk_weights)
    check_float_dtype(op, "x", x.dtype)
    if len(pre_error) > PRE["max_tokens"] and pre_error[PRE["max_tokens"]] < -1:
        fail(op, "pre_error's max_tokens_per_rank must be >= -1, got "
                 f"{pre_error[PRE['max_tokens']]}")


def check_plan_args(words, rank, E, transport, exchange):
    """checks.h check_plan_args."""
    op = "epkit.plan"
    check_dim(op, "words", words, 2)
    check_dtype(op, "words", words, torch.int64)
    R = words.shape[0]
    if not 1 <= R <= MAX_RANKS:
        fail(op, f"words must have one row per rank (1 to {MAX_RANKS}), got {R}")
    if not (-R <= E <= MAX_EXPERTS and words.shape[1] == abi.WORD_HEADER + E + R):
        fail(op, f"words must be [R, 8 + E + R] for R = {R} and num_experts {E}, got "
                 f"{list(words.shape)}")
    if not 0 <= rank < R:
        fail(op, f"rank {rank} outside [0, {R})")
    check_transport(op, transport)
    codes = abi.EXCHANGE_CODES
    if not codes["ragged"] <= exchange <= codes["static"]:
        fail(op, f"exchange code {exchange} outside [0, 5]")


def check_plan_host(op, plan_host, plan):
    """checks.h check_plan_host: the plan's words in host memory (optional), 1-D int64 on the
    CPU, as many words as the plan."""
    if plan_host is None:
        return
    check_dim(op, "plan_host", plan_host, 1)
    check_dtype(op, "plan_host", plan_host, torch.int64)
    check_device(op, "plan_host", plan_host, torch.device("cpu"))
    if plan_host.numel() != plan.numel():
        fail(op, f"plan_host has {plan_host.numel()} words, the plan {plan.numel()}")


def check_pack_args(op, x, topk_idx, topk_weights, plan, transport, SB, plan_host=None):
    """checks.h check_pack_args, up to what the transport's path checks."""
    check_routing_args(op, x, topk_idx, topk_weights)
    check_plan_tensor(op, plan, x.device)
    check_plan_host(op, plan_host, plan)
    check_transport(op, transport)
    check_nonneg(op, "send_bytes", SB)


def check_unpack_args(recv, plan, transport, H, plan_host=None):
    """checks.h check_unpack_args, up to what the transport's path checks."""
    op = "epkit.unpack"
    check_dim(op, "recv", recv, 1)
    check_dtype(op, "recv", recv, torch.uint8)
    check_plan_tensor(op, plan, recv.device)
    check_plan_host(op, plan_host, plan)
    check_transport(op, transport)
    if not 0 <= H <= (1 << 31) - 1:
        fail(op, f"hidden {H} outside [0, 2^31)")


def check_scatter_args(op, src, send_map, S):
    """checks.h check_scatter_args (scatter_rows; scatter_rows_into with S its out's rows)."""
    check_dim(op, "src", src, 2)
    check_map(op, "send_map", send_map)
    check_device(op, "send_map", send_map, src.device)
    check_size(op, "send_map", send_map, 0, src.shape[0], "tokens of src")
    check_nonneg(op, "send_rows", S)


def check_scatter_into_args(op, src, send_map, out):
    """scatter_rows_into: check_scatter_args with out's rows, then out itself ([S, H] of src's
    dtype, on its device, contiguous)."""
    check_dim(op, "out", out, 2)
    check_scatter_args(op, src, send_map, out.shape[0])
    check_dtype(op, "out", out, src.dtype)
    check_device(op, "out", out, src.device)
    if not out.is_contiguous():
        fail(op, "out must be contiguous")
    check_size(op, "out", out, 1, src.shape[1], "hidden of src")


def check_send_buffer(op, send, dev):
    check_dim(op, "send", send, 1)
    check_dtype(op, "send", send, torch.uint8)
    check_device(op, "send", send, dev)
    if not send.is_contiguous():
        fail(op, "send must be contiguous")


def row_bytes(path, P: int) -> int:
    """B: one data row of the dispatch's first section (payload then the path's metadata)."""
    return P + path.META_BYTES


def check_plan_transport(op, p: list, path) -> None:
    """The plan was made for the transport the call names (its path, resolved already)."""
    if p[TRANSPORT] != path.CODE:
        fail(op, f"transport {path.CODE} disagrees with the plan's {p[TRANSPORT]}")


def check_plan_header(op, p: list, n: int) -> dict:
    """checks.h check_plan_header on the host words ``p``; returns the plan's slices."""
    R, E, L = p[W.RANKS], p[W.EXPERTS], p[W.LOCAL_EXPERTS]
    if not 1 <= R <= MAX_RANKS:
        fail(op, f"plan header: ranks {R} outside [1, {MAX_RANKS}]")
    if not (1 <= E <= MAX_EXPERTS and E % R == 0):
        fail(op, f"plan header: experts {E} is not a positive multiple of ranks {R}")
    if L != E // R:
        fail(op, f"plan header: local experts {L} != experts / ranks {E // R}")
    if p[TRANSPORT] not in (W.PAIRS, W.DEDUP):
        fail(op, f"plan header: transport {p[TRANSPORT]} is not 0 or 1")
    if p[ALIGN] < 1:
        fail(op, f"plan header: align {p[ALIGN]} < 1")
    if p[W.ERR_CODE] != 0:
        fail(op, f"the plan carries error code {p[W.ERR_CODE]} (raise it instead of using the "
                 "plan)")
    if n != W.plan_size(R, E):
        fail(op, f"plan has {n} words, PlanOffsets(R={R}, E={E}) needs {W.plan_size(R, E)}")
    return W.plan_slices(R, E)


def check_plan_chunks(op, p: list, sl: dict, recv: bool, path, total: int) -> None:
    """checks.h check_plan_chunks: every chunk of one direction holds its sections (those of
    ``path``, the plan's transport), the chunk sizes add up to ``total``."""
    R = p[W.RANKS]
    B = row_bytes(path, p[W.PAYLOAD_BYTES])
    slotted = path.SLOT_SECTIONS  # 0 (pairs): a chunk's slot section holds no row
    stat = p[W.STATIC_CAP] >= 0
    tokcap, slotcap, hdr = p[W.TOK_CAP], p[W.SLOT_CAP], 1 if stat else 0
    d_ = "recv" if recv else "send"
    counts, slots, nbytes = (p[sl[f"{d_}_{k}"]] for k in ("counts", "slots", "bytes"))
    if stat and tokcap != 1 + p[W.STATIC_CAP]:
        fail(op, f"plan header: static exchange with {tokcap} token rows per chunk and capacity "
                 f"{p[W.STATIC_CAP]}")
    if stat and slotted and slotcap < 1:
        fail(op, f"plan header: static exchange with slot rows {slotcap}")
    total_so_far = 0
    for d in range(R):
        nb, c, s = nbytes[d], counts[d], slots[d] * slotted
        if not (0 <= nb <= total - total_so_far):
            fail(op, f"plan: {d_}_bytes[{d}] = {nb} overruns the {total}-byte buffer")
        total_so_far += nb
        tok_rows = tokcap if tokcap >= 0 else c
        slot_rows = (slotcap if slotcap >= 0 else s) * slotted
        if not (0 <= c <= tok_rows - hdr and tok_rows <= nb // B):
            fail(op, f"plan: {d_}_counts[{d}] = {c} rows do not fit chunk {d} ({nb} bytes)")
        left = nb - tok_rows * B
        if not (0 <= s <= slot_rows - hdr * slotted and slot_rows <= left // abi.SLOT_ROW_BYTES):
            fail(op, f"plan: {d_}_slots[{d}] = {s} slot rows do not fit chunk {d} ({nb} bytes)")
    if total_so_far != total:
        fail(op, f"plan: {d_}_bytes add up to {total_so_far}, not {total}")
