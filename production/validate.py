"""The checks production makes before anything moves, in the reference's order
(reference/validate.py): the options, the arguments' types, devices, dtypes and shapes, and
combine's arguments against their dispatch. Each yields a reason triple ``(code, a, b)`` that
the call header agrees between ranks (production/agree.py), so every rank raises the same error.

Nothing here raises for a bad option: a rank that raised alone would leave its peers waiting in
their first collective. ``cfg`` is the :class:`epkit.Dispatcher` whose options are checked.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.distributed as dist

from . import transports
from .agree import COMBINE, WEIGHTED, header, tensor_error
from .collectives import EXCHANGES, dtype_code, group_name
from .lazy import PendingDispatch
from .result import Dispatch, seal_of
from epkit.reference import abi
from epkit.reference.errors import (MAX_ALIGN, MAX_CAPACITY, MAX_EXPERTS, MAX_TOKENS, Reason,
                                    factor_bits)

__all__ = ["option_words", "option_error", "local_error", "combine_words"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_DEVICE_CODES = {"cpu": 0, "cuda": 1, "meta": 2}
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _int_or(v, default):
    """``v`` as an int if it is one (int, NumPy integer; not a float or a string), clamped to
    int64 so that it fits the call header (the bounds checks then name it), else ``default``."""
    if v is None or isinstance(v, bool):
        return default
    try:
        return min(max(operator.index(v), _INT64[0]), _INT64[1])
    except TypeError:
        return default


def _factor_bits(f) -> int:
    """The capacity factor's header word: float64 bits, -1 for None or not a real number."""
    if f is None or isinstance(f, (bool, str)):
        return -1
    try:
        return factor_bits(float(f))
    except (TypeError, ValueError, OverflowError):
        return -1


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
    return [_int_or(cfg.num_experts, -1), _int_or(cfg.align, -1),
            _int_or(cfg.capacity, -1), _code(abi.TRANSPORT_CODES, cfg.transport),
            _code(abi.EXCHANGE_CODES, cfg.exchange), _code(abi.PAYLOAD_CODES, cfg.payload),
            _int_or(cfg.max_tokens_per_rank, -1), _factor_bits(cfg.capacity_factor),
            _int_or(cfg.resolved_ranks_per_node(), -1)]

def option_error(cfg) -> tuple[int, int, int]:
    """The options on their own (reference/validate.py's order)."""
    R = dist.get_world_size(cfg.group)
    E, align, capacity, transport, exchange, payload, max_tokens, factor, G = option_words(cfg)
    if cfg._bad_group:
        return Reason.BAD_GROUP, 0, 0
    if _int_or(cfg.align, None) is None or not 1 <= align <= MAX_ALIGN:
        return Reason.ALIGN, align, 0
    if cfg.capacity is not None and (_int_or(cfg.capacity, None) is None
                                      or not 0 <= capacity <= MAX_CAPACITY):
        return Reason.CAPACITY, capacity, 0
    if cfg.capacity_factor is not None:
        if cfg.capacity is not None:
            return Reason.CAPACITY_AND_FACTOR, 0, 0
        if factor == -1 or not math.isfinite(cfg.capacity_factor) or cfg.capacity_factor <= 0:
            return Reason.CAPACITY_FACTOR, factor, 0
    if _int_or(cfg.num_experts, None) is None or not 1 <= E <= MAX_EXPERTS:
        return Reason.NUM_EXPERTS, E, 0
    if E % R:
        return Reason.EXPERTS_NOT_DIVISIBLE, E, R
    for option_id, value in ((1, transport), (2, exchange), (3, payload)):
        if value < 0:
            return Reason.OPTION, option_id, -1
    if EXCHANGES[cfg.exchange].static and (cfg.max_tokens_per_rank is None
                                      or not 0 <= max_tokens <= MAX_TOKENS):
        return Reason.STATIC_MAX, max_tokens, 0
    if not 1 <= G <= R or R % G:
        return Reason.RANKS_PER_NODE, G, R
    return transports.TABLE[cfg.transport].option_error(E // R, G, cfg.exchange, cfg.payload)

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
    return transports.TABLE[cfg.transport].topk_error(topk_idx.shape[1])


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
