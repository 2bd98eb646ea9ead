"""The checks production makes before anything moves, in the reference's order
(reference/validate.py): the options, the arguments' types, devices, dtypes and shapes, and
combine's arguments against their dispatch. Each yields a reason triple ``(code, a, b)`` that
the call header agrees between ranks (production/agree.py), so every rank raises the same error.

Nothing here raises for a bad option: a rank that raised alone would leave its peers waiting in
their first collective. ``cfg`` is the :class:`epkit.Dispatcher` whose options are checked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import transports
from .agree import COMBINE, WEIGHTED, header, tensor_error
from .collectives import dtype_code, group_name
from .lazy import PendingDispatch
from .result import Dispatch, seal_of
from epkit.reference import abi
from epkit.reference.errors import Reason
from epkit.reference.validate import as_int, factor_word, option_triple

__all__ = ["option_words", "option_error", "local_error", "combine_words"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_DEVICE_CODES = {"cpu": 0, "cuda": 1, "meta": 2}


def _code(table: dict, name) -> int:
    """A name's option code, or -1 for a name that is not in ``table`` (or not hashable)."""
    try:
        return int(table.get(name, -1))
    except TypeError:
        return -1


def option_words(cfg) -> list[int]:
    """``[E, align, capacity, transport, exchange, payload, max_tokens, capacity factor,
    ranks_per_node]`` as header codes (agree.py): integers as given (-1 for None or a
    non-integer), names as their codes, the factor as its float64 bits, ranks_per_node
    resolved (``Dispatcher.resolved_ranks_per_node``)."""
    return [as_int(cfg.num_experts, -1), as_int(cfg.align, -1), as_int(cfg.capacity, -1),
            _code(abi.TRANSPORT_CODES, cfg.transport), _code(abi.EXCHANGE_CODES, cfg.exchange),
            _code(abi.PAYLOAD_CODES, cfg.payload), as_int(cfg.max_tokens_per_rank, -1),
            factor_word(cfg.capacity_factor), as_int(cfg.resolved_ranks_per_node(), -1)]


def option_error(cfg) -> tuple[int, int, int]:
    """The options on their own: the reference's checks (``option_triple``, one body for both
    tiers), after the group's own, then what the transport's wire and kernels cannot carry
    (its row: hier's limits)."""
    if cfg._bad_group:
        return Reason.BAD_GROUP, 0, 0
    R, G = dist.get_world_size(cfg.group), cfg.resolved_ranks_per_node()
    code = option_triple(cfg.align, cfg.capacity, cfg.num_experts, R, cfg.transport, cfg.exchange,
                         cfg.payload, cfg.max_tokens_per_rank, G, cfg.capacity_factor)
    if code[0] != Reason.OK:
        return code
    return transports.TABLE[cfg.transport].option_error(int(cfg.num_experts) // R, G,
                                                        cfg.exchange, cfg.payload)


def local_error(cfg, x, topk_idx, topk_weights) -> tuple[int, int, int]:
    """Every check that needs no tensor values: options, types, devices, dtypes, shapes."""
    code = option_error(cfg)
    if code[0] != Reason.OK:
        return code
    for arg_id, t in ((1, x), (2, topk_idx), (3, topk_weights)):
        bad = tensor_error(arg_id, t)
        if bad:
            return bad
    for arg_id, t in ((2, topk_idx), (3, topk_weights)):
        if t.device != x.device:
            return Reason.DEVICE, arg_id, _DEVICE_CODES.get(t.device.type, 3)
    if x.dtype not in (torch.float32, torch.bfloat16):
        return Reason.X_DTYPE, dtype_code(x.dtype), 0
    if topk_idx.dtype not in _INT_DTYPES:
        return Reason.INDEX_DTYPE, dtype_code(topk_idx.dtype), 0
    if topk_weights.dtype != torch.float32:
        return Reason.WEIGHTS_DTYPE, dtype_code(topk_weights.dtype), 0
    if x.dim() != 2:
        return Reason.X_NOT_2D, x.dim(), 0
    if topk_idx.dim() != 2:
        return Reason.IDX_NOT_2D, topk_idx.dim(), 0
    if topk_idx.shape[0] != x.shape[0]:
        return Reason.IDX_SHAPE, topk_idx.shape[0], x.shape[0]
    if topk_weights.dim() != 2:
        return Reason.WEIGHTS_NOT_2D, topk_weights.dim(), 0
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        return Reason.WEIGHTS_SHAPE, topk_weights.shape[0], topk_weights.shape[1]
    return Reason.OK, 0, 0


def combine_words(cfg, expert_y, d, weighted) -> list[int]:
    code, ref, rows_dtype = (Reason.OK, 0, 0), -1, 0
    options = option_words(cfg)
    flags = WEIGHTED if bool(weighted) else 0
    if cfg._bad_group:
        code = Reason.BAD_GROUP, 0, 0
    elif isinstance(d, PendingDispatch):
        code = Reason.FOREIGN_DISPATCH, 4, 0
    elif not isinstance(d, Dispatch) or d.handle is None:
        code = Reason.FOREIGN_DISPATCH, 2, 0
    elif d.handle.group_name != group_name(cfg.group):
        code = Reason.FOREIGN_DISPATCH, 1, 0
    elif not torch.compiler.is_compiling() and d.handle.seal and d.handle.seal != seal_of(d.handle):
        code = Reason.FOREIGN_DISPATCH, 3, 0  # a private field replaced or written to
    else:
        options, ref = option_words(d.handle.config), d.handle.call_number
        w = d.row_weight
        if (not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.dim() != 1
                or w.shape[0] != d.handle.rows):
            code = Reason.FOREIGN_DISPATCH, 3, 0  # the kernels index row_weight by row
        else:
            code = (tensor_error(4, expert_y)
                    or _rows_error(expert_y, d.handle.rows, d.handle.hidden))
            if code[0] == Reason.OK and expert_y.device != w.device:
                code = Reason.DEVICE, 4, _DEVICE_CODES.get(expert_y.device.type, 3)
            rows_dtype = dtype_code(expert_y.dtype) if code[0] == Reason.OK else 0
    return header(COMBINE, options, code, rows_dtype, ref, flags=flags)


def _rows_error(arr: torch.Tensor, rows: int, hidden: int) -> tuple[int, int, int]:
    """expert_y against its dispatch: dtype, then rows, then H (reference/validate.py)."""
    if not isinstance(arr, torch.Tensor):
        return Reason.NOT_A_TENSOR, 4, 0
    if arr.dtype not in (torch.float32, torch.bfloat16):
        return Reason.EXPERT_Y_DTYPE, dtype_code(arr.dtype), 0
    n = arr.shape[0] if arr.dim() >= 1 else -1
    if n != rows:
        return Reason.EXPERT_Y_ROWS, n, rows
    h = arr.shape[1] if arr.dim() == 2 else -1
    if h != hidden:
        return Reason.EXPERT_Y_HIDDEN, h, hidden
    return Reason.OK, 0, 0
