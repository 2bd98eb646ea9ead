"""The production API: ``epkit.dispatch``, ``epkit.combine`` and ``epkit.Dispatcher``.

One dispatch is: local checks and counts (``prepare``), one all-gather of count words that
yields the plan and, collectively, any input error (``count_exchange``), one host read of three
sizes from the plan (on CPU the plan already lives in host memory), and the token exchange
(``dispatch_tokens``). Combine and both backward passes reuse the dispatch's plan and maps: no
further count exchange, no host read of counts.

The Dispatcher holds the configuration and chooses the path: the transport's module from the
transport table (production/transports/: ``direct.py`` for pairs and dedup, ``hier.py``), which
asks the exchange's and the payload's rows in turn. The checks are in validate.py, the result
and its handle in result.py.
"""

from __future__ import annotations

import importlib
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from . import direct, ops, payloads, transports
from .payloads.fp8_block128 import dequantize_fp8_block128, quantize_fp8_block128
from .payloads.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from .agree import COMBINE, DISPATCH, agree, call_number, guarded, header, serial
from .collectives import destroyed, dtype_code, exchange_of, group_ref, is_group, resolve_group
from .memory import device_path
from .options import DispatchOptions
from .result import Dispatch
from .validate import combine_words, local_error, option_words
from .workspace import Workspace
from epkit.reference.errors import UNSUPPORTED_CODES, Reason, error

# The modules that carry out the transports (the transport table's ``module``), by name.
_MODULES = {"direct": direct}

__all__ = ["Dispatch", "Dispatcher", "DispatchOptions", "dispatch", "combine", "layout",
           "group_of_one", "quantize_mxfp8", "dequantize_mxfp8", "quantize_fp8_block128",
           "dequantize_fp8_block128"]


class Dispatcher:
    """Configuration for dispatch and combine over one process group.

    Args:
        group: the expert-parallel process group (``None``: the default group). Expert ``e``
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
            production/hier.py). Same result, bit for bit, for the same ``ranks_per_node``. hier
            runs the exchanges ``auto``, ``ragged``, ``padded`` and ``equal``, without a payload
            and not under torch.compile (an InputError, UNSUPPORTED, otherwise). ``None``:
            the default.
        exchange: ``None`` or ``"auto"`` (equal-length when the plan is uniform, else ragged), ``"ragged"``,
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
            (production/workspace.py; DeepEP's ``Buffer``): allocated on first use, grown when a
            call needs more, reported by :attr:`workspace_bytes`, freed by :meth:`release`.
            Outputs and saved tensors never live there. ``False``: every buffer fresh (the
            functional ``epkit.dispatch``, whose Dispatcher lasts one step).
    """

    def __init__(self, group, num_experts: int, *, align: int = 1,
                 capacity: Optional[int] = None, transport: str = "dedup",
                 exchange: str = "auto", payload: Optional[str] = None,
                 max_tokens_per_rank: Optional[int] = None,
                 capacity_factor: Optional[float] = None,
                 ranks_per_node: Optional[int] = None, workspace: bool = True):
        # Nothing here raises for a bad option: a rank that raised alone would leave its peers
        # waiting in their first collective. Options are checked, and agreed between ranks,
        # in the call header of every dispatch (production/agree.py).
        # No process group at all: a clear RuntimeError. Something that is not a group: the
        # default group, over which the call header reports BAD_GROUP on every rank.
        self._bad_group = not is_group(group)
        self._group = group_ref(resolve_group(group))  # weak: see the group property
        self.num_experts = num_experts
        # Resolved once (None: the defaults, as in the reference) and carried as one record.
        self.options = DispatchOptions(
            transport=transport, exchange=exchange, payload=payload, align=align,
            capacity=capacity, capacity_factor=capacity_factor,
            max_tokens_per_rank=max_tokens_per_rank, ranks_per_node=ranks_per_node)
        self._workspace = Workspace() if workspace else None

    @classmethod
    def from_options(cls, group, num_experts: int, options: DispatchOptions, *,
                     workspace: bool = True) -> "Dispatcher":
        """A Dispatcher with ``options`` (an :class:`epkit.DispatchOptions`)."""
        return cls(group, num_experts, **options.as_dict(), workspace=workspace)

    # The options, read-only (Dispatcher.options is the record).
    transport = property(lambda self: self.options.transport)
    exchange = property(lambda self: self.options.exchange)
    payload = property(lambda self: self.options.payload)
    align = property(lambda self: self.options.align)
    capacity = property(lambda self: self.options.capacity)
    capacity_factor = property(lambda self: self.options.capacity_factor)
    max_tokens_per_rank = property(lambda self: self.options.max_tokens_per_rank)
    ranks_per_node = property(lambda self: self.options.ranks_per_node)

    @property
    def group(self):
        """The process group. Held weakly (collectives.group_ref): a Dispatcher, and the
        Dispatch results that refer to it, never keep a group alive past
        ``destroy_process_group()``; using it after that is a RuntimeError."""
        group = self._group()
        if group is None:
            raise destroyed("this Dispatcher")
        return group

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

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> Dispatch:
        """Send every token to the ranks of its top-k experts; see :func:`epkit.dispatch`."""
        topk_weights = _widened(topk_weights)
        if torch.compiler.is_compiling():
            transport = transports.of(self.transport)
            if transport is not None and not transport.compiles:  # every rank traces alike
                raise error(0, Reason.UNSUPPORTED, UNSUPPORTED_CODES["torch.compile"],
                            transport.code)
            # Traced: options are constants of the graph; local errors ride in the count words.
            return self._dispatch(x, topk_idx, topk_weights,
                                  local_error(self, x, topk_idx, topk_weights))
        with serial(self.group):
            code, cause = guarded(local_error, self, x, topk_idx, topk_weights)
            shape = self._static_shape(x, topk_idx)
            if shape != (0, 0, 0) and code[0] == Reason.OK:
                # A payload's H % block rides the count words elsewhere; a static dispatch on the
                # device path checks its shape in the header, so this rank's own H % block error
                # goes there too, first, as the count exchange would report it.
                code = payloads.of(self.payload).hidden_triple(shape[0])
            # The call header: every rank raises the same error here, before anything else.
            agree(self.group, header(DISPATCH, option_words(self), code, shape=shape),
                  "epkit.dispatch (call header)", cause)
            return self._dispatch(x, topk_idx, topk_weights, code)

    def _static_shape(self, x, topk_idx) -> tuple[int, int, int]:
        """``(H, x dtype code, K)`` for the call header of a static dispatch on the device path
        (production/agree.py: its exchange is sized from them without a host read), else zeros; -1
        for what an invalid argument does not have (its local error is reported first)."""
        ex = exchange_of(self.exchange)  # (a bad name: its error is reported first)
        if ex is None or not ex.static or not device_path(x):
            return (0, 0, 0)
        def dim(t, i):
            return int(t.shape[i]) if isinstance(t, torch.Tensor) and t.dim() == 2 else -1
        return (dim(x, 1), dtype_code(getattr(x, "dtype", None)), dim(topk_idx, 1))

    def _dispatch(self, x, topk_idx, topk_weights, local) -> Dispatch:
        # The number this call's header carried (traced: -1, no header at trace time; the
        # combine op agrees at run time, comparing the ranks' constants).
        seq = -1 if torch.compiler.is_compiling() else call_number(self.group) - 1
        if local[0] == Reason.OK:
            x, topk_idx = x.contiguous(), topk_idx.contiguous()
            topk_weights = topk_weights.contiguous()
        G = int(self.resolved_ranks_per_node()) if local[0] == Reason.OK else 1
        return self._module().dispatch(self, seq, x, topk_idx, topk_weights, local, G)

    def _module(self):
        """The module that carries out this Dispatcher's transport (the transport table's
        ``module``: direct.py or hier.py), behind ``dispatch(cfg, seq, x, topk_idx,
        topk_weights, local, G)`` and ``combine(cfg, expert_y, d, weighted, check)``. Imported
        on first use: hier's plan is the reference's (NumPy), which the other transports never
        load."""
        name = transports.TABLE[self.transport].module
        if name not in _MODULES:  # (never under torch.compile: hier refuses to be traced)
            _MODULES[name] = importlib.import_module(f"{__package__}.{name}")
        return _MODULES[name]

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
        words, cause = guarded(combine_words, self, expert_y, d, weighted)
        if cause is not None:
            words = header(COMBINE, option_words(self), (Reason.BAD_ARGUMENT, 0, 0))
        return (words, cause) if with_cause else words

    def _combine(self, expert_y, d, weighted, check) -> torch.Tensor:
        # the dispatch's transport, whichever Dispatcher combines
        module = d.handle.config._module()
        return module.combine(self, expert_y, d, bool(weighted), check)


def _widened(w):
    """bfloat16 / float16 routing weights as float32 (exact: every value of either is a float32;
    docs/semantics.md), differentiable, so the gradient returns in the weights' own dtype.
    Anything else as given (the checks name a bad dtype)."""
    if isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float16):
        return w.to(torch.float32)
    return w


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
    options = DispatchOptions(transport=transport, exchange=exchange, payload=payload, align=align,
                              capacity=capacity, capacity_factor=capacity_factor,
                              max_tokens_per_rank=max_tokens_per_rank,
                              ranks_per_node=ranks_per_node)
    return Dispatcher.from_options(group, num_experts, options, workspace=False).dispatch(
        x, topk_idx, topk_weights)


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
    handle = getattr(dispatch, "handle", None)
    config = getattr(handle, "config", None)
    if not isinstance(config, Dispatcher):  # not a Dispatch: refused over the default group
        config = Dispatcher(None, 0, workspace=False)
    return config.combine(expert_y, dispatch, weighted)


# Held weakly (as every group epkit keeps: collectives.group_ref): after destroy_process_group()
# the groups of one go with the rest.
_GROUPS_OF_ONE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


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
