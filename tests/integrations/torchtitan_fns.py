"""Rank functions: torchtitan's real ``MoE`` (router, ``RoutedExperts``, ``GroupedExperts``) on
CPU over gloo at expert-parallel size 2, with its own ``AllToAllTokenDispatcher`` and with
epkit's (``epkit.integrations.torchtitan.swap_token_dispatcher``), on the same weights and
tokens. Each returns what the layer computes for the test to compare."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from example_module import load

warnings.filterwarnings("ignore", category=UserWarning)  # CPU autocast's float32 notice


def cpu_setup(group):
    """What torchtitan needs to run its MoE on CPU over gloo, and the expert-parallel mesh
    (the example's outside_the_trainer, which says why)."""
    return load("torchtitan_cpu").outside_the_trainer(group)


def build(*, E, K, H, F, L, seed, dtype, epkit_options=None):
    """torchtitan's MoE, built as the example builds it, in ``dtype``."""
    return load("torchtitan_cpu").build_moe(seed, epkit_options, E=E, K=K, H=H, F=F, L=L).to(dtype)


def run_layer(layer, x):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    torch.manual_seed(7)
    out.backward(torch.randn_like(out))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def capture_terms(layer):
    """Wrap torchtitan's own combine to keep, per token, the float64 sum of its weighted expert
    outputs (exact: a bfloat16 or float32 value times a float32 score is exact in float64) and
    the largest such term's magnitude; the dict fills on the next forward."""
    disp, seen = layer.routed_experts.token_dispatcher, {}
    exchange, combine = disp._combine_token_exchange, disp.combine

    def keep_rows(*args):
        seen["rows"] = exchange(*args)
        return seen["rows"]

    def keep_terms(routed_output_RD, metadata, x_TD):
        out = combine(routed_output_RD, metadata, x_TD)
        with torch.no_grad():
            terms = (seen.pop("rows").double()
                     * metadata.topk_scores_experts_sorted_N.double().reshape(-1, 1))
            index = metadata.token_indices_experts_sorted_N.reshape(-1, 1).expand_as(terms)
            zeros = torch.zeros(x_TD.shape, dtype=torch.float64)
            seen["exact"] = zeros.scatter_add(0, index, terms)
            seen["largest"] = zeros.scatter_reduce(0, index, terms.abs(), "amax")
        return out

    disp._combine_token_exchange, disp.combine = keep_rows, keep_terms
    return seen


def compare(group, rank, dtype_name, options, E=4, K=2, T=12, ep=True):
    """``ep=False``: expert-parallel size 1, every expert on every rank and no mesh wired (as
    torchtitan's parallelize does without an ep mesh)."""
    import epkit.integrations.torchtitan as et

    mesh = cpu_setup(group) if ep else None
    dtype = getattr(torch, dtype_name)
    L = E // dist.get_world_size(group) if ep else E
    kw = dict(E=E, K=K, H=16, F=24, L=L, seed=100 + rank, dtype=dtype)
    ref_layer = build(**kw)
    epk_layer = build(**kw, epkit_options=options)
    for layer in (ref_layer, epk_layer):
        # What RoutedExperts.parallelize does after sharding the experts.
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    assert type(epk_layer.routed_experts.token_dispatcher) is et.TokenDispatcher
    torch.manual_seed(1000 + rank)
    x = torch.randn(1, T, kw["H"], dtype=dtype)
    if not ep:  # (the exact sums are for the bfloat16 check, which runs with an ep mesh)
        return run_layer(ref_layer, x), run_layer(epk_layer, x), None, None
    terms = capture_terms(ref_layer)
    ref = run_layer(ref_layer, x)
    return ref, run_layer(epk_layer, x), terms["exact"].view(1, T, -1), terms["largest"].view(1, T, -1)
