"""``transport="hier"`` over torch.distributed: node-aware dispatch and combine, two stages.

The wire format and the plan are the reference's (``epkit.reference.transports.hier``,
docs/design.md): ``G = ranks_per_node`` consecutive ranks make a node, ``N = R / G`` nodes.
Stage 1 moves a token row once per destination node with a kept slot, to the *forwarder*
``f(s, n) = n G + s % G`` (an exchange inside the *inter-node subgroup* of the ranks sharing s's
local index); stage 2 fans it out inside the node (an exchange inside the *intra-node
subgroup*). Each stage moves two sections, token rows then slot rows, each one
``epkit.collectives.all_to_all`` of its own rows:

    stage 1, s -> f:  payload | int32 t | int32 n      and n slot rows (k << 24 | j_node, w)
    stage 2, f -> d:  payload | int32 s | int32 t | int32 n   and n slot rows (k << 24 | j, w)

The destination sorts its stage-2 rows by (s, t) into dedup's receive layout and runs the
dedup unpack on the dispatch's dedup plan: its expert-major result, ``recv_map`` and the whole
expert side of combine and the backward passes are dedup's own kernels. The return path returns,
per token row with n kept slots, its n rows when ``n <= per = 4 / itemsize`` else a float32
partial: d -> f the rank partial ``P_d`` (``gather_rows``), f -> s the node partial ``N_n``,
which the forwarder forms with ``reduce_tokens`` keyed by the node's ranks; the source adds the
node partials with ``reduce_tokens`` keyed by nodes. Raw rows returned to the source (at most
``per <= 2`` of them) are summed there in k order, which equals the grouped order: a sum of two
terms from +0.0 does not depend on their order.

Plan: inside the dispatch's count exchange (the dedup plan, which raises every input error on
every rank), every rank all-gathers ``3 R + 2 N`` words of its own kept routing (tokens with a
kept slot, tokens with two, kept slots per rank; tokens with one and with two kept slots per
node), where the routing is, like the count words: right after the dedup plan is made and
before its host read, which carries them too (:class:`GatherCounts`). Every rank derives every
stage's counts and the exchange variant with ``reference.transports.hier.plan`` (the same
arithmetic as the spec, so the same variant and the same EQUAL_NONUNIFORM error). Subgroups
are created once per (group ranks, ranks_per_node) and cached (:func:`topology`). Not
supported (refused in the call header, UNSUPPORTED): the lazy and static exchanges, a payload,
torch.compile.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from . import moves, ops, result
from .count_exchange import count_exchange
from . import plan as W
from .memory import device_path
from .agree import COMBINE_BACKWARD, DISPATCH_BACKWARD
from .transports.hier import HIER
from .collectives import VARIANTS, all_gather, all_to_all, dtype_code, group_name
from epkit.reference import abi
from epkit.reference.transports import hier as spec
from epkit.reference.errors import Reason

C = ops.C
DEDUP = HIER.path  # the kernel path of both stages
K_SHIFT = abi.SLOT_K_SHIFT
J_MASK = abi.DEDUP_MAX_LOCAL - 1


# ---- nodes and subgroups ---------------------------------------------------------------------

@dataclass(frozen=True)
class Sub:
    """One subgroup this rank is in: its ranks (numbered in the parent group, ascending) and
    how its exchange runs: ``group`` its own process group, or ``None`` for a single rank (a
    local copy); ``parent`` set when the subgroup has no process group of its own and its
    exchange runs on the parent with empty chunks outside the subgroup (:func:`topology`)."""

    ranks: tuple
    group: Optional[dist.ProcessGroup]
    parent: Optional[dist.ProcessGroup] = None


@dataclass(frozen=True)
class Topology:
    """This rank ``me`` of a group of ``R`` ranks, ``G`` a node, and its two subgroups."""

    R: int
    G: int
    me: int
    inter: Sub   # stage 1: the ranks with my local index, node ascending
    intra: Sub   # stage 2: my node's ranks

    @property
    def N(self) -> int:
        return self.R // self.G


_TOPOLOGIES: dict = {}  # (group name, G) -> (process groups of every subgroup, in order)


@atexit.register
def _forget_topologies() -> None:
    """Drop the subgroups before the interpreter's teardown: once destroy_process_group() has
    let them go, nothing else holds them, so they are freed (their gloo threads joined) while
    the interpreter still runs (docs/usage.md, "Troubleshooting")."""
    _TOPOLOGIES.clear()


def _subgroup_sets(R: int, G: int) -> list:
    """Every subgroup, in the order every rank creates them: the inter-node ones by local
    index, then the intra-node ones by node."""
    return ([("inter", tuple(r)) for r in spec.inter_subgroups(R, G)]
            + [("intra", tuple(r)) for r in spec.intra_subgroups(R, G)])


def _process_groups(group, G: int) -> dict:
    """The process group of every subgroup of ``group`` (created once per (group, G)).

    ``group`` spans the whole job: ``dist.new_group`` on every rank for every subgroup, in the
    same order (a subgroup of one rank, or equal to ``group``, needs none). Otherwise
    ``new_group`` is out of reach (it needs every process of the job, and the locally
    synchronised form names groups by each process's own group count), so the subgroups run
    on ``group`` itself (:class:`Sub`'s ``parent``): the same bytes, a collective of the
    whole group."""
    key = (group.group_name, G)
    if key not in _TOPOLOGIES:
        R = dist.get_world_size(group)
        whole = R == dist.get_world_size()
        glob = dist.get_process_group_ranks(group)
        made = {}
        for _, ranks in _subgroup_sets(R, G):
            if len(ranks) == 1:
                made[ranks] = Sub(ranks, None)
            elif len(ranks) == R:
                made[ranks] = Sub(ranks, group)
            elif whole:
                pg = dist.new_group([glob[r] for r in ranks], backend=str(dist.get_backend(group)))
                made[ranks] = Sub(ranks, pg)
            else:
                made[ranks] = Sub(ranks, None, parent=group)
        _TOPOLOGIES[key] = made
    return _TOPOLOGIES[key]


def topology(group, G: int) -> Topology:
    """This rank's two subgroups of ``group`` for ``G`` ranks a node."""
    R, me = dist.get_world_size(group), dist.get_rank(group)
    made = _process_groups(group, G)
    mine = {kind: made[ranks] for kind, ranks in _subgroup_sets(R, G) if me in ranks}
    return Topology(R, G, me, mine["inter"], mine["intra"])


# ---- moving rows inside a subgroup -----------------------------------------------------------

@dataclass(frozen=True)
class Section:
    """One exchange of the plan: ``counts [R, R]`` (rows a sends b; zero outside a's subgroup)
    inside ``sub`` under ``variant``."""

    counts: np.ndarray
    sub: Sub
    variant: str

    @property
    def fixed(self) -> bool:
        """The variant moves chunks of one length (padded, equal: :attr:`chunk`)."""
        return VARIANTS[self.variant].fixed_chunks

    def send(self, me: int) -> list:
        return [int(self.counts[me, p]) for p in self.sub.ranks]

    def recv(self, me: int) -> list:
        return [int(self.counts[p, me]) for p in self.sub.ranks]

    @property
    def chunk(self) -> int:
        """The padded chunk (the largest count inside the subgroup), or the equal count."""
        r = list(self.sub.ranks)
        return int(self.counts[np.ix_(r, r)].max(initial=0))

    def bytes_to(self, me: int, row_bytes: int) -> dict:
        """Bytes this rank sends each peer (reference exchange_bytes: padded moves full chunks)."""
        rows = [self.chunk] * len(self.sub.ranks) if self.fixed else self.send(me)
        return {p: n * row_bytes for p, n in zip(self.sub.ranks, rows)}


def move(rows: torch.Tensor, sec: Section, me: int, what: str) -> torch.Tensor:
    """All-to-all of ``rows [sum send, ...]`` (grouped by peer in subgroup order) along ``sec``;
    returns ``[sum recv, ...]``, peers ascending."""
    send, recv = sec.send(me), sec.recv(me)
    if rows.shape[0] != sum(send):
        raise RuntimeError(f"epkit.hier: {what}: {rows.shape[0]} rows, the plan says {sum(send)}")
    what = f"epkit hier ({what})"
    if sec.sub.parent is not None:
        return _move_on_parent(rows, send, recv, sec, what)
    if sec.sub.group is None:
        return rows
    return all_to_all(rows, send, recv, sec.sub.group, sec.variant, sec.chunk, what=what)


def _move_on_parent(rows, send, recv, sec: Section, what: str) -> torch.Tensor:
    """A subgroup's exchange as one ragged all-to-all of the parent group, chunks outside the
    subgroup empty; padded and equal move their full chunks, as inside a subgroup."""
    parent = sec.sub.parent
    R = dist.get_world_size(parent)
    sizes = ([sec.chunk] * len(send),) * 2 if sec.fixed else (send, recv)
    if sec.fixed:                                   # pad every chunk to the subgroup's chunk
        buf = rows.new_zeros((len(send) * sec.chunk,) + tuple(rows.shape[1:]))
        for i, part in enumerate(torch.split(rows, send)):
            buf[i * sec.chunk:i * sec.chunk + part.shape[0]] = part
        rows = buf
    full = [[0] * R, [0] * R]
    for i, p in enumerate(sec.sub.ranks):
        full[0][p], full[1][p] = sizes[0][i], sizes[1][i]
    got = all_to_all(rows, full[0], full[1], parent, "ragged", 0, what=what)
    if not sec.fixed:
        return got
    return torch.cat([got[i * sec.chunk:i * sec.chunk + n] for i, n in enumerate(recv)]
                     + [got[:0]])


def _true_at(mask: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """The flat positions of ``mask``'s ``n`` true entries (row-major, as ``t[mask]`` takes
    them), ``n`` known on the host (the plan's counts): on the device path, where reading the
    mask (a boolean index) would be a host wait; None off it (``t[mask]`` as it is)."""
    if not device_path(mask):
        return None
    return torch.nonzero_static(mask.reshape(-1), size=n).squeeze(1)


def _masked(t: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """``t[mask]``, ``n`` rows (:func:`_true_at`)."""
    at = _true_at(mask, n)
    return t[mask] if at is None else t.reshape(-1, *t.shape[mask.dim():])[at]


def move_units(rows: torch.Tensor, units: torch.Tensor, recv_units: torch.Tensor, sec: Section,
               me: int, what: str) -> torch.Tensor:
    """The return path: ``rows [n, per, H]``, of which row i sends its first ``units[i]``; returns
    ``[m, per, H]`` (zeros past ``recv_units``), the received rows' units in place."""
    per = rows.shape[1]
    lane = torch.arange(per, device=rows.device)
    got = move(_masked(rows, lane < units.unsqueeze(1), sum(sec.send(me))), sec, me, what)
    out = rows.new_zeros((recv_units.shape[0], per, rows.shape[2]))
    into = lane < recv_units.unsqueeze(1)
    at = _true_at(into, sum(sec.recv(me)))
    if at is None:
        out[into] = got
    else:
        out.view(-1, rows.shape[2]).index_copy_(0, at, got)
    return out


# ---- the plan ---------------------------------------------------------------------------------

def _counts_of(kept: torch.Tensor, R: int, L: int, G: int) -> torch.Tensor:
    """This rank's ``3 R + 2 N`` words from its kept routing ``[T, K]`` int64 (-1: none):
    tokens with >= 1 / >= 2 kept slots and kept slots, per rank; tokens with >= 1 / >= 2 per
    node (``reference.transports.hier.NodeCounts``, one row). Any id lands in ``[0, R]`` (-1 in
    column R, which is dropped), so a bad routing indexes nothing out of range: on the device
    path this runs before the group's error is raised, which then discards these counts."""
    T = kept.shape[0]
    at = (kept // L) % (R + 1)  # -1 -> R, the column dropped; a bad id to some rank in [0, R]
    n_td = torch.zeros((T, R + 1), dtype=torch.int64, device=kept.device).scatter_add_(
        1, at, torch.ones_like(at))[:, :R]
    n_tn = n_td.view(T, R // G, G).sum(2)
    return torch.cat([(n_td >= 1).sum(0), (n_td >= 2).sum(0), n_td.sum(0),
                      (n_tn >= 1).sum(0), (n_tn >= 2).sum(0)])


class GatherCounts:
    """The count exchange's ``also`` (production/count_exchange.py): called with the dedup plan
    (on the device), this rank's hier counts of its kept routing all-gathered where the routing
    is, ``[R (3 R + 2 N)]``, which ride on the plan's host read. ``topk_idx`` None (a rank with
    a local error, which the plan raises on every rank): zeros. ``drops``: a capacity is set.
    After the call, ``kept`` [T, K] int64 (the kept routing) and ``counts [R, 3 R + 2 N]``."""

    def __init__(self, topk_idx: Optional[torch.Tensor], group, R: int, E: int, G: int,
                 drops: bool):
        self.topk_idx, self.group, self.R, self.E, self.G, self.drops = (topk_idx, group, R, E,
                                                                           G, drops)
        self.kept: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None

    def __call__(self, plan: torch.Tensor) -> torch.Tensor:
        R, E, G = self.R, self.E, self.G
        if self.topk_idx is None:
            mine = torch.zeros(3 * R + 2 * (R // G), dtype=torch.int64, device=plan.device)
        else:
            self.kept = moves.kept_routing_of(self.topk_idx, plan, R, E, self.drops)
            mine = _counts_of(self.kept, R, E // R, G)
        got = mine.new_empty((R * mine.shape[0],))
        all_gather(got, mine, self.group, "epkit.dispatch (count exchange: hier counts)")
        self.counts = got.view(R, -1)
        return got


def hier_plan(words: torch.Tensor, R: int, G: int, exchange: str):
    """``reference.transports.hier.plan`` on the gathered hier counts in host memory (raises
    EQUAL_NONUNIFORM on every rank alike)."""
    N = R // G
    w = words.view(R, -1).numpy().astype(np.int64)
    c = spec.NodeCounts(tokens=w[:, :R], multi=w[:, R:2 * R], slots=w[:, 2 * R:3 * R],
                        node_tokens=w[:, 3 * R:3 * R + N], node_multi=w[:, 3 * R + N:])
    # reference.transports.hier.plan reads the group's ranks_per_node and exchange only
    return spec.plan(SimpleNamespace(ranks_per_node=G, exchange=exchange), c)


# ---- dispatch ----------------------------------------------------------------------------------

@dataclass
class HierState:
    """What a hier dispatch keeps for combine and the backward passes (this rank's part).

    On the source:

    - ``kept [T, K]`` int64: the kept routing; ``weights [T, K]`` float32: the routing weights
      (detached);
    - ``send1_map [T, N]`` int64: the stage-1 token row of (token, node) (-1: none);
    - ``stage1_token``, ``stage1_slots [S1]`` int64: the token, and its kept slots on the node,
      of each stage-1 token row; ``stage1_slot_index [S1s]`` int64: ``t * K + k`` of each
      stage-1 slot row.

    On the forwarder (a *received row* is a stage-1 token row as it arrives there, ``A`` of
    them; a *forwarded row* a stage-2 token row it sends on, ``F`` of them):

    - ``forward_map [A, G]`` int64: the forwarded row of (received row, rank of the node);
      ``forward_source [F]``: the received row of each forwarded row;
    - ``received_experts [A, K]`` int64: a received row's slots as expert ids on the node (-1:
      none); ``received_weights [A, K]`` float32: their weights; ``received_slots [A]``: its
      kept slots on the node; ``forward_slots [F]``: each forwarded row's;
    - ``forward_slot_order [As]`` int64: the received slot row of each stage-2 slot row;
      ``received_raw_at``: where a received row's raw rows lie on the return path
      (:func:`_raw_index`).

    On the destination: ``stage2_of_dedup [N2]`` int64: the stage-2 row of each dedup-order row,
    ``dedup_of_stage2``: its inverse; ``stage2_slots [N2]``: kept slots of each stage-2 row;
    ``recv_map [N2, K]`` (dedup order).
    """

    topo: Topology
    plan: object          # reference.transports.hier.HierPlan
    counts: torch.Tensor  # [R, 3 R + 2 N] int64: the gathered hier counts (GatherCounts)
    dedup_plan: torch.Tensor
    dedup_plan_host: torch.Tensor
    E: int
    kept: torch.Tensor
    weights: torch.Tensor
    group_name: str
    send1_map: Optional[torch.Tensor] = None
    stage1_token: Optional[torch.Tensor] = None
    stage1_slots: Optional[torch.Tensor] = None
    stage1_slot_index: Optional[torch.Tensor] = None
    forward_map: Optional[torch.Tensor] = None
    forward_source: Optional[torch.Tensor] = None
    received_experts: Optional[torch.Tensor] = None
    received_weights: Optional[torch.Tensor] = None
    received_slots: Optional[torch.Tensor] = None
    forward_slots: Optional[torch.Tensor] = None
    forward_slot_order: Optional[torch.Tensor] = None
    received_raw_at: tuple = ()
    stage2_of_dedup: Optional[torch.Tensor] = None
    dedup_of_stage2: Optional[torch.Tensor] = None
    stage2_slots: Optional[torch.Tensor] = None
    recv_map: Optional[torch.Tensor] = None

    def section(self, name: str, per: int = 0) -> Section:
        """A section of the plan by name: ``s1_tok`` ... ``s2_slot``, ``back1``/``back2`` (the
        return path's rows for ``per``), ``w1``/``w2`` (one weight gradient per kept slot,
        back)."""
        p, t = self.plan, self.topo
        counts = {"back1": lambda: p.back_rows(1, per), "back2": lambda: p.back_rows(2, per),
                  "w1": lambda: p.s1_slot.T, "w2": lambda: p.s2_slot.T}.get(
            name, lambda: getattr(p, name))()
        return Section(counts, t.inter if name in ("s1_tok", "s1_slot", "back1", "w1")
                       else t.intra, p.variant)


def _reinterpret(t: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """``t``'s bytes as ``dtype`` in ``shape`` (an empty tensor, whatever its strides, too)."""
    if t.numel() == 0:
        return t.new_empty(shape, dtype=dtype)
    dense = t.storage_offset() == 0 and t.stride() == torch.empty(t.shape, device="meta").stride()
    if not dense:  # a view of other bytes (a column slice, a one-row tensor's odd stride)
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t.view(dtype).reshape(shape)


def _int32_rows(*cols: torch.Tensor) -> torch.Tensor:
    """int32 columns -> their little-endian bytes, uint8 ``[n, 4 * len(cols)]``."""
    n = cols[0].shape[0]
    return _reinterpret(torch.stack([c.to(torch.int32) for c in cols], 1), torch.uint8,
                        (n, 4 * len(cols)))


def _slot_rows(k: torch.Tensor, j: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Slot rows ``int32 (k << 24 | j) | float32 w`` (uint8 [n, 8]); k < 256 wraps to the
    negative int32 of the same bits."""
    code = (k << K_SHIFT) | j
    code = torch.where(code >= 1 << 31, code - (1 << 32), code)
    return _int32_rows(code, _reinterpret(w, torch.int32, w.shape))


def _decode_slots(rows: torch.Tensor):
    """Slot rows uint8 [n, 8] -> (k, j, w): int64, int64, float32 [n]."""
    n = rows.shape[0]
    code = _reinterpret(rows[:, :4], torch.int32, (n,)).to(torch.int64) & 0xFFFFFFFF
    return code >> K_SHIFT, code & J_MASK, _reinterpret(rows[:, 4:8], torch.float32, (n,))


def _meta(rows: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """``n`` int32 words from byte ``at`` of every row -> int64 [rows, n]."""
    return _reinterpret(rows[:, at:at + 4 * n], torch.int32, (rows.shape[0], n)).to(torch.int64)


def _stage1_send(payload, kept, w, N: int, GL: int, rows: int, slots: int):
    """Source: (token rows [S1, P + 8], slot rows [S1s, 8], and the HierState fields
    send1_map, rows1_t, n1, slots1), node ascending, then t, then k. ``rows``, ``slots``: S1
    and S1s, from the plan."""
    T, K = kept.shape
    dev = kept.device
    node = torch.where(kept >= 0, kept // GL, N)
    cnt = torch.zeros((T, N + 1), dtype=torch.int64, device=dev).scatter_add_(
        1, node, torch.ones_like(node))[:, :N]
    nn_, tt = _nonzero(cnt > 0, rows)                                 # (node, t) order
    send1_map = torch.full((T, N), -1, dtype=torch.int64, device=dev)
    send1_map[tt, nn_] = torch.arange(tt.numel(), device=dev)
    n_tn = cnt[tt, nn_]                                               # each row's kept slots
    tok = torch.cat([payload[tt], _int32_rows(tt, n_tn)], 1)
    flat = node.reshape(-1)
    key = flat * (T * K) + torch.arange(T * K, device=dev)
    slots1 = torch.argsort(key)[:slots]                                # (node, t, k) order
    e, n = kept.reshape(-1)[slots1], flat[slots1]
    slot = _slot_rows(slots1 % K, e - n * GL, w.reshape(-1)[slots1])
    return tok, slot, dict(send1_map=send1_map, stage1_token=tt, stage1_slots=n_tn,
                           stage1_slot_index=slots1)


def _nonzero(mask: torch.Tensor, n: int):
    """``mask.t().nonzero(as_tuple=True)``, ``n`` entries known from the plan: on the device
    path without a host wait (``nonzero_static``)."""
    if not device_path(mask):
        return mask.t().nonzero(as_tuple=True)
    return tuple(torch.nonzero_static(mask.t(), size=n).unbind(1))


def _forward(tok1, slot1, counts, me: int, G: int, L: int, K: int, P: int, rows: int):
    """Forwarder: its stage-1 rows -> its stage-2 rows (rank of the node ascending, then
    received row), and the maps of the return path (a dict of HierState fields). ``counts``:
    the gathered hier counts ``[R, 3 R + 2 N]`` (:class:`GatherCounts`), where the routing is;
    ``rows``: its stage-2 token rows, from the plan."""
    dev = tok1.device
    A, R = tok1.shape[0], counts.shape[0]
    # each received row's source rank, made where the rows are: stage 1 brings this forwarder
    # the rows of each rank with its local index (node ascending), as many as that rank has
    # tokens for this node (reference hier plan's s1_tok); no host data copied over
    src = torch.repeat_interleave(torch.arange(me % G, R, G, device=dev),
                                  counts[me % G::G, 3 * R + me // G], output_size=A)
    meta = _meta(tok1, P, 2)
    arr_t, arr_n = meta[:, 0], meta[:, 1]
    if not device_path(arr_n) and int(arr_n.sum()) != slot1.shape[0]:  # (a wait on the device)
        raise RuntimeError("epkit.hier: stage-1 token rows do not claim every slot row")
    k, jn, w = _decode_slots(slot1)
    sa = torch.repeat_interleave(torch.arange(A, device=dev), arr_n, output_size=slot1.shape[0])
    dl = jn // L
    fidx = torch.full((A, K), -1, dtype=torch.int64, device=dev)
    fidx[sa, k] = jn
    fw = torch.zeros((A, K), dtype=torch.float32, device=dev)
    fw[sa, k] = w
    n_ad = torch.zeros((A, G), dtype=torch.int64, device=dev).index_put_(
        (sa, dl), torch.ones_like(sa), accumulate=True)
    fd, fa = _nonzero(n_ad > 0, rows)                                  # (rank, received row) order
    fan_map = torch.full((A, G), -1, dtype=torch.int64, device=dev)
    fan_map[fa, fd] = torch.arange(fa.numel(), device=dev)
    fan_n = n_ad[fa, fd]
    tok2 = torch.cat([tok1[fa, :P], _int32_rows(src[fa], arr_t[fa], fan_n)], 1)
    order2 = torch.argsort(dl * max(slot1.shape[0], 1) + torch.arange(slot1.shape[0], device=dev))
    slot2 = _slot_rows(k[order2], jn[order2] % L, w[order2])
    st = dict(forward_map=fan_map, forward_source=fa, received_experts=fidx, received_weights=fw,
              received_slots=arr_n, forward_slots=fan_n, forward_slot_order=order2,
              received_raw_at=_raw_index(sa, fan_map[sa, dl], arr_n, fan_n, order2))
    return tok2, slot2, st


def _raw_index(sa, fan_row, arr_n, fan_n, order2):
    """Where each received slot's row lies on the return path: ``(received row, i)`` its place
    in the received row's return (k ascending), ``(forwarded row, q)`` its place in the stage-2
    return (the forwarded row's slots, k ascending)."""
    dev = sa.device
    i = torch.arange(sa.numel(), device=dev) - (torch.cumsum(arr_n, 0) - arr_n)[sa]
    q = torch.empty_like(i)
    start = torch.cumsum(fan_n, 0) - fan_n
    fr2 = torch.repeat_interleave(torch.arange(fan_n.numel(), device=dev), fan_n,
                                  output_size=order2.numel())
    q[order2] = torch.arange(order2.numel(), device=dev) - start[fr2]
    return sa, i, fan_row, q


def _receive(tok2, slot2, R: int, P: int, hp):
    """Destination: stage-2 rows -> dedup's receive buffer (chunks by source s ascending, token
    rows by t, then their slot rows) and (perm, to_dedup, n2). ``hp``: the dedup plan's host
    words (its receive counts: the rows and slot rows of each source)."""
    dev = tok2.device
    meta = _meta(tok2, P, 3)
    s, t, n2 = meta[:, 0], meta[:, 1], meta[:, 2]
    if not device_path(n2) and int(n2.sum()) != slot2.shape[0]:  # (a wait on the device)
        raise RuntimeError("epkit.hier: stage-2 token rows do not claim every slot row")
    perm = torch.argsort(s * (1 << 32) + t)
    to_dedup = torch.empty_like(perm)
    to_dedup[perm] = torch.arange(perm.numel(), device=dev)
    ns = n2[perm]
    first = (torch.cumsum(n2, 0) - n2)[perm]
    at = torch.repeat_interleave(first - (torch.cumsum(ns, 0) - ns), ns,
                                 output_size=slot2.shape[0])
    slots = slot2[at + torch.arange(slot2.shape[0], device=dev)]
    tok = torch.cat([tok2[perm, :P], tok2[perm, P + 4:P + 12]], 1)   # payload | t | n
    if device_path(s):  # the dedup plan's receive layout, read from its host mirror
        sl = W.plan_slices(R, int(hp[W.EXPERTS]))
        rows_of, slots_of = hp[sl["recv_counts"]].tolist(), hp[sl["recv_slots"]].tolist()
    else:
        rows_of = torch.bincount(s, minlength=R).tolist()
        slots_of = torch.zeros(R, dtype=torch.int64, device=dev).index_add_(0, s, n2).tolist()
    parts = [p for a, b in zip(torch.split(tok, rows_of), torch.split(slots, slots_of))
             for p in (a.reshape(-1), b.reshape(-1))]
    buf = torch.cat(parts) if parts else tok.new_zeros((0,))
    return buf, perm, to_dedup, n2


def _dispatch_bytes(st: HierState, P: int) -> torch.Tensor:
    """``[R]`` int64: bytes this rank sends each peer over both stages (diagonal included)."""
    out = [0] * st.topo.R
    for name, row in (("s1_tok", P + abi.DEDUP_TOKEN_META_BYTES), ("s1_slot", abi.SLOT_ROW_BYTES),
                      ("s2_tok", P + abi.HIER_TOKEN_META_BYTES), ("s2_slot", abi.SLOT_ROW_BYTES)):
        for peer, b in st.section(name).bytes_to(st.topo.me, row).items():
            out[peer] += b
    return torch.tensor(out, dtype=torch.int64)


def _dispatch_forward(st: HierState, x: torch.Tensor, w: torch.Tensor):
    """Both stages and the unpack: ``(expert_x, row_src, row_weight, recv_map)``."""
    t, me = st.topo, st.topo.me
    K, L = st.kept.shape[1], st.E // t.R
    P = x.shape[1] * x.element_size()
    payload = _reinterpret(x, torch.uint8, (x.shape[0], P))
    tok1, slot1, fields = _stage1_send(payload, st.kept, w, t.N, t.G * L,
                                       sum(st.section("s1_tok").send(me)),
                                       sum(st.section("s1_slot").send(me)))
    for name, v in fields.items():
        setattr(st, name, v)
    tok1 = move(tok1, st.section("s1_tok"), me, "stage 1 token rows")
    slot1 = move(slot1, st.section("s1_slot"), me, "stage 1 slot rows")
    tok2, slot2, fields = _forward(tok1, slot1, st.counts, me, t.G, L, K, P,
                                   sum(st.section("s2_tok").send(me)))
    for name, v in fields.items():
        setattr(st, name, v)
    tok2 = move(tok2, st.section("s2_tok"), me, "stage 2 token rows")
    slot2 = move(slot2, st.section("s2_slot"), me, "stage 2 slot rows")
    hp = st.dedup_plan_host
    buf, st.stage2_of_dedup, st.dedup_of_stage2, st.stage2_slots = _receive(tok2, slot2, t.R, P, hp)
    N, M = int(hp[W.RECV_ROWS]), int(hp[W.EXPERT_ROWS])
    out = C.unpack(buf, st.dedup_plan, DEDUP, x.shape[1], x.dtype, K, N, M, hp)
    st.recv_map = out[3]
    return out


class _Dispatch(torch.autograd.Function):
    """x, topk_weights -> expert_x, row_weight (differentiable), row_src, recv_map."""

    @staticmethod
    def forward(ctx, x, topk_weights, st):
        expert_x, row_src, row_weight, recv_map = _dispatch_forward(st, x, topk_weights.detach())
        ctx.st, ctx.x_dtype = st, x.dtype
        ctx.mark_non_differentiable(row_src, recv_map)
        return expert_x, row_weight, row_src, recv_map

    @staticmethod
    def backward(ctx, grad_expert_x, grad_row_weight, *_):
        st = ctx.st
        ops._agree_backward(st.group_name, DISPATCH_BACKWARD, grad_expert_x,
                            "epkit.dispatch backward (hier)")
        grad_x = reduce_back(st, grad_expert_x.contiguous(), None, False, ctx.x_dtype)
        return grad_x, weight_grads_back(st, grad_row_weight), None


def dispatch(cfg, seq: int, x, topk_idx, topk_weights, local, G: int):
    """``Dispatcher.dispatch`` for ``transport="hier"`` (the call header agreed already):
    the count exchange (the dedup plan: every input error raises here), the hier counts, both
    stages. Returns an :class:`epkit.Dispatch`."""
    group = cfg.group
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, align = int(cfg.num_experts), int(cfg.align)
    capacity = -1 if cfg.capacity is None else int(cfg.capacity)
    factor = -1.0 if cfg.capacity_factor is None else float(cfg.capacity_factor)
    code, a, b = local
    ok = code == Reason.OK
    pre_error = [int(code), int(a), int(b), dtype_code(getattr(x, "dtype", None)), -1]
    words = C.prepare(x, topk_idx, topk_weights, E, R, pre_error, 0)
    gname = group_name(group)
    # the dedup plan, with the hier counts riding on its one host read
    counts = GatherCounts(topk_idx if ok else None, group, R, E, G, capacity >= 0 or factor > 0)
    plan, plan_host, counts_host = count_exchange(
        words, gname, rank, E, align, capacity, DEDUP, abi.EXCHANGE_CODES["ragged"], -1, None,
        factor, topk_idx if ok else None, also=counts)
    W.stamp_ranks_per_node(plan, plan_host, G)
    topo = topology(group, G)
    hplan = hier_plan(counts_host, R, G, cfg.exchange)
    st = HierState(topo, hplan, counts.counts, plan, plan_host, E, counts.kept,
                   topk_weights.detach(), gname)
    expert_x, row_weight, row_src, recv_map = _Dispatch.apply(x, topk_weights, st)
    P = x.shape[1] * x.element_size()
    return result.build(cfg, seq, x, topk_idx, topk_weights, plan, plan_host, expert_x, row_src,
                        row_weight, st.send1_map, recv_map, hier_state=st,
                        bytes_sent=_dispatch_bytes(st, P))


# ---- the return path: combine, dispatch backward -----------------------------------------------

def reduce_back(st: HierState, ys: torch.Tensor, row_weight, weighted: bool, out_dtype):
    """Combine (``ys`` = expert_y, weighted or not) or dispatch backward (``ys`` = gradient
    rows, unweighted) back over both stages: ``[T, H]`` in ``out_dtype``."""
    t, me, H = st.topo, st.topo.me, ys.shape[1]
    per = 4 // ys.element_size()
    w = row_weight if row_weight is not None else ys.new_zeros((0,), dtype=torch.float32)
    rows = C.gather_rows(ys, st.recv_map, w, DEDUP, weighted)        # [N2, H] f32, dedup order
    r2 = _reinterpret(rows[st.dedup_of_stage2], ys.dtype, (rows.shape[0], per, H))
    got2 = move_units(r2, st.stage2_slots.clamp(max=per), st.forward_slots.clamp(max=per),
                      st.section("back2", per), me, "stage 2 back")
    back2 = got2.reshape(-1, per * H)
    node = C.reduce_tokens(back2, st.forward_map, st.received_experts, st.received_weights,
                           t.G * (st.E // t.R), t.G, DEDUP, weighted, torch.float32,
                           1)                                        # N_n per received row
    r1 = _reinterpret(node, ys.dtype, (node.shape[0], per, H)).clone()
    sa, i, fr, q = st.received_raw_at
    raw = st.received_slots[sa] <= per                                # the node's rows themselves
    if not device_path(raw):
        r1[sa[raw], i[raw]] = got2[fr[raw], q[raw]]
    else:  # without a boolean index (a host wait): every slot writes, the others what is there
        # (a received row's slots are all raw or none, so two writes to one place write one value)
        ic, qc = i.clamp(max=per - 1), q.clamp(max=per - 1)
        r1[sa, ic] = torch.where(raw.unsqueeze(1), got2[fr, qc], r1[sa, ic])
    got1 = move_units(r1, st.received_slots.clamp(max=per), st.stage1_slots.clamp(max=per),
                      st.section("back1", per), me, "stage 1 back")
    return C.reduce_tokens(got1.reshape(-1, per * H), st.send1_map, st.kept,
                           _weights(st, weighted), st.E, t.N, DEDUP, weighted, out_dtype, 1)


def _weights(st: HierState, weighted: bool) -> torch.Tensor:
    """The source's routing weights ``[T, K]`` float32 for reduce_tokens (unread unweighted)."""
    return st.weights if weighted else st.weights.new_zeros((0,))


def weight_grads_back(st: HierState, grad_row_weight) -> torch.Tensor:
    """The routing weights' gradient ``[T, K]`` float32: one float32 per kept slot back over
    both stages, in slot-row order (zeros for dropped and unused slots)."""
    T, K = st.kept.shape
    if grad_row_weight is None:
        return torch.zeros((T, K), dtype=torch.float32, device=st.kept.device)
    me = st.topo.me
    rm = st.recv_map  # [N, K] values in received-row order, 0 where a slot names no row
    g = grad_row_weight.contiguous()
    vals = torch.where(rm >= 0, g[rm.clamp(min=0)], g.new_zeros(()))[st.dedup_of_stage2]
    got2 = move(_masked(vals, st.recv_map[st.dedup_of_stage2] >= 0, sum(st.section("w2").send(me))),
                st.section("w2"), me, "weight gradients 2")
    received = torch.empty_like(got2)  # in the received rows' slot order
    received[st.forward_slot_order] = got2
    got1 = move(received, st.section("w1"), me, "weight gradients 1")
    gw = torch.zeros(T * K, dtype=torch.float32, device=got1.device)
    gw[st.stage1_slot_index] = got1
    return gw.view(T, K)


def combine_backward(st: HierState, grad_out, expert_y, row_weight, weighted: bool):
    """``(grad_expert_y [M, H] y dtype, grad_row_weight [M] float32)``: grad_out rows travel
    the dispatch's way (one per token row of each stage), the expert side is dedup's."""
    me = st.topo.me
    got1 = move(grad_out[st.stage1_token], st.section("s1_tok"), me, "combine backward 1")
    got2 = move(got1[st.forward_source], st.section("s2_tok"), me, "combine backward 2")
    return C.combine_backward_dest(got2[st.stage2_of_dedup].contiguous(), st.recv_map, row_weight,
                                   expert_y.contiguous(), weighted)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_y, row_weight, st, weighted, out_dtype):
        ctx.st, ctx.weighted = st, weighted
        ctx.save_for_backward(expert_y, row_weight)
        return reduce_back(st, expert_y.contiguous(), row_weight.detach(), weighted, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        expert_y, row_weight = ctx.saved_tensors
        st = ctx.st
        ops._agree_backward(st.group_name, COMBINE_BACKWARD, grad_out,
                            "epkit.combine backward (hier)")
        gy, gw = combine_backward(st, grad_out.contiguous(), expert_y, row_weight.detach(),
                                  ctx.weighted)
        return gy, (gw if ctx.weighted else None), None, None, None


def combine(cfg, expert_y: torch.Tensor, d, weighted: bool, check) -> torch.Tensor:
    """``Dispatcher.combine`` for a hier Dispatch (the call header agreed already: hier is
    never traced, so ``check`` is empty)."""
    return _Combine.apply(expert_y, d.row_weight, d.handle.hier_state, weighted, d.handle.x_dtype)
