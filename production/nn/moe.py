"""MoE layers: the single-process :class:`DenseMoE` and the expert-parallel
:class:`ExpertParallelMoE` that equals it.

Both layers share every piece but the token movement: the same router (linear, softmax or
sigmoid scores in float32, optionally biased and group-limited top-k, weights renormalised over
the top-k; :class:`Router`), the same optional load-balancing loss, the same SwiGLU experts run as one grouped
matmul over expert-major segments, the same float32 weighted sum over ``k`` ascending. Dense
sorts its own tokens by expert; expert-parallel lets ``epkit.dispatch`` do it across the group,
which yields, for every expert, the same rows in the same order (source rank, then token: the
order of the concatenated tokens). What differs is only the order of some float32 sums: see
:class:`ExpertParallelMoE`.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .grouped import grouped_mm

__all__ = [
    "Router", "SwiGLU", "SwiGLUExperts", "DenseMoE", "ExpertParallelMoE", "to_expert_parallel",
    "expert_parameters", "replicated_parameters", "sync_replicated_grads", "weighted_sum",
    "load_balancing_loss",
]


def _uniform_(t: torch.Tensor, fan_in: int) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        return t.uniform_(-bound, bound)


class Router(nn.Module):
    """Top-k router: ``weight [E, H]``; returns ``(topk_idx [T, K] int64,
    topk_weights [T, K] float32)``, the weights renormalised to sum to 1 over the top-k.

    Logits, scores and weights are float32 whatever x's dtype (epkit wants float32 weights).
    With ``logits = x @ weight.T`` (float32):

    - ``score="softmax"`` (default): ``s = softmax(logits)``; ``"sigmoid"``: ``s = sigmoid(logits)``
      (DeepSeek-V3), each expert scored on its own.
    - ``expert_bias=True``: a float32 buffer ``expert_bias [E]`` (zeros; not a parameter, no
      gradient) added for the *selection only*: experts are chosen by ``s + b``, weighted by
      ``s`` (auxiliary-loss-free balancing; :meth:`update_expert_bias` applies DeepSeek-V3's
      update).
    - ``n_groups=G, topk_groups=M`` (group-limited top-k, DeepSeek-V3's node-limited routing):
      the ``E`` experts form ``G`` consecutive groups of ``E / G``; a group's score is the sum of
      its top ``min(2, E / G)`` selection scores; the token picks its ``M`` best groups and its
      ``K`` experts among theirs only (``K <= M * E / G``). ``topk_groups=None``: no limit.
    - ``topk_idx`` = the ``K`` largest selection scores (descending), ``topk_weights[t, k] =
      s[t, idx] / sum_k s[t, idx] * route_scale`` (``route_scale`` 1 by default; DeepSeek-V3
      uses 2.5).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, device=None, dtype=None, *,
                 score: str = "softmax", n_groups: int = 1, topk_groups: Optional[int] = None,
                 expert_bias: bool = False, route_scale: float = 1.0):
        super().__init__()
        E = num_experts
        if not 1 <= top_k <= E:
            raise ValueError(f"epkit.nn: top_k must be in [1, {E}], got {top_k}")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"epkit.nn: score must be 'softmax' or 'sigmoid', got {score!r}")
        if n_groups < 1 or E % n_groups:
            raise ValueError(f"epkit.nn: n_groups must divide num_experts {E}, got {n_groups}")
        topk_groups = n_groups if topk_groups is None else topk_groups
        if not 1 <= topk_groups <= n_groups:
            raise ValueError(f"epkit.nn: topk_groups must be in [1, {n_groups}], got {topk_groups}")
        if top_k > topk_groups * (E // n_groups):
            raise ValueError(f"epkit.nn: top_k {top_k} exceeds the {topk_groups * (E // n_groups)} "
                             f"experts of topk_groups={topk_groups} groups of {E // n_groups}")
        self.top_k, self.num_experts = top_k, E
        self.score, self.n_groups, self.topk_groups = score, n_groups, topk_groups
        self.route_scale = float(route_scale)
        self.weight = nn.Parameter(torch.empty(E, hidden, device=device, dtype=dtype))
        _uniform_(self.weight, hidden)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    def options(self) -> dict:
        """The keyword arguments that rebuild this router's routing rule."""
        return dict(score=self.score, n_groups=self.n_groups, topk_groups=self.topk_groups,
                    expert_bias=self.expert_bias is not None, route_scale=self.route_scale)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(topk_idx, topk_weights, probs)``: ``probs [T, E]`` float32 the scores normalised to
        sum to 1 per token (the softmax itself; ``s / sum_e s`` for sigmoid), what
        :func:`load_balancing_loss` averages."""
        logits = F.linear(x.float(), self.weight.float())
        s = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        choice = s if self.expert_bias is None else s + self.expert_bias
        if self.topk_groups < self.n_groups:
            G, per = self.n_groups, self.num_experts // self.n_groups
            grouped = choice.view(-1, G, per)
            group_score = grouped.topk(min(2, per), dim=-1).values.sum(dim=-1)       # [T, G]
            keep = group_score.topk(self.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
        if choice is s:
            weights, idx = s.topk(self.top_k, dim=-1)
        else:
            idx = choice.topk(self.top_k, dim=-1).indices
            weights = s.gather(1, idx)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        probs = s if self.score == "softmax" else s / s.sum(dim=-1, keepdim=True)
        return idx, weights, probs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx, weights, _ = self.route(x)
        return idx, weights

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3's auxiliary-loss-free update: ``b_e += rate * sign(mean - load_e)``
        (overloaded experts lose bias, underloaded ones gain). ``tokens_per_expert [E]``: the
        load over the whole batch; with an expert-parallel layer sum it over the group first
        (``dist.all_reduce``), so every replica of the router takes the same step."""
        if self.expert_bias is None:
            raise ValueError("epkit.nn: update_expert_bias needs a router built with expert_bias=True")
        load = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias += rate * torch.sign(load.mean() - load)


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                        coef: float = 1.0, group=None) -> torch.Tensor:
    """The load-balancing loss ``coef * E * sum_e f_e * P_e`` (Switch Transformer's; DeepSeek-V3's
    balance loss over the batch instead of a sequence), with ``f_e = c_e / (T * K)`` the share of
    the slots routed to expert ``e`` (``c_e`` their count, no gradient) and ``P_e = (1/T) sum_t
    probs[t, e]``, ``T`` the tokens and ``K`` the slots per token. Its minimum, ``coef``, is
    perfectly uniform routing.

    ``group``: the tokens are spread over the group; ``c_e`` and ``T`` are then the group's (one
    all-reduce of ``E`` counts) and the value returned is this rank's share, ``coef * E * sum_e
    f_e * (sum over this rank's t of probs[t, e]) / T``: summed over the ranks it is the loss of
    all the tokens, and so is its gradient once the router's gradients are summed
    (:func:`sync_replicated_grads`)."""
    E, K = num_experts, topk_idx.shape[-1]
    counts = torch.bincount(topk_idx.reshape(-1), minlength=E)
    if group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    slots = counts.sum().to(torch.float32).clamp(min=1.0)  # no slot at all: the loss is 0
    f = counts.to(torch.float32) / slots
    return (coef * E) * (f * probs.sum(dim=0)).sum() / (slots / K)


class SwiGLU(nn.Module):
    """One SwiGLU MLP (the shared expert): ``w2 @ (silu(w1 @ x) * (w3 @ x))`` with
    ``w1 [F, H]``, ``w3 [F, H]``, ``w2 [H, F]``."""

    def __init__(self, hidden: int, ffn_hidden: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(_uniform_(torch.empty(ffn_hidden, hidden, **kw), hidden))
        self.w3 = nn.Parameter(_uniform_(torch.empty(ffn_hidden, hidden, **kw), hidden))
        self.w2 = nn.Parameter(_uniform_(torch.empty(hidden, ffn_hidden, **kw), ffn_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class SwiGLUExperts(nn.Module):
    """``num`` SwiGLU experts applied to expert-major rows with a grouped matmul.

    Parameters ``w1 [n, F, H]``, ``w3 [n, F, H]``, ``w2 [n, H, F]`` (``n = E`` in the dense
    layer, ``L`` local experts in the expert-parallel one). ``forward(x [M, H], offsets [n+1])``
    applies expert ``g`` to rows ``offsets[g]:offsets[g+1]``.
    """

    def __init__(self, num: int, hidden: int, ffn_hidden: int, impl: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.impl = impl
        self.w1 = nn.Parameter(_uniform_(torch.empty(num, ffn_hidden, hidden, **kw), hidden))
        self.w3 = nn.Parameter(_uniform_(torch.empty(num, ffn_hidden, hidden, **kw), hidden))
        self.w2 = nn.Parameter(_uniform_(torch.empty(num, hidden, ffn_hidden, **kw), ffn_hidden))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gmm = lambda a, w: grouped_mm(a, w.transpose(1, 2), offsets, self.impl)  # noqa: E731
        return gmm(F.silu(gmm(x, self.w1)) * gmm(x, self.w3), self.w2)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``sum_k weights[:, k] * y[:, k]`` for ``y [T, K, H]``: y widened to float32, one rounded
    float32 multiply and add per term, ``k`` ascending from ``+0.0`` (epkit.combine's arithmetic
    on one rank), cast to ``out_dtype``."""
    out = y.new_zeros((y.shape[0], y.shape[2]), dtype=torch.float32)
    for k in range(y.shape[1]):
        out = out + weights[:, k : k + 1] * y[:, k].float()
    return out.to(out_dtype)


ROUTER_DEFAULTS = dict(score="softmax", n_groups=1, topk_groups=None, expert_bias=False,
                       route_scale=1.0)


class _MoEBase(nn.Module):
    def __init__(self, hidden, ffn_hidden, num_experts, top_k, shared_expert, local_experts,
                 impl, payload, device, dtype, router_options, aux_loss_coef):
        super().__init__()
        from .. import payloads

        if payload is not None and payload not in payloads.NAMES:
            raise ValueError(f"epkit.nn: payload must be None or one of {payloads.NAMES}, got "
                             f"{payload!r}")
        block = payloads.TABLE[payload].block
        if block and hidden % block:
            raise ValueError(f"epkit.nn: payload {payload} needs hidden % {block} == 0, got "
                             f"{hidden}")
        self.payload = payload
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.num_experts, self.top_k = num_experts, top_k
        kw = dict(device=device, dtype=dtype)
        self.router = Router(hidden, num_experts, top_k, **kw, **router_options)
        self.aux_loss_coef = None if aux_loss_coef is None else float(aux_loss_coef)
        self.experts = SwiGLUExperts(local_experts, hidden, ffn_hidden, impl, **kw)
        self.shared_expert = SwiGLU(hidden, ffn_hidden, **kw) if shared_expert else None

    def extra_repr(self) -> str:
        opts = {k: v for k, v in self.router.options().items() if v != ROUTER_DEFAULTS[k]}
        if opts.get("topk_groups") == self.router.n_groups:
            opts.pop("topk_groups")
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}"
                + (f", payload={self.payload}" if self.payload else "")
                + "".join(f", {k}={v}" for k, v in opts.items())
                + (f", aux_loss_coef={self.aux_loss_coef}" if self.aux_loss_coef is not None else ""))

    def _moe(self, x2: torch.Tensor, topk_idx, topk_weights) -> torch.Tensor:
        raise NotImplementedError

    def _aux_group(self):
        return None

    def forward(self, x: torch.Tensor):
        """``x [..., H]`` -> ``[..., H]``: routed experts (plus the shared expert); with
        ``aux_loss_coef`` set, ``(output, load-balancing loss)`` (a float32 scalar,
        :func:`load_balancing_loss`)."""
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        topk_idx, topk_weights, probs = self.router.route(x2)
        if self.router.expert_bias is not None:  # this rank's tokens' load, for the bias update
            self.expert_load = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
        out = self._moe(x2, topk_idx, topk_weights).reshape(shape)
        if self.aux_loss_coef is None:
            return out
        return out, load_balancing_loss(probs, topk_idx, self.num_experts, self.aux_loss_coef,
                                        self._aux_group())


class DenseMoE(_MoEBase):
    """A single-process MoE layer: the reference :class:`ExpertParallelMoE` is held to.

    Args:
        hidden: ``H``. ffn_hidden: ``F``, every expert's (and the shared expert's) inner size.
        num_experts: ``E``. top_k: ``K`` experts per token.
        shared_expert: add one SwiGLU every token goes through (``shared_expert.w1/w3/w2``).
        impl: grouped matmul, ``"auto"`` / ``"torch"`` (``torch._grouped_mm``) / ``"loop"``.
        payload: ``"mxfp8"`` or ``"fp8_block128"``: the experts see their input rounded through
            the payload (quantized and dequantized, e.g. ``epkit.quantize_mxfp8``), the
            gradient passing straight through, as the expert-parallel layer's dispatch with
            that payload delivers it; ``H`` a multiple of its block (32, 128).
        router options (keyword only; :class:`Router` has the formulas): ``score``
            (``"softmax"`` or ``"sigmoid"``), ``n_groups`` / ``topk_groups`` (group-limited
            top-k), ``expert_bias`` (a buffer added to the scores for selection only; the layer
            keeps its tokens' ``expert_load [E]`` after each forward), ``route_scale``.
        aux_loss_coef: ``None`` (default): ``forward`` returns the output alone; a float
            ``alpha``: ``forward`` returns ``(output, loss)``, ``loss = alpha * E * sum_e f_e *
            P_e`` (:func:`load_balancing_loss`); add it to the training loss.

    Parameters: ``router.weight [E, H]``; ``experts.w1 [E, F, H]``, ``experts.w3 [E, F, H]``,
    ``experts.w2 [E, H, F]``.

    ``forward(x [..., H])``: route every token to its top-k experts, sort the ``T*K`` slots by
    expert (stable: tokens ascending within an expert), run the experts as one grouped matmul,
    and sum each token's expert outputs weighted, ``k`` ascending, in float32.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int,
                 shared_expert: bool = False, impl: str = "auto", payload: Optional[str] = None,
                 device=None, dtype=None, *, score: str = "softmax", n_groups: int = 1,
                 topk_groups: Optional[int] = None, expert_bias: bool = False,
                 route_scale: float = 1.0, aux_loss_coef: Optional[float] = None):
        router = dict(score=score, n_groups=n_groups, topk_groups=topk_groups,
                      expert_bias=expert_bias, route_scale=route_scale)
        super().__init__(hidden, ffn_hidden, num_experts, top_k, shared_expert, num_experts,
                         impl, payload, device, dtype, router, aux_loss_coef)

    def _round_trip(self, x2: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H] float32 rounded through the payload, gradient straight through."""
        from .. import payloads

        return payloads.round_trip(payloads.TABLE[self.payload], x2)

    def _moe(self, x2: torch.Tensor, topk_idx, topk_weights) -> torch.Tensor:
        T, K = x2.shape[0], self.top_k
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slot t*K+k; by expert, then token
        counts = torch.bincount(flat, minlength=self.num_experts)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        xe = x2 if self.payload is None else self._round_trip(x2).to(self.experts.w1.dtype)
        y_sorted = self.experts(xe[order // K], offsets)
        y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted).view(T, K, self.hidden)
        out = weighted_sum(y, topk_weights, x2.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        return out


class ExpertParallelMoE(_MoEBase):
    """The expert-parallel twin of :class:`DenseMoE`: this rank holds experts
    ``rank*L .. rank*L+L-1`` of ``E`` (``L = E / group size``), the router (and shared expert)
    replicated.

    Build it with :meth:`from_dense` (or directly, with the same arguments as DenseMoE plus the
    group; then seed every rank alike so the replicated parameters agree). ``forward`` routes
    this rank's tokens, ``epkit.dispatch``-es them, runs the local experts as a grouped matmul
    over the expert-major rows and ``epkit.combine``-s the results. With a shared expert, its
    computation runs between issuing the exchange and waiting for it (``exchange="lazy"``).

    Parameters: the DenseMoE names, ``experts.*`` with leading dimension ``L``.

    Equivalence with DenseMoE on the concatenation of every rank's tokens (no capacity; a
    capacity drops slots the dense layer keeps):

    - expert rows, their order, and so the grouped matmul, are the dense layer's, and the
      combine's float32 arithmetic is DenseMoE's; only the order of sums differs: combine adds
      per-rank partial sums (``(w0*y0 + w2*y2) + w1*y1`` when experts 0, 2 share a rank), the
      input gradient adds a token's slot gradients the same two-level way, and the weight
      gradient's dot products over ``H`` are free in order;
    - gradients of replicated parameters (router, shared expert) are this rank's tokens' part:
      their sum over the group is the dense gradient (:func:`sync_replicated_grads`, or DDP);
      expert gradients are complete on their rank (the combine's backward brings every rank's
      contribution).

    Router options and ``aux_loss_coef`` are DenseMoE's (:meth:`from_dense` copies them and the
    ``expert_bias`` buffer). The load-balancing loss counts the whole group's slots (one
    all-reduce of ``E`` counts per forward) and each rank returns its share: summed over the
    ranks it is DenseMoE's loss on all the tokens, and with :func:`sync_replicated_grads` so is
    its router gradient. ``expert_load`` is this rank's tokens' load: all-reduce it before
    :meth:`Router.update_expert_bias`, so every replica takes the same step.

    Args (beyond DenseMoE's): group: the expert-parallel process group (default: WORLD);
    align, capacity, capacity_factor, transport, exchange, max_tokens_per_rank, ranks_per_node:
    passed to :class:`epkit.Dispatcher`; overlap: with a shared expert and ``exchange="auto"``,
    issue the exchanges lazily and run the shared expert while the tokens travel (not with
    ``transport="hier"``, which has no lazy schedule); ``exchange="lazy"`` takes that path
    always (the lazy path is eager-only: under ``torch.compile`` use ``exchange="static"``).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int,
                 shared_expert: bool = False, group=None, *, align: int = 1,
                 capacity: Optional[int] = None, transport: str = "dedup", exchange: str = "auto",
                 max_tokens_per_rank: Optional[int] = None, overlap: bool = True,
                 impl: str = "auto", payload: Optional[str] = None, device=None, dtype=None,
                 score: str = "softmax", n_groups: int = 1, topk_groups: Optional[int] = None,
                 expert_bias: bool = False, route_scale: float = 1.0,
                 aux_loss_coef: Optional[float] = None, capacity_factor: Optional[float] = None,
                 ranks_per_node: Optional[int] = None):
        import epkit
        from ..collectives import resolve_group

        group = resolve_group(group)
        R, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % R:
            raise ValueError(f"epkit.nn: num_experts {num_experts} is not a multiple of the group size {R}")
        router = dict(score=score, n_groups=n_groups, topk_groups=topk_groups,
                      expert_bias=expert_bias, route_scale=route_scale)
        super().__init__(hidden, ffn_hidden, num_experts, top_k, shared_expert, num_experts // R,
                         impl, payload, device, dtype, router, aux_loss_coef)
        self.group, self.rank, self.world_size = group, rank, R  # group: held weakly (below)
        self.local_experts = num_experts // R
        self.first_expert = rank * self.local_experts
        self.dispatch_options = epkit.DispatchOptions(
            transport=transport, exchange=exchange, payload=payload, align=align,
            capacity=capacity, capacity_factor=capacity_factor,
            max_tokens_per_rank=max_tokens_per_rank, ranks_per_node=ranks_per_node)
        self.overlap = overlap
        self.dispatcher = epkit.Dispatcher.from_options(group, num_experts, self.dispatch_options)
        self.lazy_dispatcher = None  # the issue / wait path: asked for, or the shared overlap
        from epkit import collectives, transports

        # The issue / wait path: asked for, or the option's lazy twin (auto's: lazy) when the
        # shared expert overlaps and the transport has that schedule. (A bad name finds no row:
        # the Dispatcher reports it, on every rank, at dispatch.)
        ex = collectives.exchange_of(self.dispatcher.exchange)  # None: the default, resolved
        tr = transports.of(self.dispatcher.transport)
        lazy = None if ex is None else ex.name if ex.deferred else ex.lazy_twin
        if lazy and (ex.deferred or (overlap and shared_expert and tr is not None
                                     and tr.runs(lazy))):
            self.lazy_dispatcher = epkit.Dispatcher.from_options(
                group, num_experts, self.dispatch_options.replace(exchange=lazy))

    @property
    def group(self):
        """The expert-parallel process group, held weakly (epkit.collectives.group_ref): the
        layer never keeps a group alive past ``destroy_process_group()``."""
        group = self.__dict__["_group_ref"]()
        if group is None:
            from ..collectives import destroyed

            raise destroyed("this ExpertParallelMoE")
        return group

    @group.setter
    def group(self, group) -> None:
        from ..collectives import group_ref

        self.__dict__["_group_ref"] = group_ref(group)

    @classmethod
    def from_dense(cls, dense: DenseMoE, group=None, **options) -> "ExpertParallelMoE":
        """This rank's shard of ``dense``: its ``L`` experts (copied), the router and shared
        expert (copied). ``options``: the keyword arguments of :class:`ExpertParallelMoE`."""
        p = dense.router.weight
        options.setdefault("impl", dense.experts.impl)
        options.setdefault("payload", dense.payload)
        options.setdefault("aux_loss_coef", dense.aux_loss_coef)
        for key, value in dense.router.options().items():
            options.setdefault(key, value)
        ep = cls(dense.hidden, dense.ffn_hidden, dense.num_experts, dense.top_k,
                 dense.shared_expert is not None, group, device=p.device, dtype=p.dtype, **options)
        lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
        with torch.no_grad():
            ep.router.load_state_dict(dense.router.state_dict())  # weight (and expert_bias)
            for name in ("w1", "w3", "w2"):
                getattr(ep.experts, name).copy_(getattr(dense.experts, name)[lo:hi])
            if ep.shared_expert is not None:
                ep.shared_expert.load_state_dict(dense.shared_expert.state_dict())
        return ep

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", ranks={self.world_size}, rank={self.rank}, "
                f"local_experts={self.local_experts}")

    def _experts(self, d) -> torch.Tensor:
        # A quantized payload: expert_x is E4M3; expert_x_hp its dequantized float32 rows,
        # differentiable
        x = d.expert_x if d.expert_x_hp is None else d.expert_x_hp.to(self.experts.w1.dtype)
        return self.experts(x, d.expert_offsets)

    def _aux_group(self):
        return self.group

    def _moe(self, x2: torch.Tensor, topk_idx, topk_weights) -> torch.Tensor:
        lazy = self.lazy_dispatcher
        if lazy is not None:
            pending = lazy.dispatch(x2, topk_idx, topk_weights)
            shared = None if self.shared_expert is None else self.shared_expert(x2)  # overlaps
            d = pending.wait()
            out = lazy.combine(self._experts(d), d).wait()
            return out if shared is None else out + shared
        d = self.dispatcher.dispatch(x2, topk_idx, topk_weights)
        out = self.dispatcher.combine(self._experts(d), d)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        return out


def to_expert_parallel(model: nn.Module, group=None, **options) -> nn.Module:
    """Replace every :class:`DenseMoE` inside ``model`` (or ``model`` itself) by its
    :meth:`ExpertParallelMoE.from_dense` shard; returns the model."""
    if isinstance(model, DenseMoE):
        return ExpertParallelMoE.from_dense(model, group, **options)
    for name, child in model.named_children():
        setattr(model, name, to_expert_parallel(child, group, **options))
    return model


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters of every ExpertParallelMoE's local experts: sharded, not replicated."""
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            yield from m.experts.parameters()


def named_expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """:func:`expert_parameters` with their qualified names in ``model`` (``"moe.experts.w1"``),
    as ``model.named_parameters()`` gives them: the names DDP's
    ``_set_params_and_buffers_to_ignore_for_model`` takes."""
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for name, p in m.experts.named_parameters():
                yield f"{prefix}.experts.{name}" if prefix else f"experts.{name}", p


def replicated_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every other parameter: the same on every rank of the expert-parallel group."""
    sharded = {id(p) for p in expert_parameters(model)}
    return (p for p in model.parameters() if id(p) not in sharded)


def sync_replicated_grads(model: nn.Module, group=None, average: bool = False) -> None:
    """All-reduce (sum, or mean with ``average``) the gradients of the replicated parameters
    over ``group``; expert gradients stay as they are (already complete on their rank).

    With each rank's loss scaled to its share of the global loss (say, its token sum divided by
    the global token count), the summed gradients equal the dense model's on all the tokens.
    """
    params = [p for p in replicated_parameters(model) if p.requires_grad]
    for p in params:  # every rank must contribute the same tensors, used or not
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if average:
        flat /= dist.get_world_size(group)
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(part.view_as(g))
