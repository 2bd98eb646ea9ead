"""Equivalence cases: a DenseMoE and each rank's tokens, rebuilt from a seed on every process."""

from __future__ import annotations

import torch

import epkit.nn as enn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

BASE = dict(H=16, F=32, E=12, K=3, shared=False, dtype="float32", opts={}, tokens=(7, 0, 11, 4),
            batch=None, impl="auto", payload=None, router={}, aux=None)

# the router options of epkit.nn (expert_bias: a seeded non-zero bias, see build_dense)
DSV3 = dict(score="sigmoid", n_groups=4, topk_groups=2, expert_bias=True, route_scale=2.5)

# name -> (ranks, overrides); E = 12 divides every group size 1..4.
CASES = {
    "r1": (1, {}),
    "r2": (2, {}),
    "r3": (3, {}),
    "r4": (4, {}),
    "r2-shared": (2, dict(shared=True)),
    "r4-shared": (4, dict(shared=True)),
    "r3-pairs-align4": (3, dict(opts=dict(transport="pairs", align=4))),
    "r2-loop-padded": (2, dict(impl="loop", opts=dict(exchange="padded", align=3))),
    "r2-batched": (2, dict(batch=((2, 3), (1, 5)), shared=True)),
    "r4-topk1": (4, dict(K=1, E=8, tokens=(3, 6, 0, 5))),
    "r2-bf16": (2, dict(dtype="bfloat16")),
    "r2-mxfp8-shared": (2, dict(H=32, payload="mxfp8", shared=True)),
    "r3-mxfp8-bf16": (3, dict(H=32, payload="mxfp8", dtype="bfloat16")),
    "r2-fp8_block128-bf16": (2, dict(H=128, payload="fp8_block128", dtype="bfloat16")),
    "r2-lazy": (2, dict(opts=dict(exchange="lazy"))),             # asked for, no shared expert
    "r3-lazy-shared": (3, dict(shared=True, opts=dict(exchange="lazy", overlap=False))),
    "r3-capacity-factor": (3, dict(opts=dict(capacity_factor=12.0))),  # C >= every load: no drop
    "r2-sigmoid": (2, dict(router=dict(score="sigmoid"))),
    "r4-grouped": (4, dict(router=dict(n_groups=4, topk_groups=2))),
    "r3-bias": (3, dict(router=dict(expert_bias=True))),
    "r2-aux": (2, dict(aux=0.01)),
    "r4-dsv3-shared-aux": (4, dict(router=DSV3, aux=0.001, shared=True)),
    "r3-bf16-aux-grouped": (3, dict(dtype="bfloat16", router=dict(n_groups=3, topk_groups=1), aux=0.1)),
}
ROUTER_CASES = [n for n in CASES if CASES[n][1].get("router") or CASES[n][1].get("aux")]


def case(name):
    R, over = CASES[name]
    return R, {**BASE, **over, "name": name}


def build_dense(c, seed=0):
    torch.manual_seed(seed)
    dense = enn.DenseMoE(c["H"], c["F"], c["E"], c["K"], shared_expert=c["shared"],
                         impl=c["impl"], payload=c["payload"], dtype=DTYPES[c["dtype"]],
                         aux_loss_coef=c["aux"], **c["router"])
    if dense.router.expert_bias is not None:  # large enough to change the selection
        dense.router.expert_bias.copy_(torch.randn(c["E"]) * 0.2)
    return dense


def inputs(c, R, seed=1):
    """Per-rank ``(x, grad_out)``: x shaped ``[T_r, H]`` or ``[B, S, H]``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, s) for b, s in c["batch"]] if c["batch"] else [(t,) for t in c["tokens"]]
    out = []
    for r in range(R):
        shape = shapes[r % len(shapes)] + (c["H"],)
        x = torch.randn(shape, generator=g).to(DTYPES[c["dtype"]])
        out.append((x, torch.randn(shape, generator=g).to(DTYPES[c["dtype"]])))
    return out


def run(module, x, grad_out):
    """Forward and backward (of ``<out, grad_out> + aux loss`` when the layer returns one);
    ``(out, grad_x, {param name: grad}, aux loss or None)``."""
    x = x.clone().requires_grad_(True)
    out, aux = module(x), None
    if isinstance(out, tuple):
        out, aux = out
        torch.autograd.backward([out, aux], [grad_out, torch.ones_like(aux)])
    else:
        out.backward(grad_out)
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), x.grad, grads, None if aux is None else aux.detach()


def rank_run(group, rank, name):
    """On each rank of the group: shard the seed's DenseMoE, run this rank's tokens."""
    R, c = case(name)
    ep = enn.ExpertParallelMoE.from_dense(build_dense(c), group, **c["opts"])
    x, g = inputs(c, R)[rank]
    out, gx, grads, aux = run(ep, x, g)
    enn.sync_replicated_grads(ep, group)
    synced = {n: p.grad.clone() for n, p in ep.named_parameters()}
    backend = enn.grouped_mm_backend(x.reshape(-1, c["H"]), ep.experts.w1.transpose(1, 2), c["impl"])
    return dict(out=out, grad_x=gx, grads=grads, synced=synced, backend=backend, aux=aux,
                router=ep.router.options(), bias=ep.router.expert_bias,
                lazy=ep.lazy_dispatcher is not None, params={n: p.detach() for n, p in ep.named_parameters()},
                first_expert=ep.first_expert)


def rank_bad_split(group, rank):
    """E = 4 experts over a group of 3: ExpertParallelMoE must refuse."""
    try:
        enn.ExpertParallelMoE(8, 16, 4, 2, group=group)
    except ValueError as exc:
        return str(exc)
    return None


def rank_compile(group, rank, name, backend="aot_eager"):
    """The case with the static exchange, eager and under ``torch.compile(fullgraph=True)``."""
    import torch._dynamo

    R, c = case(name)
    ins = inputs(c, R)
    max_tokens = max(x.reshape(-1, c["H"]).shape[0] for x, _ in ins)
    ep = enn.ExpertParallelMoE.from_dense(build_dense(c), group, exchange="static",
                                          max_tokens_per_rank=max_tokens, **c["opts"])
    x, g = ins[rank]
    eager = run(ep, x, g)
    ep.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = run(torch.compile(ep, fullgraph=True, backend=backend), x, g)
    return dict(eager=eager, compiled=compiled)
