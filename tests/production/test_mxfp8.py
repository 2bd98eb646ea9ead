"""MXFP8 payload (issue 4 item 5): quantized at the source bit for bit like the reference,
moved as bytes, backward unquantized (straight-through)."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rank_fns
from cases import assert_bitwise
from epkit import reference as ref


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(0, 5), blocks=st.integers(1, 3),
       log_scale=st.integers(-140, 125), bf16=st.booleans(), zero_block=st.booleans())
def test_quantize_kernel_equals_reference(seed, T, blocks, log_scale, bf16, zero_block):
    import epkit

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, 32 * blocks)) * 2.0**log_scale).astype(np.float32)
    if zero_block:
        x[:, :32] = 0
    x[rng.random(x.shape) < 0.1] = -0.0
    xt = torch.from_numpy(x)
    if bf16:
        x = x.astype(ml_dtypes.bfloat16)
        xt = xt.to(torch.bfloat16)
    q, c = epkit.quantize_mxfp8(xt)
    rq, rc = ref.quantize_mxfp8(x)
    assert np.array_equal(q.view(torch.uint8).numpy(), rq.view(np.uint8))
    assert np.array_equal(c.numpy(), rc)
    assert np.array_equal(epkit.dequantize_mxfp8(q, c).numpy(), ref.dequantize_mxfp8(rq, rc))


@pytest.mark.parametrize("transport", ["dedup", "pairs"])
@pytest.mark.parametrize("exchange", ["ragged", "padded", "static"])
def test_mxfp8_dispatch_against_reference(group_pool, transport, exchange):
    rng = np.random.default_rng(11)
    R, E, H, K = 3, 6, 64, 2
    xs = [(rng.standard_normal((T, H)) * 3).astype(np.float32) for T in (4, 0, 5)]
    idxs = [np.stack([rng.permutation(E)[:K] for _ in range(x.shape[0])]) if x.shape[0]
            else np.zeros((0, K), np.int64) for x in xs]
    ws = [rng.random(i.shape).astype(np.float32) for i in idxs]
    gouts = [rng.standard_normal(x.shape).astype(np.float32) for x in xs]
    opts = dict(E=E, align=2, capacity=3, transport=transport, exchange=exchange, weighted=True,
                max_tokens_per_rank=5 if exchange == "static" else None)
    got = group_pool.run(rank_fns.mxfp8_forward_backward, R, xs, idxs, ws, gouts, [opts] * R)
    res = ref.dispatch(xs, idxs, ws, num_experts=E, align=2, capacity=3, payload="mxfp8")
    ys = [ref.dequantize_mxfp8(r.expert_x, r.expert_scale) * np.float32(2) for r in res]
    outs = ref.combine(ys, res)
    gys, _ = ref.combine_backward(gouts, ys, res)
    gxs = ref.dispatch_backward([(g * np.float32(2)).astype(np.float32) for g in gys], res)
    for r in range(R):
        assert_bitwise("expert_x", got[r]["q"], res[r].expert_x.view(np.uint8), r)
        assert_bitwise("expert_scale", got[r]["scale"], res[r].expert_scale, r)
        assert_bitwise("row_src", got[r]["row_src"], res[r].row_src, r)
        assert_bitwise("out", got[r]["out"], outs[r], r)
        assert_bitwise("grad_x", got[r]["grad_x"], gxs[r].astype(np.float32), r)


def test_mxfp8_input_errors(group_pool):
    R, E = 2, 4
    bad_h = [np.ones((2, 40), np.float32)] * R
    idxs = [np.array([[0, 1], [2, 3]])] * R
    ws = [np.ones((2, 2), np.float32)] * R
    got = group_pool.run(rank_fns.raises_input_error, R, bad_h, idxs, ws,
                         [dict(num_experts=E, payload="mxfp8")] * R)
    assert all(err is not None and "multiple of 32" in err[2] for err, _ in got), got
    xs = [np.ones((2, 32), np.float32), np.ones((2, 32), np.float32)]
    xs[1][1, 5] = np.inf
    got = group_pool.run(rank_fns.raises_input_error, R, xs, idxs, ws,
                         [dict(num_experts=E, payload="mxfp8")] * R)
    assert all(err is not None and err[0] == 1 and "non-finite" in err[2] for err, _ in got), got
