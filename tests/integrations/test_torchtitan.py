"""epkit in torchtitan's real MoE (torchtitan, CPU, gloo, expert-parallel size 2): the layer with
epkit's dispatcher against the same layer with torchtitan's own ``AllToAllTokenDispatcher``.

float32: the output and the experts' gradients bit for bit. The router's gradients (and so
x's, which the router feeds) reach the scores through each dispatcher's own weight-gradient
sum: torchtitan's is autograd's float32 reduction over ``H``, epkit's the spec's (float64, one
rounding), so they agree to float32 rounding, not bit for bit. bfloat16: torchtitan rounds
each weighted expert output to bfloat16 and sums in bfloat16, epkit sums in float32 and rounds
once, so the outputs differ by at most one bfloat16 ulp of the larger of the exact sum and its
largest term (not of the sum alone, which may cancel), epkit's nearer the exact (float64) sum;
gradients bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is a test dependency (epkit[frameworks])")

import torchtitan_fns as fns  # noqa: E402

EXPERTS = ("routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w2_EDF",
           "routed_experts.inner_experts.w3_EFD")


def ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at |v| (normal range): 2 ** (exponent - 7)."""
    return torch.ldexp(torch.ones_like(v), torch.frexp(v.abs()).exponent - 8)


def check(results, exact):
    for rank, ((ref_out, ref_gx, ref_g), (out, gx, g), exact_sum, largest) in enumerate(results):
        assert ref_g.keys() == g.keys() and set(EXPERTS) < set(g)
        pairs = [("output", ref_out, out)] + [(n, ref_g[n], g[n]) for n in EXPERTS]
        near = [("grad x", ref_gx, gx), ("router", ref_g["router.gate.weight"],
                                          g["router.gate.weight"])]
        for what, a, b in pairs + near:
            assert a.dtype == b.dtype and a.shape == b.shape, (rank, what)
        if exact:
            for what, a, b in pairs:
                assert torch.equal(a, b), f"rank {rank} {what}: max diff {(a - b).abs().max()}"
            for what, a, b in near:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {what}")
        else:
            for what, a, b in pairs[1:] + near:
                assert torch.equal(a, b), f"rank {rank} {what}: max diff {(a - b).abs().max()}"
            gap = (ref_out.double() - out.double()).abs()
            scale = torch.maximum(largest, exact_sum.abs())  # the larger of a term and the sum
            assert (gap <= ulp_bf16(scale)).all(), f"rank {rank}: output over one ulp"
            titan_error = (ref_out.double() - exact_sum).abs().sum()
            epkit_error = (out.double() - exact_sum).abs().sum()
            assert epkit_error <= titan_error, (rank, float(epkit_error), float(titan_error))



def test_float32_bitwise(pair):
    check(pair.run(fns.compare, 2, ["float32"] * 2, [{}] * 2), True)


@pytest.mark.parametrize("options", [dict(align=8), dict(transport="pairs", exchange="ragged")],
                         ids=["align8", "pairs-ragged"])
def test_float32_bitwise_epkit_options(pair, options):
    """Three local experts, so that lengths without the padding would hand experts each
    other's rows."""
    check(pair.run(fns.compare, 2, ["float32"] * 2, [options] * 2, [6] * 2), True)


def test_bfloat16(pair):
    check(pair.run(fns.compare, 2, ["bfloat16"] * 2, [{}] * 2), False)


def test_expert_parallel_size_one(pair):
    """No ep mesh: torchtitan's dispatcher reorders locally; epkit's runs over a group of one
    (epkit.group_of_one), not over the pair, so each rank keeps its own tokens."""
    check(pair.run(fns.compare, 2, ["float32"] * 2, [{}] * 2, [4] * 2, [2] * 2, [12] * 2,
                   [False] * 2), True)
