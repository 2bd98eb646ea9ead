"""epkit in Megatron-Core's real MoELayer (megatron-core, CPU, gloo, expert-parallel size 2):
the layer with epkit's dispatcher against the same layer with Megatron's own all-to-all
dispatcher, on the same weights and tokens. float32: the output, the input gradient and every
parameter gradient (router and experts) bit for bit; bfloat16: within one bfloat16 ulp."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (epkit[frameworks])")

import megatron_fns as fns  # noqa: E402

LAYERS = {
    "dropless": {},
    "drop-probs": dict(capacity_factor=0.5, drop_policy="probs"),
    "drop-position": dict(capacity_factor=0.5, drop_policy="position"),
    "drop-and-pad": dict(capacity_factor=0.75, drop_policy="probs", pad_to_capacity=True),
}


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in bfloat16 steps (ordered bit patterns)."""
    def ordered(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def check(results, mode):
    """mode: "exact" (bit for bit), "ulp" (one bfloat16 ulp), "close" (float32 to 1e-5)."""
    for rank, ((ref_out, ref_gx, ref_g), (out, gx, g), kept, slots) in enumerate(results):
        pairs = [("output", ref_out, out), ("grad x", ref_gx, gx)]
        pairs += [(f"grad {n}", ref_g[n], g[n]) for n in ref_g]
        assert ref_g.keys() == g.keys()
        for what, a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape, (rank, what)
            if mode == "exact":
                assert torch.equal(a, b), f"rank {rank} {what}: max diff {(a - b).abs().max()}"
            elif mode == "ulp":
                assert ulps_bf16(a, b) <= 1, f"rank {rank} {what}: {ulps_bf16(a, b)} ulps"
            else:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {what}")
    return [(kept, slots) for *_, kept, slots in results]


@pytest.mark.parametrize("layer", list(LAYERS))
def test_float32_bitwise(pair, layer):
    counts = check(pair.run(fns.compare, 2, *zip(*[("float32", {}, LAYERS[layer])] * 2)), "exact")
    if layer.startswith("drop-") and layer != "drop-and-pad":
        # The router did drop: the comparison covered drops, not only the dropless path.
        assert any(kept < slots for kept, slots in counts)


@pytest.mark.parametrize("options", [dict(transport="pairs", exchange="padded"),
                                     dict(exchange="static", max_tokens_per_rank=16)],
                         ids=["pairs-padded", "static"])
def test_float32_bitwise_epkit_options(pair, options):
    """How rows travel never changes the result (three local experts: the static exchange's
    trailing zero rows go to the last one, whose rows must still line up)."""
    layer = dict(LAYERS["drop-probs"], E=6)
    check(pair.run(fns.compare, 2, *zip(*[("float32", options, layer)] * 2)), "exact")


def test_float32_align(pair):
    """align=8 pads every expert's segment; the experts must get the padded lengths. Not bit
    for bit: an expert's matmul over a longer (zero-padded) segment may round differently (the
    BLAS picks its blocking by the row count), so to 1e-5; lengths without the padding would
    give three local experts each other's rows, far outside that."""
    layer = dict(LAYERS["drop-probs"], E=6)
    check(pair.run(fns.compare, 2, *zip(*[("float32", dict(align=8), layer)] * 2)), "close")


@pytest.mark.parametrize("layer", ["dropless", "drop-probs"])
def test_bfloat16_one_ulp(pair, layer):
    check(pair.run(fns.compare, 2, *zip(*[("bfloat16", {}, LAYERS[layer])] * 2)), "ulp")
