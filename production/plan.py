"""The plan as Python reads it: its words' positions (reference/abi.py, the one definition the
kernels' csrc/abi.h is generated from), the transport codes, and the few plan words Python
writes or derives. ``plan`` is the int64 tensor ``epkit::plan`` computes from the gathered
count words (docs/design.md, "The plan"). Python reads its words on the host: ``plan_host``,
which ``epkit::count_exchange`` returns beside the plan and every op takes as an argument (on
the device path its mirror in pinned host memory, made with the dispatch's one host wait; on
CPU a copy of the plan)."""

from __future__ import annotations

import torch

from .hostreads import to_host
from .memory import device_path, host_work
from epkit.reference import abi
from epkit.reference.errors import error

__all__ = ['TRANSPORTS', 'PAIRS', 'DEDUP', 'ERR_CODE', 'ERR_A', 'ERR_B', 'ERR_RANK', 'SEND_ROWS',
           'RECV_ROWS', 'EXPERT_ROWS', 'UNIFORM', 'MAX_CHUNK', 'RANKS', 'LOCAL_EXPERTS', 'EXPERTS',
           'STATIC_CAP', 'VARIANT', 'PAYLOAD_BYTES', 'TOK_CAP', 'SLOT_CAP', 'SEND_BYTES',
           'RECV_BYTES', 'NONUNIFORM_RANK', 'DROPPED_ANY', 'RANKS_PER_NODE', 'PLAN_HEADER',
           'WORD_HEADER', 'plan_size', 'plan_slices', 'ranks_per_node',
           'stamp_ranks_per_node', 'host_words', 'raise_error']

TRANSPORTS = dict(abi.TRANSPORT_CODES)
PAIRS, DEDUP = TRANSPORTS["pairs"], TRANSPORTS["dedup"]
_F = {name: i for i, name in enumerate(abi.PLAN_FIELDS)}
ERR_CODE, ERR_A, ERR_B, ERR_RANK = (_F[n] for n in ("err_code", "err_a", "err_b", "err_rank"))
SEND_ROWS, RECV_ROWS, EXPERT_ROWS, UNIFORM, MAX_CHUNK = (
    _F[n] for n in ("send_rows", "recv_rows", "expert_rows", "uniform", "max_chunk"))
RANKS, LOCAL_EXPERTS, EXPERTS = _F["ranks"], _F["local_experts"], _F["experts"]
(STATIC_CAP, VARIANT, PAYLOAD_BYTES, TOK_CAP, SLOT_CAP, SEND_BYTES, RECV_BYTES,
 NONUNIFORM_RANK, DROPPED_ANY, RANKS_PER_NODE) = (
    _F[n] for n in ("static_cap", "variant", "payload_bytes", "tok_cap", "slot_cap", "send_bytes",
                    "recv_bytes", "nonuniform_rank", "dropped_any", "ranks_per_node"))
PLAN_HEADER = abi.PLAN_HEADER
WORD_HEADER = abi.WORD_HEADER
plan_size = abi.plan_size
plan_slices = abi.plan_slices


def host_words(plan: torch.Tensor) -> torch.Tensor:
    """A plan's words on the host, read from the plan itself: the plan on CPU; on the device
    path a copy (a host wait, counted by :func:`epkit.device.count_host_reads`). For a plan
    without its ``plan_host`` (a kernel called alone); the ops are handed theirs."""
    return to_host(plan) if device_path(plan) else plan


def raise_error(words: torch.Tensor) -> None:
    """Raise the group's :class:`epkit.InputError` that a plan's error words carry (host
    memory: the plan on CPU, a mirror), if any."""
    code = int(words[ERR_CODE])
    if code:
        raise error(int(words[ERR_RANK]), code, int(words[ERR_A]), int(words[ERR_B]))


def ranks_per_node(plan_host: torch.Tensor) -> int:
    """The plan's ``G``, the nodes of the combine's summation order (a plan word that
    :func:`count_exchange` writes; a plan made by ``epkit::plan`` alone reads as 1)."""
    return max(1, int(plan_host[RANKS_PER_NODE]))


def stamp_ranks_per_node(plan: torch.Tensor, plan_host: torch.Tensor, G: int) -> None:
    """Write ``G`` into the plan and its host words (on the device a fill, no host wait).
    ``G`` = 1 writes nothing: the plan's word is 0 there, which :func:`ranks_per_node` reads
    as 1 (one launch fewer for every one-node dispatch)."""
    if G == 1:
        return
    plan[RANKS_PER_NODE] = G
    if plan_host is not plan:
        with host_work():
            plan_host[RANKS_PER_NODE] = G
