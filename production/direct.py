"""The one-stage transports (pairs, dedup): every rank exchanges its rows with every other rank
directly, in one all-to-all per direction (DeepEP's intranode path; the node-aware transport is
hier.py). The Dispatcher reaches this module through the transport table (production/transports/):

    dispatch(cfg, seq, x, topk_idx, topk_weights, local, G) -> Dispatch
    combine(cfg, expert_y, d, weighted, check) -> [T, H] x's dtype

Which path a dispatch takes is asked of the exchange's and the payload's table rows: the eager
fused op (no host read here at all), the static exchange (sizes from the configuration), the
lazy one (issued now, finished by ``wait()``), a quantized payload.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import lazy, ops, payloads, result
from . import plan as W
from .collectives import EXCHANGES, dtype_code, group_name
from .memory import device_path
from .transports import TABLE as TRANSPORTS
from epkit.reference.errors import Reason, error

__all__ = ["dispatch", "combine"]


def dispatch(cfg, seq: int, x, topk_idx, topk_weights, local, G: int):
    """Dispatch over ``cfg`` (a Dispatcher) whose call header agreed already; ``local`` is this
    rank's error triple (it travels in the count words), ``G`` the ranks per node."""
    R = dist.get_world_size(cfg.group)
    rank = dist.get_rank(cfg.group)
    transport = TRANSPORTS[cfg.transport]
    ex = EXCHANGES[cfg.exchange]
    E, align = int(cfg.num_experts), int(cfg.align)
    capacity = -1 if cfg.capacity is None else int(cfg.capacity)
    factor = -1.0 if cfg.capacity_factor is None else float(cfg.capacity_factor)
    code, a, b = local
    gname = group_name(cfg.group)
    pl = payloads.of(cfg.payload)  # the None entry for a bad name (its error travels)
    pre_error = [int(code), int(a), int(b), dtype_code(getattr(x, "dtype", None))]
    if (not ex.static and not pl.quantized and not ex.deferred
            and not torch.compiler.is_compiling()):
        # The eager path: one fused op, no host read here at all.
        *outs, plan, plan_host = ops.prepare_dispatch(
            x, topk_idx, topk_weights, gname, rank, E, align, capacity, transport.path, ex.code,
            pre_error, 0, factor, G, cfg._ws)
        return result.build(cfg, seq, x, topk_idx, topk_weights, plan, plan_host, *outs)
    max_tokens = int(cfg.max_tokens_per_rank) if ex.static else -1
    words = ops.C.prepare(x, topk_idx, topk_weights, E, R, pre_error + [max_tokens], pl.code)
    # Static on the device path: the shape that sizes the plan's host mirror without a host wait.
    shape = ([x.shape[1], topk_idx.shape[1], dtype_code(x.dtype), pl.code]
             if ex.static and device_path(x) else None)
    plan, plan_host = ops.count_exchange(
        words, gname, rank, E, align, capacity, transport.path, ex.code, max_tokens, shape, factor,
        topk_idx if code == Reason.OK else None, G)
    if ex.uniform and not int(plan_host[W.UNIFORM]):
        raise error(int(plan_host[W.NONUNIFORM_RANK]), Reason.EQUAL_NONUNIFORM)
    SB, N, M = (_static_sizes(transport, pl, R, E, align, max_tokens, x, topk_idx) if ex.static
                else _planned_sizes(plan_host))
    build = functools.partial(result.build, cfg, seq, x, topk_idx, topk_weights, plan, plan_host)
    if ex.deferred:
        return lazy.issue_dispatch(x, topk_idx, topk_weights, plan, plan_host, gname,
                                   transport.path, M, build, pl)
    if pl.quantized:
        hp, row_weight, q, scale, row_src, send_map, recv_map = payloads.dispatch_quantized(
            pl, x, topk_idx, topk_weights, plan, plan_host, gname, transport.path, (SB, N, M))
        return build(q, row_src, row_weight, send_map, recv_map, scale, hp)
    return build(*ops.dispatch_tokens(x, topk_idx, topk_weights, plan, plan_host, gname,
                                      transport.path, SB, N, M, cfg._ws))


def _static_sizes(transport, pl, R: int, E: int, align: int, max_tokens: int, x, topk_idx):
    """``(send bytes, received rows, expert rows)`` of the static exchange from the
    configuration alone: no host read of any count (and, under torch.compile, no data-dependent
    shape). docs/design.md, wire format."""
    L, K, H = E // R, topk_idx.shape[1], x.shape[1]
    P = pl.row_bytes(H, x.element_size())
    per = min(K, L)
    rows = transport.static_rows(max_tokens, per)  # data rows per chunk
    chunk = transport.chunk_bytes(P, 1 + rows, 1 + max_tokens * per)
    return R * chunk, R * (1 + rows), R * max_tokens * per + L * (align - 1)


def _planned_sizes(plan_host):
    """The sizes of an eager dispatch, from the plan's host words (read by the count exchange's
    one host wait)."""
    return tuple(int(plan_host[f]) for f in (W.SEND_BYTES, W.RECV_ROWS, W.EXPERT_ROWS))


def combine(cfg, expert_y, d, weighted: bool, check) -> torch.Tensor:
    """Combine ``d`` (the call header agreed already, or ``check`` holds it for the op)."""
    dcfg = d.handle.config  # the dispatch's transport and exchange, whichever Dispatcher combines
    transport = TRANSPORTS[dcfg.transport].path
    gname = group_name(cfg.group)
    if EXCHANGES[dcfg.exchange].deferred:
        return lazy.issue_combine(expert_y, d, gname, transport, weighted)
    h = d.handle
    return ops.combine_tokens(
        expert_y, d.row_weight, h.topk_idx, h.topk_weights, h.send_map, h.recv_map, h.plan,
        h.plan_host, gname, transport, weighted, h.x_dtype, check, dcfg._ws)
