"""Dispatchers with the bugs that escaped the harness's earlier strategies, and valid variants
that must keep passing. Each wraps the plain-torch baseline (bit-exact, so it meets every
contract) or the torchtitan-style port, and changes one thing the way a real dispatcher does.
Workers load this file by path (``--impl path.py:factory``).

The base here validates its inputs like the reference (every rank raises the reference's
InputError), so that under ``check_errors`` only a planted validation bug fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from epkit.baselines.plain_torch import PlainTorchDispatcher
from epkit.reference import validate
from epkit.verify.adapt import FullTopK
from epkit.verify.adapters import load_factory
from epkit.verify.worker import to_numpy

# by path: workers have no tests/verify on sys.path
Titan = load_factory(str(Path(__file__).resolve().with_name("titan_port.py")) + ":Titan")

SUBNORMAL = 2.0**-126


def _raise_invalid(x, idx, w, num_experts, align, capacity, group, dedupe=False):
    """Every rank raises the reference's InputError for the group's inputs (one all_gather of
    a header per rank, as epkit does). ``dedupe``: duplicate ids are not an error (the bug of
    :class:`MergesDuplicates`)."""
    R = dist.get_world_size(group)
    xn, idn, wn = to_numpy(x.detach()), to_numpy(idx), to_numpy(w.detach())
    if xn.dtype == np.float16:  # this dispatcher takes float16 (the reference's checks do not)
        xn = xn.astype(np.float32)
    triple = validate.option_triple(align, capacity, num_experts, R)
    if triple[0] == 0:
        if dedupe and idn.ndim == 2:
            idn = _last_wins(torch.as_tensor(idn)).numpy()
        triple = validate.local_triple(xn, idn, wn, int(num_experts))
    head = torch.from_numpy(validate.header(triple, xn, idn))
    heads = [torch.empty_like(head) for _ in range(R)]
    dist.all_gather(heads, head, group=group)
    err = validate.group_error(torch.stack(heads).numpy())
    if err is not None:
        raise err


def _last_wins(idx):
    """Megatron's routing map: a row naming an expert twice keeps the last slot only."""
    idx = idx.clone()
    for t in range(idx.shape[0]):
        seen = {}
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                if e in seen:
                    idx[t, seen[e]] = -1
                seen[e] = k
    return idx


class Validating(PlainTorchDispatcher):
    """The baseline, raising the reference's InputError on every rank for invalid inputs."""

    dedupe = False

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align=1, capacity=None):
        _raise_invalid(x, topk_idx, topk_weights, num_experts, align, capacity, self.group,
                       self.dedupe)
        return super().dispatch(x, self.route(x, topk_idx, topk_weights), topk_weights,
                                num_experts=num_experts, align=align, capacity=capacity)

    def route(self, x, topk_idx, topk_weights):
        """The routing the dispatcher actually sends (a bug may lose slots here)."""
        return topk_idx


# -- bugs ------------------------------------------------------------------------------------
class TruncatesTokens(Validating):
    """Drops every token past index 31 (a fixed 32-token staging buffer)."""

    def route(self, x, topk_idx, topk_weights):
        idx = topk_idx.clone()
        idx[32:] = -1
        return idx


class PeerBuffer128(Validating):
    """Sends at most 128 rows to each peer (a per-peer buffer that silently truncates)."""

    def route(self, x, topk_idx, topk_weights):
        R = dist.get_world_size(self.group)
        L = self._experts // R
        idx = topk_idx.clone().long()
        flat = idx.reshape(-1)
        for d in range(R):
            rows = torch.nonzero((flat >= 0) & (flat // L == d)).reshape(-1)
            flat[rows[128:]] = -1
        return idx.view(topk_idx.shape).to(topk_idx.dtype)

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, **kw):
        self._experts = num_experts
        return super().dispatch(x, topk_idx, topk_weights, num_experts=num_experts, **kw)


class IgnoresHighSlots(Validating):
    """Routes only the first 16 top-k slots (a fixed-width k loop)."""

    def route(self, x, topk_idx, topk_weights):
        idx = topk_idx.clone()
        idx[:, 16:] = -1
        return idx


class ProbsNonZero(Validating):
    """Builds its routing map from ``probs != 0``: a slot of weight exactly 0 is lost."""

    def route(self, x, topk_idx, topk_weights):
        return torch.where(topk_weights.detach() != 0, topk_idx, torch.full_like(topk_idx, -1))


class MergesDuplicates(Validating):
    """Accepts a row naming an expert twice and merges the slots, the last weight winning
    (Megatron's routing map), where the spec raises."""

    dedupe = True

    def route(self, x, topk_idx, topk_weights):
        return _last_wins(topk_idx)


class NanToNum(Validating):
    """Runs ``nan_to_num`` over combine's output rows."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        return torch.nan_to_num(super().combine(expert_y, dispatched, weighted=weighted))


class FlushesSubnormals(Validating):
    """Flushes subnormal values to zero in the rows it moves (a kernel built with FTZ)."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        ex = d.expert_x
        tiny = ex.detach().float().abs() < SUBNORMAL
        return dataclasses.replace(d, expert_x=torch.where(tiny, ex * 0, ex))


class ZeroRankBfloat16(Validating):
    """Mis-scales combine when a rank of the group has no tokens and the tokens are bfloat16
    (an empty-rank shortcut that skips a cast)."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        R = dist.get_world_size(self.group)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(R)]
        dist.all_gather(counts, torch.tensor([x.shape[0]]), group=self.group)
        d.broken = x.dtype == torch.bfloat16 and any(int(c) == 0 for c in counts)
        return d

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = super().combine(expert_y, dispatched, weighted=weighted)
        return out * 2 if dispatched.broken else out


class OddGroupSize(Validating):
    """Wrong only on a group of three ranks (a power-of-two assumption in a split)."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        out = super().combine(expert_y, dispatched, weighted=weighted)
        return out * 0.5 if dist.get_world_size(self.group) == 3 else out


class IgnoresCapacity(Validating):
    """Ignores ``capacity``: keeps every slot."""

    def dispatch(self, x, topk_idx, topk_weights, *, capacity=None, **kw):
        return super().dispatch(x, topk_idx, topk_weights, capacity=None, **kw)


truncates_tokens = TruncatesTokens
peer_buffer_128 = PeerBuffer128
ignores_high_slots = IgnoresHighSlots
probs_nonzero = ProbsNonZero
merges_duplicates = MergesDuplicates
merges_duplicates.capabilities = {"check_errors": True}
nan_to_num = NanToNum
flushes_subnormals = FlushesSubnormals
zero_rank_bfloat16 = ZeroRankBfloat16
odd_group_size = OddGroupSize
ignores_capacity = IgnoresCapacity


# -- torchtitan-style: sums in the token dtype, declares accumulate native ----------------------
class _TitanOneTokenOff(Titan):
    """Token 0's output off by a relative 2**-9 (within a bfloat16 bound, not a float32 one)."""

    def combine(self, expert_y, d, *, weighted):
        out = super().combine(expert_y, d, weighted=weighted)
        if out.shape[0]:
            out = torch.cat([(out[:1].float() * (1 + 2.0**-9)).to(out.dtype), out[1:]])
        return out


class _TitanBfloat16WeightGrad(Titan):
    """The routing weights' gradient computed in bfloat16, whatever the tokens' dtype."""

    def combine(self, expert_y, d, *, weighted):
        if weighted:
            w = d.h.w
            wb = w.to(torch.bfloat16)
            d.h.w = w.detach() + (wb - wb.detach()).float()  # forward exact, gradient bf16
        return super().combine(expert_y, d, weighted=weighted)


def _titan(cls):
    def make(group):
        return FullTopK(cls(group), group)

    make.capabilities = {"capacity": False, "accumulate": "native"}
    return make


titan_one_token_off = _titan(_TitanOneTokenOff)
titan_bfloat16_weight_grad = _titan(_TitanBfloat16WeightGrad)
titan_native = _titan(Titan)


# -- valid variants: they must pass --------------------------------------------------------------
def _segments(d):
    off = d.expert_offsets.tolist()
    return [(off[j], n) for j, n in enumerate(d.tokens_per_expert.tolist())]


class _Relaid(PlainTorchDispatcher):
    """The baseline's rows placed differently: ``layout(d)`` gives ``p`` (row m of the result
    is the baseline's row ``p[m]``, -1 = a new padding row) and the new offsets; combine reads
    expert_y back into the baseline's layout."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        p, offsets = self.layout(d)
        M = d.expert_x.shape[0]
        take = torch.where(p < 0, M, p)  # a new padding row reads an appended one

        def pad_row(a, fill):
            return torch.cat([a, torch.full((1, *a.shape[1:]), fill, dtype=a.dtype)])[take]

        ex, src, rw = pad_row(d.expert_x, 0), pad_row(d.row_src, -1), pad_row(d.row_weight, 0)
        out = dataclasses.replace(d, expert_x=ex, row_src=src, row_weight=rw,
                                  expert_offsets=offsets)
        out.relaid = (p, d.expert_x.shape[0])
        return out

    def combine(self, expert_y, dispatched, *, weighted=True):
        p, M = dispatched.relaid
        real = p >= 0
        back = torch.zeros((M, expert_y.shape[1]), dtype=expert_y.dtype).index_copy(
            0, p[real], expert_y[real])
        return super().combine(back, dispatched, weighted=weighted)


class ReversedRows(_Relaid):
    """Every expert's rows in reverse order."""

    def layout(self, d):
        p = torch.arange(d.expert_x.shape[0])
        for start, n in _segments(d):
            p[start:start + n] = torch.arange(start + n - 1, start - 1, -1)
        return p, d.expert_offsets


class PaddingInsideSegments(_Relaid):
    """``align`` padding rows at the front of every expert's segment (zeros, row_src -1)."""

    def layout(self, d):
        off = d.expert_offsets.tolist()
        A = self.align
        parts, new_off = [], [0]
        for j in range(len(off) - 1):
            parts += [torch.full((A,), -1), torch.arange(off[j], off[j + 1])]
            new_off.append(new_off[-1] + A + off[j + 1] - off[j])
        parts.append(torch.arange(off[-1], d.expert_x.shape[0]))
        return torch.cat(parts).long(), torch.tensor(new_off, dtype=torch.int64)

    def dispatch(self, x, topk_idx, topk_weights, *, align=1, **kw):
        self.align = align
        return super().dispatch(x, topk_idx, topk_weights, align=align, **kw)


class Int32Metadata(PlainTorchDispatcher):
    """tokens_per_expert, expert_offsets and row_src as int32."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        return dataclasses.replace(d, tokens_per_expert=d.tokens_per_expert.int(),
                                   expert_offsets=d.expert_offsets.int(),
                                   row_src=d.row_src.int())


class GarbagePadding(PlainTorchDispatcher):
    """Padding rows of expert_x hold garbage (NaN, 1e30): declared ``padding=ignored``."""

    def dispatch(self, x, topk_idx, topk_weights, **kw):
        d = super().dispatch(x, topk_idx, topk_weights, **kw)
        pad = d.row_src[:, 0] < 0
        junk = torch.where(torch.arange(pad.shape[0]) % 2 == 0, float("nan"), 1e30)
        ex = torch.where(pad[:, None], junk[:, None].to(d.expert_x.dtype), d.expert_x)
        return dataclasses.replace(d, expert_x=ex)


class _OtherSum(PlainTorchDispatcher):
    """Combine's forward summed another way (``sum_rows``); gradients the baseline's."""

    def combine(self, expert_y, dispatched, *, weighted=True):
        right = super().combine(expert_y, dispatched, weighted=weighted)
        plan = dispatched.plan
        rows = plan.to_sources(expert_y.detach()[plan.dest])
        c = dispatched.topk_weights.detach()[plan.send_t, plan.send_k] if weighted else None
        out = right.clone()  # its gradient is the baseline's; its values this sum's
        with torch.no_grad():
            out.copy_(self.sum_rows(rows, c, plan).to(right.dtype))
        return out


class FlatFloat32Order(_OtherSum):
    """One flat float32 ``index_add`` in expert order (Megatron's unpermute)."""

    def sum_rows(self, rows, c, plan):
        rows = rows.float() * (c[:, None] if c is not None else 1.0)
        return torch.zeros((plan.T, plan.H)).index_add(0, plan.send_t, rows)


class Float64Sums(_OtherSum):
    """Every sum in float64, rounded once."""

    def sum_rows(self, rows, c, plan):
        rows = rows.double() * (c.double()[:, None] if c is not None else 1.0)
        return torch.zeros((plan.T, plan.H), dtype=torch.float64).index_add(0, plan.send_t, rows)


reversed_rows = ReversedRows
padding_inside_segments = PaddingInsideSegments
int32_metadata = Int32Metadata
garbage_padding = GarbagePadding
garbage_padding.capabilities = {"padding": "ignored"}
flat_float32_order = FlatFloat32Order
float64_sums = Float64Sums

# factory -> the property that must fail (bugs), and the capabilities the run declares
BUGS = {
    "truncates_tokens": "dispatch",
    "peer_buffer_128": "dispatch",
    "ignores_high_slots": "dispatch",
    "probs_nonzero": "dispatch",
    "merges_duplicates": "dispatch",
    "nan_to_num": "combine",
    "flushes_subnormals": "dispatch",
    "zero_rank_bfloat16": "combine",
    "titan_one_token_off": "combine",
    "titan_bfloat16_weight_grad": "weight_grad",
}
VALID = ("reversed_rows", "padding_inside_segments", "int32_metadata", "garbage_padding",
         "flat_float32_order", "float64_sums", "titan_native")


# -- refusals: a dispatcher that refuses several features, each by name ------------------------
class RefusesMany(Validating):
    """Refuses capacity, -1 slots, int32 ids and unweighted combines, each with a
    NotImplementedError naming it (as torchtitan's dispatcher does), on every rank alike."""

    def dispatch(self, x, topk_idx, topk_weights, *, num_experts, align=1, capacity=None):
        flag = torch.tensor([int((topk_idx < 0).any())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if capacity is not None:
            raise NotImplementedError("capacity (token dropping) is not supported")
        if int(flag):
            raise NotImplementedError("-1 (unused) slots are not supported")
        if topk_idx.dtype == torch.int32:
            raise NotImplementedError("int32 topk_idx is not supported")
        return super().dispatch(x, topk_idx, topk_weights, num_experts=num_experts,
                                align=align, capacity=capacity)

    def combine(self, expert_y, dispatched, *, weighted=True):
        if not weighted:
            raise NotImplementedError("unweighted combine is not supported")
        return super().combine(expert_y, dispatched, weighted=weighted)


refuses_many = RefusesMany
