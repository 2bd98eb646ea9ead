"""The production API: ``epkit.dispatch``, ``epkit.combine`` and ``epkit.Dispatcher``.

One dispatch is: local checks and counts (``prepare``), one all-gather of count words that
yields the plan and, collectively, any input error (``count_exchange``), one host read of three
sizes from the plan (on CPU the plan already lives in host memory), and the token exchange
(``dispatch_tokens``). Combine and both backward passes reuse the dispatch's plan and maps: no
further count exchange, no host read of counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

import math
import operator
import os

from . import lazy, ops, payloads
from .payloads.fp8_block128 import dequantize_fp8_block128, quantize_fp8_block128
from .payloads.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from .agree import (COMBINE, DISPATCH, WEIGHTED, agree, call_number, guarded, header,
                         serial, tensor_error)
from .collectives import CODES as EXCHANGE_CODES
from .collectives import dtype_code, group_name, is_group, resolve_group
from .device import device_path
from epkit.reference import payloads as reference_payloads
from .workspace import Workspace
from epkit.reference import abi
from epkit.reference.abi import DEDUP_MAX_LOCAL, DEDUP_MAX_TOPK
from epkit.reference.errors import (MAX_ALIGN, MAX_CAPACITY, MAX_EXPERTS, MAX_TOKENS, InputError,
                                   Reason, error, factor_bits)

__all__ = ["Dispatch", "Dispatcher", "dispatch", "combine", "layout", "group_of_one", "quantize_mxfp8",
           "dequantize_mxfp8", "quantize_fp8_block128", "dequantize_fp8_block128"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


PAYLOAD_CODES = dict(abi.PAYLOAD_CODES)
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


@dataclass
class Dispatch:
    """The expert-major result of a dispatch on this rank (semantics: "Dispatch").

    Attributes:
        expert_x: ``[M, H]`` x's dtype. Segments of local experts ``0..L-1`` in order; rows of
            an expert ordered by source rank, then source token; each segment zero-padded to a
            multiple of ``align``.
        tokens_per_expert: ``[L]`` int64, rows per local expert before padding: the routed
            slots an expert received, *not* its segment's length when ``align > 1``. A grouped
            GEMM that is given lengths (torchtitan's ``cumsum`` of counts, Megatron's
            ``split``) needs ``padded_tokens_per_expert``: the unpadded counts would misplace
            every segment after the first padded one.
        expert_offsets: ``[L+1]`` int64, padded start of each segment; last entry ``M`` (the
            static exchange: the canonical rows, zero rows after it).
        padded_tokens_per_expert: ``[L]`` int64, each segment's length, padding included:
            ``expert_offsets.diff()``, ``tokens_per_expert`` rounded up to ``align``.
        row_src: ``[M, 3]`` int64, ``(source rank, token, k)`` per row; ``-1`` on padding.
        row_weight: ``[M]`` float32, the routing weight of each row; ``0`` on padding.
            Differentiable (its gradient flows to ``topk_weights``).
        dropped_per_expert: ``[L]`` int64, slots each local expert dropped under ``capacity``.
        bytes_sent: ``[R]`` int64, bytes this rank sent to each peer in the token exchange.
        expert_scale: ``[M, H // block]`` under a quantized payload, in its scale dtype
            (``"mxfp8"``: uint8 E8M0 codes, block 32; ``"fp8_block128"``: float32, block 128);
            else None. ``expert_x`` is then float8_e4m3fn.
        expert_x_hp: ``[M, H]`` float32 under a quantized payload: ``expert_x`` dequantized,
            differentiable (the gradient flows back unquantized, straight-through); else None.
    """

    expert_x: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    row_src: torch.Tensor
    row_weight: torch.Tensor
    dropped_per_expert: torch.Tensor
    bytes_sent: torch.Tensor
    expert_scale: Optional[torch.Tensor] = None
    expert_x_hp: Optional[torch.Tensor] = None
    padded_tokens_per_expert: Optional[torch.Tensor] = None
    # The handle combine and the backward passes reuse.
    _topk_idx: torch.Tensor = field(default=None, repr=False)
    _topk_weights: torch.Tensor = field(default=None, repr=False)
    _send_map: torch.Tensor = field(default=None, repr=False)
    _recv_map: torch.Tensor = field(default=None, repr=False)
    _plan: torch.Tensor = field(default=None, repr=False)
    _config: "Dispatcher" = field(default=None, repr=False)
    _x_dtype: torch.dtype = field(default=None, repr=False)
    # What combine checks the Dispatch against (a replaced field cannot make a kernel read
    # past the end): the dispatch's call number, its rows and hidden size, its group.
    _seq: int = field(default=-1, repr=False)
    _rows: int = field(default=0, repr=False)
    _hidden: int = field(default=0, repr=False)
    _group_name: str = field(default="", repr=False)
    _seal: tuple = field(default=(), repr=False)  # see _seal_of
    _hier: object = field(default=None, repr=False)  # transport="hier": epkit.hier.HierState

    @property
    def num_rows(self) -> int:
        """``M``, the expert-major row count (padding included)."""
        return self.expert_x.shape[0]


class Dispatcher:
    """Configuration for dispatch and combine over one process group.

    Args:
        group: the expert-parallel process group (default: the default group). Expert ``e``
            lives on rank ``e // L`` of this group, ``L = num_experts // group size``. ``None``
            means the whole default group, never "no expert parallelism": at expert-parallel
            size 1 pass a group of one (``epkit.group_of_one()``), whatever the world size.
        num_experts: ``E``, a multiple of the group size.
        align: pad every expert's segment to a multiple of this (``>= 1``).
        capacity: keep at most this many slots per expert, the first in (source rank, token)
            order; ``None`` keeps all.
        capacity_factor: instead of ``capacity``: a group-wide capacity of
            ``ceil(capacity_factor * S / E)`` slots per expert, ``S`` the group's used slots
            (``epkit.reference.capacity.capacity_from_factor``; the count exchange gives ``S``, so
            no extra collective), bit for bit the same as passing that ``capacity``.
        transport: ``"dedup"`` (one row per token and destination rank with a kept slot, the
            default), ``"pairs"`` (one row per slot) or ``"hier"`` (node-aware: a token row
            crosses to each destination node once, to the rank with its local index there,
            which forwards it inside the node; the combine returns over the same two stages;
            epkit/hier.py). Same result, bit for bit, for the same ``ranks_per_node``. hier
            runs the exchanges ``auto``, ``ragged``, ``padded`` and ``equal``, without a payload
            and not under torch.compile (an InputError, HIER_UNSUPPORTED, otherwise).
        exchange: ``"auto"`` (equal-length when the plan is uniform, else ragged), ``"ragged"``,
            ``"padded"``, ``"equal"``, ``"lazy"`` (the auto exchange issued asynchronously:
            dispatch and combine return pending objects whose ``wait()`` gives the result), or
            ``"static"`` (fixed worst-case chunks sized by ``max_tokens_per_rank``, counts
            in-band: no host reads a count; ``expert_x`` then has
            ``R * max_tokens_per_rank * min(K, L) + L * (align - 1)`` rows, the canonical rows
            first, zero rows after ``expert_offsets[-1]``).
        payload: ``None`` (tokens travel in x's dtype), ``"mxfp8"`` (E4M3 elements with one
            E8M0 scale per 32, ``H % 32 == 0``) or ``"fp8_block128"`` (E4M3 with one float32
            scale per 128, ``H % 128 == 0``; DeepEP's format); quantized at the source, the
            Dispatch then holds ``expert_x`` (E4M3), ``expert_scale`` and ``expert_x_hp``
            (dequantized float32, differentiable: the gradient returns unquantized); the
            combine is unchanged.
        max_tokens_per_rank: the static exchange's bound on any rank's ``T`` (required there).
        ranks_per_node: ``G``, ranks ``nG .. nG + G - 1`` of the group are node ``n``. It fixes
            the combine's (and the dispatch backward's) summation order, for every transport:
            a node partial per node over its ranks ascending, then the nodes ascending
            (docs/semantics.md; 1: rank by rank), and hier's nodes. ``None`` (the default): the
            launcher's local world size (``LOCAL_WORLD_SIZE``, as torchrun sets it) when it is
            set and divides the group size, else 1. Agreed between ranks like every option (a
            mismatch is an InputError on every rank).
        workspace: keep the buffers that never leave an op (every exchange's send and
            receive staging: dispatch, combine, both backward passes) from call to call
            (epkit/workspace.py; DeepEP's ``Buffer``): allocated on first use, grown when a
            call needs more, reported by :attr:`workspace_bytes`, freed by :meth:`release`.
            Outputs and saved tensors never live there. ``False``: every buffer fresh (the
            functional ``epkit.dispatch``, whose Dispatcher lasts one step).
    """

    def __init__(self, group=None, num_experts: int = 0, *, align: int = 1,
                 capacity: Optional[int] = None, transport: str = "dedup",
                 exchange: str = "auto", payload: Optional[str] = None,
                 max_tokens_per_rank: Optional[int] = None,
                 capacity_factor: Optional[float] = None,
                 ranks_per_node: Optional[int] = None, workspace: bool = True):
        # Nothing here raises for a bad option: a rank that raised alone would leave its peers
        # waiting in their first collective. Options are checked, and agreed between ranks,
        # in the call header of every dispatch (epkit/agree.py).
        # No process group at all: a clear RuntimeError. Something that is not a group: the
        # default group, over which the call header reports BAD_GROUP on every rank.
        self._bad_group = not is_group(group)
        self.group = resolve_group(group)
        self.num_experts = num_experts
        self.align = align
        self.capacity = capacity
        self.capacity_factor = capacity_factor
        self.transport = transport
        self.exchange = exchange
        self.payload = payload
        self.max_tokens_per_rank = max_tokens_per_rank
        self.ranks_per_node = ranks_per_node
        self._workspace = Workspace() if workspace else None

    @property
    def workspace_bytes(self) -> int:
        """Bytes of this Dispatcher's workspace now held (0 after :meth:`release`)."""
        return self._workspace.nbytes if self._workspace is not None else 0

    def release(self) -> None:
        """Free the workspace's buffers, and the large CPU blocks epkit keeps for reuse after
        their tensors died (process-wide, csrc/cpu/alloc.cpp); the next call allocates them
        again. Safe at any time between calls: no output, saved tensor or pending lazy call
        uses them."""
        if self._workspace is not None:
            self._workspace.release()
        ops.C.release_cache()

    @property
    def _ws(self) -> int:
        """The workspace's key for the ops (-1: none)."""
        return self._workspace.key if self._workspace is not None else -1

    def resolved_ranks_per_node(self):
        """``ranks_per_node`` as given, or (None) the default of the class docstring."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        try:
            g = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
        except ValueError:
            return 1
        return g if g >= 1 and dist.get_world_size(self.group) % g == 0 else 1

    # -- validation -------------------------------------------------------------------------------

    def _option_words(self) -> list[int]:
        """``[E, align, capacity, transport, exchange, payload, max_tokens, capacity factor,
        ranks_per_node]`` as header codes (agree.py): integers as given (-1 for None or a
        non-integer), names as their codes, the factor as its float64 bits, ranks_per_node
        resolved (:meth:`resolved_ranks_per_node`)."""
        return [_int_or(self.num_experts, -1), _int_or(self.align, -1),
                _int_or(self.capacity, -1), _code(ops.TRANSPORTS, self.transport),
                _code(EXCHANGE_CODES, self.exchange), _code(PAYLOAD_CODES, self.payload),
                _int_or(self.max_tokens_per_rank, -1), _factor_bits(self.capacity_factor),
                _int_or(self.resolved_ranks_per_node(), -1)]

    def _option_error(self) -> tuple[int, int, int]:
        """The options on their own (reference/validate.py's order)."""
        R = dist.get_world_size(self.group)
        E, align, cap, transport, exchange, payload, max_tokens, factor, G = self._option_words()
        if self._bad_group:
            return Reason.BAD_GROUP, 0, 0
        if _int_or(self.align, None) is None or not 1 <= align <= MAX_ALIGN:
            return Reason.ALIGN, align, 0
        if self.capacity is not None and (_int_or(self.capacity, None) is None
                                          or not 0 <= cap <= MAX_CAPACITY):
            return Reason.CAPACITY, cap, 0
        if self.capacity_factor is not None:
            if self.capacity is not None:
                return Reason.CAPACITY_AND_FACTOR, 0, 0
            if factor == -1 or not math.isfinite(self.capacity_factor) or self.capacity_factor <= 0:
                return Reason.CAPACITY_FACTOR, factor, 0
        if _int_or(self.num_experts, None) is None or not 1 <= E <= MAX_EXPERTS:
            return Reason.NUM_EXPERTS, E, 0
        if E % R:
            return Reason.EXPERTS_NOT_DIVISIBLE, E, R
        for option_id, value in ((1, transport), (2, exchange), (3, payload)):
            if value < 0:
                return Reason.OPTION, option_id, -1
        if self.exchange == "static" and (self.max_tokens_per_rank is None
                                          or not 0 <= max_tokens <= MAX_TOKENS):
            return Reason.STATIC_MAX, max_tokens, 0
        if not 1 <= G <= R or R % G:
            return Reason.RANKS_PER_NODE, G, R
        if self.transport in ("dedup", "hier") and E // R >= DEDUP_MAX_LOCAL:  # j: 24 bits
            return Reason.TOO_MANY_LOCAL_EXPERTS, E // R, DEDUP_MAX_LOCAL - 1
        if self.transport == "hier":
            if E // R * G >= DEDUP_MAX_LOCAL:  # stage 1's j: the expert's id on its node
                return Reason.TOO_MANY_LOCAL_EXPERTS, E // R * G, DEDUP_MAX_LOCAL - 1
            what = {"lazy": 1, "static": 2}.get(self.exchange, 3 if self.payload else 0)
            if what:
                return Reason.HIER_UNSUPPORTED, what, 0
        return Reason.OK, 0, 0

    def _local_error(self, x, topk_idx, topk_weights) -> tuple[int, int, int]:
        """Every check that needs no tensor values: options, types, devices, dtypes, shapes."""
        code = self._option_error()
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
        if self.transport in ("dedup", "hier") and topk_idx.shape[1] > DEDUP_MAX_TOPK:  # k: 8 bits
            return Reason.TOPK_TOO_LARGE, topk_idx.shape[1], DEDUP_MAX_TOPK
        return Reason.OK, 0, 0

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatch:
        """Send every token to the ranks of its top-k experts; see :func:`epkit.dispatch`."""
        topk_weights = _widened(topk_weights)
        if torch.compiler.is_compiling():
            if self.transport == "hier":  # every rank traces the same program: all refuse
                raise error(0, Reason.HIER_UNSUPPORTED, 4)
            # Traced: options are constants of the graph; local errors ride in the count words.
            return self._dispatch(x, topk_idx, topk_weights, self._local_error(x, topk_idx, topk_weights))
        with serial(self.group):
            code, cause = guarded(self._local_error, x, topk_idx, topk_weights)
            shape = self._static_shape(x, topk_idx)
            if shape != (0, 0, 0) and code[0] == Reason.OK:
                # A payload's H % block rides the count words elsewhere; a static dispatch on the
                # device path checks its shape in the header, so this rank's own H % block error
                # goes there too, first, as the count exchange would report it.
                table = reference_payloads.TABLE
                code = table.get(self.payload, table[None]).hidden_triple(shape[0])
            # The call header: every rank raises the same error here, before anything else.
            agree(self.group, header(DISPATCH, self._option_words(), code, shape=shape),
                  "epkit.dispatch (call header)", cause)
            return self._dispatch(x, topk_idx, topk_weights, code)

    def _static_shape(self, x, topk_idx) -> tuple[int, int, int]:
        """``(H, x dtype code, K)`` for the call header of a static dispatch on the device path
        (epkit/agree.py: its exchange is sized from them without a host read), else zeros; -1
        for what an invalid argument does not have (its local error is reported first)."""
        if self.exchange != "static" or not device_path(x):
            return (0, 0, 0)
        def dim(t, i):
            return int(t.shape[i]) if isinstance(t, torch.Tensor) and t.dim() == 2 else -1
        return (dim(x, 1), dtype_code(getattr(x, "dtype", None)), dim(topk_idx, 1))

    def _dispatch(self, x, topk_idx, topk_weights, local) -> Dispatch:
        R = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        transport = ops.TRANSPORTS[self.transport]
        E, align = int(self.num_experts), int(self.align)
        cap = -1 if self.capacity is None else int(self.capacity)
        factor = -1.0 if self.capacity_factor is None else float(self.capacity_factor)
        # The number this call's header carried (traced: -1, no header at trace time; the
        # combine op agrees at run time, comparing the ranks' constants).
        seq = -1 if torch.compiler.is_compiling() else call_number(self.group) - 1
        code, a, b = local
        if code == Reason.OK:
            x, topk_idx, topk_weights = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
        G = int(self.resolved_ranks_per_node()) if code == Reason.OK else 1
        if self.transport == "hier":
            from . import hier
            return hier.dispatch(self, seq, x, topk_idx, topk_weights, local, G)
        static = self.exchange == "static"  # every rank takes the same path, bad input or not
        pl = payloads.of(self.payload)  # the None entry for a bad name (its error travels)
        pre_error = [int(code), int(a), int(b), dtype_code(getattr(x, "dtype", None))]
        if (not static and not pl.quantized and self.exchange != "lazy"
                and not torch.compiler.is_compiling()):
            # The eager path: one fused op, no host read here at all.
            *outs, plan = ops.prepare_dispatch(
                x, topk_idx, topk_weights, group_name(self.group), rank, E, align, cap, transport,
                EXCHANGE_CODES[self.exchange], pre_error, 0, factor, G, self._ws)
            return self._result(seq, x, topk_idx, topk_weights, plan, *outs)
        max_tokens = int(self.max_tokens_per_rank) if static else -1
        words = ops.C.prepare(x, topk_idx, topk_weights, E, R,
                              pre_error + [max_tokens], pl.code)
        # CUDA static: the shape that sizes the plan's host mirror without a host wait.
        shape = ([x.shape[1], topk_idx.shape[1], dtype_code(x.dtype), pl.code]
                 if static and device_path(x) else None)
        plan = ops.count_exchange(words, group_name(self.group), rank, E, align, cap, transport,
                                  EXCHANGE_CODES[self.exchange], max_tokens, shape, factor,
                                  topk_idx if code == Reason.OK else None, G)
        if self.exchange == "equal" and not int(ops.host_plan(plan)[ops.UNIFORM]):
            raise error(int(ops.host_plan(plan)[ops.NONUNIFORM_RANK]), Reason.EQUAL_NONUNIFORM)
        if static:
            # Sizes from the configuration alone: no host read of any count (and, under
            # torch.compile, no data-dependent shape). docs/design.md, wire format.
            L, K, H = E // R, topk_idx.shape[1], x.shape[1]
            P = pl.row_bytes(H, x.element_size())
            per = min(K, L)
            # data rows per chunk (a dedup token row needs a kept slot: 0 when K = 0)
            rows = max_tokens * per if transport == ops.PAIRS else min(max_tokens, max_tokens * per)
            chunk = ops.dispatch_chunk_bytes(transport, P, 1 + rows, 1 + max_tokens * per)
            SB, N = R * chunk, R * (1 + rows)
            M = R * max_tokens * per + L * (align - 1)
        else:
            # The one host read of a dispatch (on CPU the plan is host memory already).
            hp = ops.host_plan(plan)  # (single words: views of the mirror, host memory)
            SB, N, M = (int(hp[f]) for f in (ops.SEND_BYTES, ops.RECV_ROWS, ops.EXPERT_ROWS))
        build = functools.partial(self._result, seq, x, topk_idx, topk_weights, plan)
        if self.exchange == "lazy":
            return lazy.issue_dispatch(x, topk_idx, topk_weights, plan, group_name(self.group),
                                       transport, M, build, pl)
        if pl.quantized:
            hp, row_weight, q, scale, row_src, send_map, recv_map = payloads.dispatch_quantized(
                pl, x, topk_idx, topk_weights, plan, group_name(self.group), transport,
                EXCHANGE_CODES[self.exchange], (SB, N, M))
            return build(q, row_src, row_weight, send_map, recv_map, scale, hp)
        return build(*ops.dispatch_tokens(
            x, topk_idx, topk_weights, plan, group_name(self.group), transport,
            EXCHANGE_CODES[self.exchange], SB, N, M, self._ws))

    def _result(self, seq, x, topk_idx, topk_weights, plan, expert_x, row_src, row_weight,
                send_map, recv_map, expert_scale=None, expert_x_hp=None, hier=None,
                bytes_sent=None) -> Dispatch:
        sl = ops.plan_slices(dist.get_world_size(self.group), int(self.num_experts))
        d = Dispatch(
            expert_x=expert_x,
            tokens_per_expert=plan[sl["tokens_per_expert"]].clone(),
            expert_offsets=plan[sl["offsets"]].clone(),
            row_src=row_src,
            row_weight=row_weight,
            dropped_per_expert=plan[sl["dropped"]].clone(),
            bytes_sent=plan[sl["send_bytes"]].clone() if bytes_sent is None else bytes_sent,
            expert_scale=expert_scale,
            expert_x_hp=expert_x_hp,
            padded_tokens_per_expert=plan[sl["offsets"]].diff(),
            _topk_idx=topk_idx, _topk_weights=topk_weights.detach(), _send_map=send_map,
            _recv_map=recv_map, _plan=plan, _config=self, _x_dtype=x.dtype, _seq=seq,
            _rows=expert_x.shape[0], _hidden=expert_x.shape[1],
            _group_name=group_name(self.group), _hier=hier,
        )
        if not torch.compiler.is_compiling():
            d._seal = _seal_of(d)
        return d

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, expert_y: torch.Tensor, d: Dispatch, weighted: bool = True) -> torch.Tensor:
        """Bring expert outputs back and sum them per token; see :func:`epkit.combine`.

        Collective: a bad ``expert_y`` or ``Dispatch`` on any rank, or ranks combining
        different dispatches, raise the same InputError on every rank before any row moves.
        """
        if torch.compiler.is_compiling():  # the header is agreed inside the op, at run time
            return self._combine(expert_y, d, weighted,
                                 self._combine_header(expert_y, d, weighted))
        with serial(self.group):
            words, cause = self._combine_header(expert_y, d, weighted, with_cause=True)
            agree(self.group, words, "epkit.combine (call header)", cause)
            return self._combine(expert_y, d, weighted, [])

    def _combine_header(self, expert_y, d, weighted, with_cause=False):
        """This rank's combine header; with ``with_cause``, also the exception a bad argument
        raised while it was read (then reported as BAD_ARGUMENT)."""
        words, cause = guarded(self._combine_words, expert_y, d, weighted)
        if cause is not None:
            words = header(COMBINE, self._option_words(), (Reason.BAD_ARGUMENT, 0, 0))
        return (words, cause) if with_cause else words

    def _combine_words(self, expert_y, d, weighted) -> list[int]:
        code, ref, rows_dtype = (Reason.OK, 0, 0), -1, 0
        options = self._option_words()
        flags = WEIGHTED if bool(weighted) else 0
        if self._bad_group:
            code = Reason.BAD_GROUP, 0, 0
        elif isinstance(d, lazy.PendingDispatch):
            code = Reason.FOREIGN_DISPATCH, 4, 0
        elif not isinstance(d, Dispatch) or d._config is None:
            code = Reason.FOREIGN_DISPATCH, 2, 0
        elif d._group_name != group_name(self.group):
            code = Reason.FOREIGN_DISPATCH, 1, 0
        elif not torch.compiler.is_compiling() and d._seal and d._seal != _seal_of(d):
            code = Reason.FOREIGN_DISPATCH, 3, 0  # a private field replaced or written to
        else:
            options, ref = d._config._option_words(), d._seq
            w = d.row_weight
            if (not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.dim() != 1
                    or w.shape[0] != d._rows):
                code = Reason.FOREIGN_DISPATCH, 3, 0  # the kernels index row_weight by row
            else:
                code = tensor_error(4, expert_y) or _rows_error(expert_y, d._rows, d._hidden)
                if code[0] == Reason.OK and expert_y.device != w.device:
                    code = Reason.DEVICE, 4, _DEVICE_CODES.get(expert_y.device.type, 3)
                rows_dtype = dtype_code(expert_y.dtype) if code[0] == Reason.OK else 0
        return header(COMBINE, options, code, rows_dtype, ref, flags=flags)

    def _combine(self, expert_y, d, weighted, check) -> torch.Tensor:
        cfg = d._config  # the dispatch's transport and exchange, whichever Dispatcher combines
        if cfg.transport == "hier":
            from . import hier
            return hier.combine(expert_y, d, bool(weighted))
        transport = ops.TRANSPORTS[cfg.transport]
        if cfg.exchange == "lazy":
            return lazy.issue_combine(expert_y, d, group_name(self.group), transport,
                                      bool(weighted))
        return ops.combine_tokens(
            expert_y, d.row_weight, d._topk_idx, d._topk_weights, d._send_map, d._recv_map,
            d._plan, group_name(self.group), transport, EXCHANGE_CODES[cfg.exchange],
            bool(weighted), d._x_dtype, check, cfg._ws)


def _widened(w):
    """bfloat16 / float16 routing weights as float32 (exact: every value of either is a float32;
    docs/semantics.md), differentiable, so the gradient returns in the weights' own dtype.
    Anything else as given (the checks name a bad dtype)."""
    if isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float16):
        return w.to(torch.float32)
    return w


def _seal_of(d: Dispatch) -> tuple:
    """What combine and the backward passes read from a Dispatch besides row_weight: the plan,
    the maps, the routing and x's dtype. Each tensor by identity and version counter, so a
    field replaced, or written in place, after dispatch no longer matches (FOREIGN_DISPATCH),
    instead of sending one rank's kernels out of bounds or out of step."""
    ts = (d._plan, d._recv_map, d._send_map, d._topk_idx, d._topk_weights)
    return tuple((id(t), getattr(t, "_version", None)) for t in ts) + (d._x_dtype, d._config)


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


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             group=None, align: int = 1, capacity: Optional[int] = None, transport: str = "dedup",
             exchange: str = "auto", payload: Optional[str] = None,
             max_tokens_per_rank: Optional[int] = None,
             capacity_factor: Optional[float] = None,
             ranks_per_node: Optional[int] = None) -> Dispatch:
    """Dispatch this rank's tokens to the ranks hosting their top-k experts.

    Collective over ``group``: every rank calls it, with its own tokens.

    Args:
        x: ``[T, H]`` float32 or bfloat16, this rank's tokens (``T`` may differ between ranks,
            ``H`` may not; ``T == 0`` is fine).
        topk_idx: ``[T, K]`` int64, int32, int16, int8 or uint8 (the same bits whatever the
            width), expert ids in ``[0, E)`` or ``-1`` for an unused slot; no expert twice in a
            row.
        topk_weights: ``[T, K]`` float32, bfloat16 or float16, finite routing weights
            (differentiable); bfloat16 and float16 are widened to float32 first (exactly), so
            ``row_weight`` is float32 and the gradient returns in the weights' dtype.
        num_experts: ``E``; see :class:`Dispatcher` for the other options (``capacity`` or
            ``capacity_factor``, ``align``, ``transport``, ``exchange``, ``payload``,
            ``max_tokens_per_rank``, ``ranks_per_node``).

    Returns:
        A :class:`Dispatch` in the canonical expert-major layout, bit for bit equal to
        ``epkit.reference.dispatch``. Raises :class:`epkit.InputError` on every rank if any
        rank's input is bad, before any token moves.
    """
    return Dispatcher(group, num_experts, align=align, capacity=capacity, transport=transport,
                      exchange=exchange, payload=payload,
                      max_tokens_per_rank=max_tokens_per_rank,
                      capacity_factor=capacity_factor, ranks_per_node=ranks_per_node,
                      workspace=False).dispatch(x, topk_idx, topk_weights)


def combine(expert_y: torch.Tensor, dispatch: Dispatch, weighted: bool = True) -> torch.Tensor:
    """Return expert outputs to their tokens and sum them.

    Args:
        expert_y: ``[M, H]`` float32 or bfloat16 in the dispatch's expert-major layout
            (padding rows are ignored, whatever they hold).
        dispatch: the :class:`Dispatch` these rows came from.
        weighted: multiply each row by its routing weight (``row_weight``) before summing.

    Returns:
        ``[T, H]`` in x's dtype: ``out[t] = sum_d sum_k c_k * y(t, k)`` in the fixed order of
        docs/semantics.md, bit for bit equal to ``epkit.reference.combine``.
    """
    config = getattr(dispatch, "_config", None)
    if not isinstance(config, Dispatcher):  # not a Dispatch: refused over the default group
        config = Dispatcher(workspace=False)
    return config.combine(expert_y, dispatch, weighted)


_GROUPS_OF_ONE: dict = {}


def group_of_one():
    """This rank's group of one, the expert-parallel group at expert-parallel size 1 (every
    expert local, no exchange with anyone). Made on first use by ``dist.new_subgroups(1)``,
    which is collective over the default group: every rank calls it the first time, together
    (model set-up, say), and later calls return the same group."""
    if not dist.is_initialized():
        raise RuntimeError("epkit.group_of_one: torch.distributed is not initialized; epkit runs "
                           "over a process group even at expert-parallel size 1 (a one-process "
                           "job: dist.init_process_group('gloo', world_size=1, rank=0, ...))")
    key = id(dist.group.WORLD)
    if key not in _GROUPS_OF_ONE:
        _GROUPS_OF_ONE[key] = dist.new_subgroups(1)[0]
    return _GROUPS_OF_ONE[key]


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Local routing layout: ``(tokens_per_expert [E], tokens_per_rank [R], slots_per_rank [R],
    is_token_in_rank [T, R] bool)``, counting used slots (before any capacity)."""
    return ops.C.layout(topk_idx.contiguous(), num_experts, num_ranks)
