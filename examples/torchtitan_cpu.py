"""torchtitan's real MoE with epkit's token dispatcher, on CPU, outside torchtitan's trainer.

    .venv/bin/torchrun --nproc-per-node 2 examples/torchtitan_cpu.py

Two gloo ranks, expert-parallel size 2. Each rank builds torchtitan's ``MoE`` (router,
``RoutedExperts``, ``GroupedExperts``) twice from the same config and weights: one keeps
torchtitan's ``AllToAllTokenDispatcher``, the other gets epkit's
(``epkit.integrations.torchtitan.swap_token_dispatcher``, the one line a torchtitan user writes,
before the model is built). Both run the same tokens forward and backward (float32): the output
and the experts' gradients must be bit for bit equal; the router's gradient and the input's
agree to float32 rounding (the scores' gradient is a dot product over the hidden size, which
autograd sums in float32 and epkit in float64, rounded once: docs/migrating.md). Each rank
prints one line; the exit status is 0 when all agree. Tested with torchtitan 0.3.0
(tests/integrations/test_examples.py).

Outside its trainer torchtitan needs two steps that its trainer otherwise takes
(:func:`outside_the_trainer`; docs/migrating.md, "torchtitan outside its trainer").
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=UserWarning)  # CPU autocast's float32 notice

E, K, H, F, T = 4, 2, 16, 24, 12  # experts, top-k, hidden, expert FFN hidden, tokens a rank
EXPERTS = ("routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w2_EDF",
           "routed_experts.inner_experts.w3_EFD")


def outside_the_trainer(group):
    """What the trainer would have done: the SPMD backend, and the expert-parallel mesh."""
    import torchtitan.distributed.utils as titan_dist
    from torch.distributed.device_mesh import DeviceMesh

    # 1. The default SPMD backend ("spmd_types") sends torchtitan's own all-to-all through the
    #    trainer's registered mesh, which a layer built outside the trainer does not have (and
    #    whose uneven all-to-all gloo does not run). "partial_dtensor", one of torchtitan's own
    #    settings (parallelism.spmd_backend), takes the functional all_to_all_single over the
    #    wired mesh. Only torchtitan's dispatcher needs it: epkit exchanges over the group.
    titan_dist.set_spmd_backend("partial_dtensor")
    # 2. The expert-parallel mesh, which the trainer builds from its parallel dims; every
    #    dispatcher gets it from wire_meshes (below).
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ep",))


def build_moe(seed, epkit_options=None, *, E=E, K=K, H=H, F=F, L=None):
    """torchtitan's MoE config, built. ``GroupedExperts`` holds this rank's ``L = E / R``
    experts: what torchtitan's expert-parallel sharding leaves each rank."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                              TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    routed = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=H, hidden_dim=F,
                                            num_experts=L or E // dist.get_world_size()),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=K))
    if epkit_options is not None:
        import epkit.integrations.torchtitan

        epkit.integrations.torchtitan.swap_token_dispatcher(routed, **epkit_options)  # the line
    config = MoE.Config(num_experts=E, load_balance_coeff=None, routed_experts=routed,
                        router=TokenChoiceTopKRouter.Config(
                            num_experts=E, top_k=K, score_func="softmax",
                            gate=Linear.Config(in_features=H, out_features=E)))
    layer = config.build()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer


def step(layer, x):
    """One forward and backward: the output, x's gradient and every parameter's gradient."""
    x = x.clone().requires_grad_(True)
    out = layer(x)
    torch.manual_seed(7)
    out.backward(torch.randn_like(out))  # a gradient that differs per element
    return {"output": out.detach(), "grad x": x.grad,
            **{n: p.grad for n, p in layer.named_parameters()}}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = outside_the_trainer(dist.group.WORLD)
    titans = build_moe(seed=100 + rank)
    epkits = build_moe(seed=100 + rank, epkit_options={})           # the same weights
    for layer in (titans, epkits):
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)  # RoutedExperts.parallelize's step
    torch.manual_seed(1000 + rank)
    x = torch.randn(1, T, H)
    want, got = step(titans, x), step(epkits, x)
    exact = ["output", *EXPERTS]
    differ = [n for n in exact if not torch.equal(want[n], got[n])]
    near = max(float((want[n] - got[n]).abs().max() / want[n].abs().max().clamp_min(1e-30))
               for n in ("grad x", "router.gate.weight"))
    differ += ["router / input gradients"] if near > 1e-6 else []
    print(f"rank {rank}: output and expert gradients "
          + ("bit for bit equal" if not set(exact) & set(differ) else "DIFFER")
          + f" to torchtitan's dispatcher; router and input gradients within {near:.1e} of its "
          "largest", flush=True)
    del titans, epkits, mesh
    dist.barrier()
    dist.destroy_process_group()
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
