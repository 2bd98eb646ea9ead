"""fp8_block128 (docs/semantics.md): the rule against a plain float64 / ml_dtypes formulation,
saturation, zero blocks, bfloat16 input, the error bound, the wire row, the H % 128 error."""

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from epkit import reference as ref
from epkit.reference import payloads
from epkit.reference.dtypes import BFLOAT16
from epkit.reference.errors import Reason

E4M3 = ml_dtypes.float8_e4m3fn
finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
rows = hnp.arrays(np.float32, st.tuples(st.integers(0, 3), st.sampled_from([128, 256])),
                  elements=finite32)


def plain(x):
    """The rule in float64, rounded to float32 where the rule rounds (a float64 quotient of two
    float32 rounded to float32 is the float32 quotient: 53 >= 2 * 24 + 2), E4M3 by ml_dtypes."""
    v = np.asarray(x).astype(np.float64)
    T, H = v.shape
    amax = np.abs(v).reshape(T, H // 128, 128).max(axis=2, initial=0.0)
    scale = (np.maximum(amax, np.float64(np.float32(1e-4))) / 448.0).astype(np.float32)
    u = (v / np.repeat(scale.astype(np.float64), 128, axis=1)).astype(np.float32)
    return np.clip(u, -448, 448).astype(E4M3), scale


@settings(max_examples=200, deadline=None)
@given(rows, st.integers(-100, 100), st.booleans())
def test_rule_equals_plain_formulation(x, log_scale, bf16):
    with np.errstate(over="ignore"):
        x = (x.astype(np.float64) * 2.0 ** log_scale).astype(np.float32)
    x[~np.isfinite(x)] = 0
    if bf16:
        x = x.astype(BFLOAT16)
        x[~np.isfinite(x.astype(np.float32))] = 0
    q, scale = ref.quantize_fp8_block128(x)
    pq, pscale = plain(x)
    assert q.dtype == E4M3 and scale.dtype == np.float32
    assert q.shape == x.shape and scale.shape == (x.shape[0], x.shape[1] // 128)
    assert np.array_equal(q.view(np.uint8), pq.view(np.uint8))
    assert np.array_equal(scale.view(np.uint32), pscale.view(np.uint32))
    assert np.isfinite(q.astype(np.float32)).all() and np.isfinite(scale).all()
    deq = ref.dequantize_fp8_block128(q, scale)
    want = (q.astype(np.float64) * np.repeat(scale, 128, axis=1)).astype(np.float32)
    assert deq.dtype == np.float32 and np.array_equal(deq.view(np.uint32), want.view(np.uint32))
    # error bound: half an E4M3 ulp (relative 2**-4) or half its subnormal step (2**-10 * s),
    # with room for the float32 roundings of v / s and q * s
    s = np.repeat(scale.astype(np.float64), 128, axis=1)
    v = x.astype(np.float64)
    err = np.abs(deq.astype(np.float64) - v)
    assert (err <= np.maximum(2.0 ** -4 * np.abs(v), 2.0 ** -10 * s) * (1 + 2.0 ** -20)).all()


def test_bfloat16_input_is_widened_exactly():
    rng = np.random.default_rng(3)
    xb = (rng.standard_normal((4, 256)) * 7).astype(BFLOAT16)
    qb, sb = ref.quantize_fp8_block128(xb)
    qf, sf = ref.quantize_fp8_block128(xb.astype(np.float32))
    assert np.array_equal(qb.view(np.uint8), qf.view(np.uint8)) and np.array_equal(sb, sf)


def test_block_maximum_maps_to_448_and_saturates():
    # amax / float32(amax / 448) rounds to 448.00003 for these: the clamp gives 448, not NaN.
    amax = np.float32(8.294966)
    assert amax / (amax / np.float32(448)) > 448
    x = np.zeros((1, 256), np.float32)
    x[0, 0], x[0, 1], x[0, 128] = amax, -amax, -np.float32(3.997119)
    x[0, 129] = np.float32(1.5)
    q, scale = ref.quantize_fp8_block128(x)
    assert scale[0, 0] == amax / np.float32(448)
    assert q[0, 0].astype(np.float32) == 448 and q[0, 1].astype(np.float32) == -448
    assert q[0, 128].astype(np.float32) == -448
    # the extremes of float32 and bfloat16 stay finite both ways
    big = np.full((2, 128), np.finfo(np.float32).max, np.float32)
    big[1] = -float(ml_dtypes.finfo(BFLOAT16).max)
    q, scale = ref.quantize_fp8_block128(big)
    assert (np.abs(q.astype(np.float32)) == 448).all()
    assert np.isfinite(ref.dequantize_fp8_block128(q, scale)).all()


def test_zero_and_tiny_blocks_use_the_clamped_scale():
    x = np.zeros((2, 256), np.float32)
    x[0, 128:] = -0.0                       # a -0 block keeps its sign: E4M3 byte 0x80
    floor = np.float32(1e-4) / np.float32(448)
    x[1, :128] = floor * np.float32(2)      # amax below 1e-4: the clamped scale, q = 2 exactly
    x[1, 3] = np.float32(1e-6)              # 1e-6 / floor = 4.48 -> E4M3 4.5
    x[1, 128] = np.float32(1e-4)            # amax exactly float32(1e-4): the same scale
    q, scale = ref.quantize_fp8_block128(x)
    assert (scale == floor).all() and scale.view(np.uint32)[0, 0] == floor.view(np.uint32)
    assert (q.view(np.uint8)[0, :128] == 0).all() and (q.view(np.uint8)[0, 128:] == 0x80).all()
    assert q[1, 128].astype(np.float32) == 448
    assert q[1, 0].astype(np.float32) == 2.0 and q[1, 3].astype(np.float32) == 4.5


def test_hidden_and_shape_errors():
    with pytest.raises(ValueError, match="H % 128"):
        ref.quantize_fp8_block128(np.ones((2, 96), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        ref.quantize_fp8_block128(np.full((1, 128), np.nan, np.float32))
    xs = [np.ones((2, 96), np.float32)] * 2
    idx = [np.array([[0, 1], [1, -1]])] * 2
    ws = [np.ones((2, 2), np.float32)] * 2
    for tier in (ref, ref.fast):
        with pytest.raises(ref.InputError) as err:
            tier.dispatch(xs, idx, ws, num_experts=2, payload="fp8_block128")
        assert err.value.code == Reason.HIDDEN_NOT_MULT32 and err.value.rank == 0
        assert err.value.reason == ("payload fp8_block128 needs hidden % 128 == 0: hidden size 96"
                                    " is not a multiple of 128")
    with pytest.raises(ref.InputError, match="hidden % 128"):
        ref.dispatch_bytes(idx, num_experts=2, hidden=96, dtype=np.float32,
                           payload="fp8_block128")


def test_wire_row_is_e4m3_bytes_then_little_endian_float32_scales():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    q, scale = ref.quantize_fp8_block128(x)
    p = payloads.get("fp8_block128")
    buf = p.to_bytes(q[0], scale[0])
    assert len(buf) == p.row_bytes(256, np.float32) == 256 + 4 * 2
    assert buf[:256] == q.view(np.uint8).tobytes()
    assert struct.unpack("<2f", buf[256:]) == tuple(float(s) for s in scale[0])
    row, sc = p.from_bytes(np.frombuffer(buf, np.uint8), 256, np.float32)
    assert np.array_equal(row.view(np.uint8), q[0].view(np.uint8)) and np.array_equal(sc, scale[0])


def test_dispatch_carries_the_rows_through_both_transports():
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((3, 128)).astype(np.float32) * 5 for _ in range(2)]
    idx = [np.array([[0, 3], [2, -1], [1, 2]])] * 2
    ws = [rng.random((3, 2)).astype(np.float32) for _ in range(2)]
    canon = ref.dispatch(xs, idx, ws, num_experts=4, align=2, payload="fp8_block128")
    for tr in ("pairs", "dedup"):
        got = ref.dispatch(xs, idx, ws, num_experts=4, align=2, payload="fp8_block128",
                           transport=tr, exchange="ragged")
        for a, b in zip(canon, got):
            assert np.array_equal(a.expert_x.view(np.uint8), b.expert_x.view(np.uint8))
            assert np.array_equal(a.expert_scale.view(np.uint32), b.expert_scale.view(np.uint32))
    r = canon[0]
    assert r.expert_x.dtype == E4M3 and r.expert_scale.dtype == np.float32
    assert r.expert_scale.shape == (r.expert_x.shape[0], 1)
    s, t, _ = r.row_src[0]
    q, scale = ref.quantize_fp8_block128(xs[s][t:t + 1])
    assert np.array_equal(r.expert_x[0].view(np.uint8), q[0].view(np.uint8))
    assert r.expert_scale[0, 0] == scale[0, 0]
