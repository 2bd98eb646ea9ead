"""The plan as Python reads it: its words' positions (reference/abi.py, the one definition the
kernels' csrc/abi.h is generated from), the transport codes, and the few plan words Python
writes or derives. ``plan`` is the int64 tensor ``epkit::plan`` computes from the gathered
count words (docs/design.md, "The plan"); on CUDA its host mirror (:func:`epkit.device.host_plan`)
is what these read, with the mirror's attribute names."""

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
           'stamp_ranks_per_node', 'HOST', 'TEMPLATE', 'host_plan',
           'raise_error']

HOST = "_epkit_host"  # attribute of a device plan: its host mirror
TEMPLATE = "_epkit_template"  # attribute of a mirror that is a routing-free template

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


def host_plan(plan: torch.Tensor) -> torch.Tensor:
    """The plan's words on the host: the plan itself on CPU; on the device path its mirror (a
    copy with a host wait, should a plan have lost it: correct, and counted by
    :func:`epkit.device.count_host_reads`)."""
    if not device_path(plan):
        return plan
    mirror = getattr(plan, HOST, None)
    return mirror if mirror is not None else to_host(plan)


def raise_error(words: torch.Tensor) -> None:
    """Raise the group's :class:`epkit.InputError` that a plan's error words carry (host
    memory: the plan on CPU, a mirror), if any."""
    code = int(words[ERR_CODE])
    if code:
        raise error(int(words[ERR_RANK]), code, int(words[ERR_A]), int(words[ERR_B]))


def ranks_per_node(plan: torch.Tensor) -> int:
    """The plan's ``G``, the nodes of the combine's summation order (a plan word that
    :func:`count_exchange` writes; a plan made by ``epkit::plan`` alone reads as 1)."""
    return max(1, int(host_plan(plan)[RANKS_PER_NODE]))


def stamp_ranks_per_node(plan: torch.Tensor, G: int) -> torch.Tensor:
    """Write ``G`` into the plan and its host mirror (on CUDA a fill, no host wait). ``G`` = 1
    writes nothing: the plan's word is 0 there, which :func:`ranks_per_node` reads as 1 (one
    launch fewer for every one-node dispatch)."""
    if G == 1:
        return plan
    plan[RANKS_PER_NODE] = G
    mirror = host_plan(plan)
    if mirror is not plan:
        with host_work():
            mirror[RANKS_PER_NODE] = G
    return plan
