"""The Triton kernels over whole simulated groups (sim.py), bit for bit against the C++ kernels:
every intermediate of dispatch -> combine -> both backward passes, the weight gradients included.

Here the Triton kernels run on CPU tensors in Triton's interpreter; on a machine with a GPU
(``TRITON_INTERPRET=0``, as scripts/gpu_check.sh runs them) the same tests run them compiled, on
CUDA tensors. Group sizes 1..5 in one
process, both transports, every exchange layout, capacity drops and align, odd hidden sizes,
more tokens than one tile and K above a warp; the quantized payloads.
"""

import pytest
import torch

import sim

BF16, F32 = torch.bfloat16, torch.float32
# Interpreted Triton runs on CPU tensors; compiled Triton (a GPU machine, TRITON_INTERPRET unset
# or 0) on CUDA tensors, against the C++ kernels on CPU either way.
from epkit.triton._runtime import INTERPRETED  # noqa: E402

DEVICES = ["cpu"] if INTERPRETED else ["cuda"]

# (R, L, K, H, tokens per rank, x dtype): small enough for the interpreter.
SHAPES = [
    (1, 4, 2, 8, [5], F32),
    (2, 3, 4, 16, [7, 0], BF16),           # a rank without tokens
    (3, 2, 3, 7, [4, 9, 1], F32),          # H odd
    (4, 8, 8, 40, [70, 30, 3, 0], BF16),   # more tokens than one tile
    (5, 1, 5, 33, [6, 6, 6, 6, 6], BF16),  # L = 1; H odd
    (2, 24, 40, 12, [20, 3], F32),         # K = 40, above a warp
]
OPTIONS = [  # (transport, exchange, align, capacity)
    ("dedup", "ragged", 1, None), ("pairs", "ragged", 1, None),
    ("dedup", "padded", 2, 3), ("pairs", "padded", 1, 0),
    ("dedup", "static", 4, None), ("pairs", "static", 1, 2),
    ("dedup", "equal", 1, None), ("pairs", "auto", 3, 5),
]


@pytest.fixture(scope="module")
def triton_kernels():
    return sim.Triton()


def _pairs():
    """Each shape with two of the options (rotating), so every shape and every option is run
    without the full product (the interpreter's cost)."""
    for i, shape in enumerate(SHAPES):
        for j in (i, i + len(SHAPES)):
            yield shape, OPTIONS[j % len(OPTIONS)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,opts", list(_pairs()),
                         ids=[f"R{s[0]}L{s[1]}K{s[2]}H{s[3]}-{o[0]}-{o[1]}-a{o[2]}-c{o[3]}"
                              for s, o in _pairs()])
def test_group_round_trip_bitwise(triton_kernels, device, shape, opts):
    R, L, K, H, Ts, dtype = shape
    transport, exchange, align, capacity = opts
    case = sim.make_case(R, L, K, H, Ts, dtype, seed=R * 100 + K, hot=capacity is not None)
    kw = dict(align=align, capacity=capacity, transport=transport, exchange=exchange,
              y_dtype=BF16 if H % 2 else F32)
    for weighted in (True, False):
        want = sim.run(case, weighted=weighted, device="cpu", C=sim.CPP, **kw)
        got = sim.run(case, weighted=weighted, device=device, C=triton_kernels, **kw)
        sim.assert_same(want, got)
        if not weighted:
            assert all(not bool(g.any()) for g in got["grad_w_combine"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("payload", ["mxfp8", "fp8_block128"])
@pytest.mark.parametrize("transport,exchange", [("dedup", "ragged"), ("pairs", "static"),
                                                ("dedup", "static"), ("pairs", "padded")])
def test_quantized_payload_bitwise(triton_kernels, device, payload, transport, exchange):
    case = sim.make_case(3, 2, 3, 256, [9, 0, 20], BF16, seed=7)
    kw = dict(transport=transport, exchange=exchange, align=2)
    want = sim.run_payload(case, payload, device="cpu", C=sim.CPP, **kw)
    got = sim.run_payload(case, payload, device=device, C=triton_kernels, **kw)
    sim.assert_same(want, got)


def test_the_table_has_every_op(triton_kernels):
    """Every epkit op with a C++ kernel has a Triton kernel (a GPU user gets all of them)."""
    from epkit.triton import OPS

    assert triton_kernels.missing == []
    assert set(OPS) >= {"layout", "prepare", "plan", "pack", "pack_into", "unpack",
                        "gather_rows", "gather_units", "reduce_tokens", "scatter_rows",
                        "scatter_rows_into", "combine_backward_dest", "gather_slot_values",
                        "scatter_slot_values", "quantize_mxfp8", "quantize_fp8_block128",
                        "empty_large"}
