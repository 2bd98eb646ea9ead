"""Rank functions: Megatron-Core's real ``MoELayer`` on CPU over gloo, with its own all-to-all
dispatcher and with epkit's (``epkit.integrations.megatron.install``), on the same weights and
inputs. Each returns what Megatron computes (output, input gradient, every parameter gradient)
for the test to compare."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from example_module import load

warnings.filterwarnings("ignore", category=UserWarning)  # "Transformer Engine / Apex not installed"


def cpu_patches():
    """The patches that run Megatron-Core's MoE layer on CPU (the example's, each with its reason)."""
    load("megatron_cpu").cpu_patches()


def groups(group):
    """Megatron's process groups for expert-parallel size 2 and nothing else parallel."""
    return load("megatron_cpu").process_groups(group)


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
    if hasattr(spec, "module"):  # 0.16: a ModuleSpec
        return build_module(spec, config=config, pg_collection=groups(group))
    return spec(config=config, pg_collection=groups(group))  # 0.19: a builder (MoELayer's partial)


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
