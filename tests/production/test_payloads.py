"""Quantized payloads: ``mxfp8`` and ``fp8_block128``,
quantized at the source bit for bit like the reference, moved as bytes, backward unquantized
(straight-through). One test per property, parametrised over the payloads of the table."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rank_fns
from cases import assert_bitwise
from epkit import reference as ref
from epkit.reference.errors import Reason

# payload -> (block, production quantize / dequantize names, reference quantize / dequantize)
PAYLOADS = {
    "mxfp8": (32, "quantize_mxfp8", "dequantize_mxfp8"),
    "fp8_block128": (128, "quantize_fp8_block128", "dequantize_fp8_block128"),
}


def _ref(payload, which):
    return getattr(ref, PAYLOADS[payload][1 if which == "q" else 2])


def _prod(payload, which):
    import epkit

    return getattr(epkit, PAYLOADS[payload][1 if which == "q" else 2])


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 4: np.uint32}[a.itemsize])


@pytest.mark.parametrize("payload", PAYLOADS)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(0, 5), blocks=st.integers(1, 3),
       log_scale=st.integers(-140, 125), bf16=st.booleans(), zero_block=st.booleans())
def test_quantize_kernel_equals_reference(payload, seed, T, blocks, log_scale, bf16, zero_block):
    B = PAYLOADS[payload][0]
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal((T, B * blocks)) * 2.0**log_scale).astype(np.float32)
    x[~np.isfinite(x)] = 0
    if zero_block:
        x[:, :B] = 0
    x[rng.random(x.shape) < 0.1] = -0.0
    xt = torch.from_numpy(x)
    if bf16:
        x = x.astype(ml_dtypes.bfloat16)
        x[~np.isfinite(x.astype(np.float32))] = 0
        xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    q, s = _prod(payload, "q")(xt)
    rq, rs = _ref(payload, "q")(x)
    assert q.dtype == torch.float8_e4m3fn and np.array_equal(q.view(torch.uint8).numpy(), _bits(rq))
    assert np.array_equal(_bits(s.numpy()), _bits(rs))
    got = _prod(payload, "dq")(q, s).numpy()
    assert np.array_equal(_bits(got), _bits(_ref(payload, "dq")(rq, rs)))


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("transport", ["dedup", "pairs"])
@pytest.mark.parametrize("exchange", ["ragged", "padded", "static", "lazy"])
def test_dispatch_against_reference(group_pool, payload, transport, exchange):
    """dispatch + combine + both backward passes, bit for bit against the reference."""
    rng = np.random.default_rng(11)
    R, E, K = 3, 6, 2
    H = 2 * PAYLOADS[payload][0]
    xs = [(rng.standard_normal((T, H)) * 3).astype(np.float32) for T in (4, 0, 5)]
    idxs = [np.stack([rng.permutation(E)[:K] for _ in range(x.shape[0])]) if x.shape[0]
            else np.zeros((0, K), np.int64) for x in xs]
    ws = [rng.random(i.shape).astype(np.float32) for i in idxs]
    gouts = [rng.standard_normal(x.shape).astype(np.float32) for x in xs]
    opts = dict(E=E, align=2, capacity=3, transport=transport, exchange=exchange, weighted=True,
                payload=payload, max_tokens_per_rank=5 if exchange == "static" else None)
    got = group_pool.run(rank_fns.quantized_forward_backward, R, xs, idxs, ws, gouts, [opts] * R)
    res = ref.dispatch(xs, idxs, ws, num_experts=E, align=2, capacity=3, payload=payload)
    hps = [_ref(payload, "dq")(r.expert_x, r.expert_scale) for r in res]
    ys = [hp * np.float32(2) for hp in hps]
    outs = ref.combine(ys, res)
    gys, gws = ref.combine_backward(gouts, ys, res)
    gxs = ref.dispatch_backward([(g * np.float32(2)).astype(np.float32) for g in gys], res)
    for r in range(R):
        M = int(res[r].expert_offsets[-1])
        assert_bitwise("expert_x", got[r]["q"], res[r].expert_x.view(np.uint8)[:M], r)
        assert_bitwise("expert_scale", got[r]["scale"], res[r].expert_scale[:M], r)
        assert got[r]["scale"].dtype == res[r].expert_scale.dtype
        assert_bitwise("expert_x_hp", got[r]["hp"], hps[r][:M], r)
        assert_bitwise("row_src", got[r]["row_src"], res[r].row_src[:M], r)
        assert_bitwise("out", got[r]["out"], outs[r], r)
        assert_bitwise("grad_x", got[r]["grad_x"], gxs[r].astype(np.float32), r)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_input_errors(group_pool, payload):
    """H % block and non-finite x: the reference's reasons and texts, on every rank."""
    B = PAYLOADS[payload][0]
    R, E = 2, 4
    bad_h = [np.ones((2, B + 8), np.float32)] * R
    idxs = [np.array([[0, 1], [2, 3]])] * R
    ws = [np.ones((2, 2), np.float32)] * R
    got = group_pool.run(rank_fns.raises_input_error, R, bad_h, idxs, ws,
                         [dict(num_experts=E, payload=payload)] * R)
    with pytest.raises(ref.InputError) as want:
        ref.dispatch(bad_h, idxs, ws, num_experts=E, payload=payload)
    assert want.value.code == Reason.HIDDEN_NOT_MULT32
    assert f"payload {payload} needs hidden % {B} == 0" in str(want.value)
    assert all(err == (0, int(Reason.HIDDEN_NOT_MULT32), str(want.value)) for err, _ in got), got
    xs = [np.ones((2, B), np.float32), np.ones((2, B), np.float32)]
    xs[1][1, 5] = np.inf
    got = group_pool.run(rank_fns.raises_input_error, R, xs, idxs, ws,
                         [dict(num_experts=E, payload=payload)] * R)
    with pytest.raises(ref.InputError) as want:
        ref.dispatch(xs, idxs, ws, num_experts=E, payload=payload)
    assert want.value.code == Reason.NONFINITE_PAYLOAD and want.value.rank == 1
    assert all(err == (1, int(Reason.NONFINITE_PAYLOAD), str(want.value)) for err, _ in got), got
