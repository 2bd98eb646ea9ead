"""Megatron-Core's real MoELayer with epkit's token dispatcher, on CPU, outside Megatron's trainer.

    .venv/bin/torchrun --nproc-per-node 2 examples/megatron_cpu.py

Two gloo ranks, expert-parallel size 2. Each rank builds Megatron's ``MoELayer`` twice from the
same seed: one keeps Megatron's own all-to-all dispatcher, the other gets epkit's
(``epkit.integrations.megatron.install``, the one line a Megatron user writes). Both run the
same tokens forward and backward; the output, the input gradient and every parameter gradient
must be bit for bit equal (float32). Each rank prints one line; the exit status is 0 when all
agree. Tested with megatron-core 0.19.2 and 0.16.1 (tests/integrations/test_examples.py).

Megatron is written for GPUs. Outside its trainer, on a machine without CUDA, it needs the
patches in :func:`cpu_patches` (docs/migrating.md, "Megatron-Core on CPU", says why each).
None of them changes what runs on a GPU.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=UserWarning)  # "Transformer Engine / Apex not installed"

E, K, H, F, T = 4, 2, 16, 24, 12  # experts, top-k, hidden, expert FFN hidden, tokens a rank


def cpu_patches():
    """What Megatron's MoE layer needs to run on CPU (each line: what Megatron does, and why the
    patch is harmless). Only for a machine without CUDA."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as td

    # 1. The router moves its weight to torch.cuda.current_device() on every forward, and the
    #    all-to-all allocates its output there; "cpu" is a device string both accept.
    torch.cuda.current_device = lambda: "cpu"
    # 2. Megatron's all-to-all dispatcher makes a CUDA stream (for its device-to-host copies of
    #    the split sizes) when it is built: needed even though epkit replaces that dispatcher,
    #    because the layer builds it first. No stream: the copies below need none.
    td.torch.cuda.Stream = lambda *a, **k: None
    # 3. Without Transformer Engine, some releases (0.16.1) never define te_general_gemm, which
    #    the router's gating linear tests for None (a NameError otherwise).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # 4. Only for comparing with Megatron's own dispatcher: its device-to-host copy of the split
    #    sizes runs on that CUDA stream. On CPU the sizes are host tensors already, and the
    #    all-to-all takes them as host sequences, as the copy makes them.
    def host_split_sizes(self, point, tokens_per_expert=None):
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
        return tokens_per_expert

    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_split_sizes


def process_groups(ep_group):
    """Megatron's groups for expert parallelism alone: the expert group (and the groups that
    contain it) is ``ep_group``; every other parallelism is this rank alone."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    import epkit

    one = epkit.group_of_one()  # collective: every rank calls it, together
    pgc = ProcessGroupCollection()
    for name in ("ep", "tp_ep", "dp", "dp_cp", "tp_dp_cp"):
        setattr(pgc, name, ep_group)
    for name in ("tp", "expt_tp", "expt_dp", "cp", "tp_cp", "pp"):
        setattr(pgc, name, one)
    return pgc


def build_moe_layer(pgc, seed):
    """Megatron's MoELayer (local linear layers, no Transformer Engine), weights from ``seed``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=F, moe_ffn_hidden_size=F,
        num_attention_heads=1, num_moe_experts=E, moe_router_topk=K,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
        add_bias_linear=False, moe_router_load_balancing_type="none",
        expert_model_parallel_size=dist.get_world_size(pgc.ep))
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(seed)
    if hasattr(spec, "module"):  # 0.16: a ModuleSpec
        return build_module(spec, config=config, pg_collection=pgc)
    return spec(config=config, pg_collection=pgc)  # 0.19: a builder (functools.partial(MoELayer))


def step(layer, x):
    """One forward and backward: the output, x's gradient and every parameter's gradient."""
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    torch.manual_seed(7)
    out.backward(torch.randn_like(out))  # a gradient that differs per element
    return [("output", out.detach()), ("grad x", x.grad)] + [
        (f"grad {n}", p.grad) for n, p in layer.named_parameters()]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if not torch.cuda.is_available():
        cpu_patches()
    import megatron.core

    import epkit.integrations.megatron

    pgc = process_groups(dist.group.WORLD)
    megatrons = build_moe_layer(pgc, seed=100 + rank)
    epkits = build_moe_layer(pgc, seed=100 + rank)                 # the same weights
    epkit.integrations.megatron.install(epkits)                    # the one line
    torch.manual_seed(1000 + rank)
    x = torch.randn(T, 1, H)                                       # [sequence, batch, hidden]
    want, got = step(megatrons, x), step(epkits, x)
    differ = [name for (name, a), (_, b) in zip(want, got) if not torch.equal(a, b)]
    print(f"rank {rank}: megatron-core {megatron.core.__version__.split('+')[0]}, "
          f"{len(want)} tensors compared with Megatron's own dispatcher: "
          + ("all bit for bit equal" if not differ else f"DIFFER: {', '.join(differ)}"),
          flush=True)
    del megatrons, epkits, pgc
    dist.barrier()
    dist.destroy_process_group()
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
