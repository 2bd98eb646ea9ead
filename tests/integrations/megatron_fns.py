"""Rank functions: Megatron-Core's real ``MoELayer`` on CPU over gloo, with its own all-to-all
dispatcher and with epkit's (``epkit.integrations.megatron.install``), on the same weights and
inputs. Each returns what Megatron computes (output, input gradient, every parameter gradient)
for the test to compare."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=UserWarning)  # "Transformer Engine / Apex not installed"


def cpu_patches():
    """The smallest set of patches that runs megatron-core 0.16.1's MoE layer on CPU."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as td

    # The router moves its weight to torch.cuda.current_device() on every forward, and the
    # local linear layers allocate there; "cpu" is a device string .to() accepts.
    torch.cuda.current_device = lambda: "cpu"
    # The all-to-all dispatcher makes a CUDA stream (for its device-to-host copies) in __init__.
    td.torch.cuda.Stream = lambda *a, **k: None
    # Without Transformer Engine, 0.16.1 never defines te_general_gemm, which the router's
    # gating linear tests for None (a NameError otherwise).
    moe_utils.te_general_gemm = None

    # The device-to-host copy of the split sizes runs on that CUDA stream; on CPU the sizes are
    # host tensors already, and the all-to-all wants them as host sequences (as the copy makes).
    def host_split_sizes(self, point, tokens_per_expert=None):
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
        return tokens_per_expert

    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_split_sizes


def groups(group):
    """Megatron's process groups for expert-parallel size 2 and nothing else parallel: the
    expert group (and the groups that contain it) is the pair, every other one this rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    import epkit

    one = epkit.group_of_one()
    pgc = ProcessGroupCollection()
    for name in ("ep", "tp_ep", "dp", "dp_cp", "tp_dp_cp"):
        setattr(pgc, name, group)
    for name in ("tp", "expt_tp", "expt_dp", "cp", "tp_cp", "pp"):
        setattr(pgc, name, one)
    return pgc


def build(group, seed, *, dtype, E, K, H, F, capacity_factor=None, drop_policy="probs",
          pad_to_capacity=False):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=F, moe_ffn_hidden_size=F,
        num_attention_heads=1, num_moe_experts=E, moe_router_topk=K,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
        add_bias_linear=False, moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=capacity_factor, moe_token_drop_policy=drop_policy,
        moe_pad_expert_input_to_capacity=pad_to_capacity,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        expert_model_parallel_size=dist.get_world_size(group))
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(seed)
    return build_module(spec, config=config, pg_collection=groups(group))


def run_layer(layer, x):
    """Forward and backward of one step: ``(output, x.grad, {parameter: grad})``."""
    x = x.clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    # A loss whose gradient differs per element, so every path carries a distinct value.
    torch.manual_seed(7)
    out.backward(torch.randn_like(out))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def compare(group, rank, dtype_name, options, layer_kw, T=12):
    """Megatron's dispatcher and epkit's on the same layer weights and tokens."""
    import epkit.integrations.megatron as em

    cpu_patches()
    dtype = getattr(torch, dtype_name)
    kw = {"dtype": dtype, "E": 4, "K": 2, "H": 16, "F": 24, **layer_kw}
    ref_layer = build(group, 100 + rank, **kw)
    epk_layer = build(group, 100 + rank, **kw)
    em.install(epk_layer, **options)
    assert type(epk_layer.token_dispatcher) is em.TokenDispatcher
    torch.manual_seed(1000 + rank)
    x = torch.randn(T, 1, kw["H"], dtype=dtype)
    ref = run_layer(ref_layer, x)
    got = run_layer(epk_layer, x)
    # What Megatron's router kept: the slots (after its drops) this rank routed.
    with torch.no_grad():
        probs, routing_map = ref_layer.router(x)
    return ref, got, int(routing_map.sum()), T * kw["K"]
