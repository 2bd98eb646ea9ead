"""MXFP8: error bound, scale codes, round trip, zero blocks, saturation."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from epkit import reference as ref
from epkit.reference.dtypes import BFLOAT16

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
blocks = hnp.arrays(np.float32, st.tuples(st.integers(0, 3), st.sampled_from([32, 64])),
                    elements=finite32)


def scale_exp(codes):
    return codes.astype(np.int64) - 127


@settings(max_examples=200, deadline=None)
@given(blocks, st.booleans())
def test_error_bound_and_codes(x, bf16):
    if bf16:
        x = x.astype(BFLOAT16).astype(np.float32)
        x[~np.isfinite(x)] = 0
    q, codes = ref.quantize_mxfp8(x.astype(BFLOAT16) if bf16 else x)
    assert q.dtype == ml_dtypes.float8_e4m3fn and codes.dtype == np.uint8
    assert q.shape == x.shape and codes.shape == (x.shape[0], x.shape[1] // 32)
    assert (codes <= 254).all()                                     # 255 would be E8M0's NaN
    assert np.isfinite(q.astype(np.float32)).all()
    e = np.repeat(scale_exp(codes), 32, axis=1).astype(np.float64)
    v = x.astype(np.float64)
    deq = ref.dequantize_mxfp8(q, codes)
    assert deq.dtype == np.float32
    err = np.abs(deq.astype(np.float64) - v)
    in_range = np.abs(v) <= 448 * 2.0 ** e
    bound = np.maximum(2.0 ** -4 * np.abs(v), 2.0 ** (e - 10))
    assert (err[in_range] <= bound[in_range]).all()
    sat = ~in_range
    assert np.array_equal(deq[sat], (np.sign(v) * 448 * 2.0 ** e)[sat].astype(np.float32))
    # the block maximum lands in [256, 448] unless the scale is clamped at 2**-127
    amax = np.abs(v).reshape(x.shape[0], x.shape[1] // 32, 32).max(axis=2, initial=0)
    for (t, b), a in np.ndenumerate(amax):
        if a == 0:
            assert codes[t, b] == 0
        elif codes[t, b] > 0:
            assert 2.0 ** (int(codes[t, b]) - 127 + 8) <= a < 2.0 ** (int(codes[t, b]) - 127 + 9)


@settings(max_examples=200, deadline=None)
@given(blocks)
def test_round_trip(x):
    q, codes = ref.quantize_mxfp8(x)
    q2, codes2 = ref.quantize_mxfp8(ref.dequantize_mxfp8(q, codes))
    assert np.array_equal(codes2, codes)
    qb, q2b = q.view(np.uint8), q2.view(np.uint8)
    all_zero = (q.astype(np.float32) == 0).reshape(x.shape[0], x.shape[1] // 32, 32).all(axis=2)
    zero_blocks = np.repeat(all_zero, 32, axis=1)
    # bitwise, except that an all-zero block comes back as +0 (documented)
    assert np.array_equal(qb[~zero_blocks], q2b[~zero_blocks])
    assert (q2b[zero_blocks] == 0).all()


def test_zero_blocks_and_saturation():
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = -0.0                        # a zero block: code 0, elements +0 (even for -0.0)
    x[0, 32:] = 480.0                       # amax 480: e = 8 - 8 = 0, 480 > 448 saturates
    x[0, 33] = -500.0
    x[1, :32] = np.float32(1e-45)           # the smallest subnormal: scale clamped to 2**-127
    x[1, 32:] = np.arange(32, dtype=np.float32)
    q, c = ref.quantize_mxfp8(x)
    assert c.tolist() == [[0, 127], [0, 127 + 4 - 8]]
    assert (q[0, :32].view(np.uint8) == 0).all()
    assert q[0, 32].astype(np.float32) == 448 and q[0, 33].astype(np.float32) == -448
    deq = ref.dequantize_mxfp8(q, c)
    assert deq[1, 32 + 24] == 24 and deq[0, 34] == 448
    assert deq[1, 32 + 31] == 28        # 31 * 2**4 = 496 > 448 saturates: 448 * 2**-4


def test_non_finite_and_bad_hidden():
    with pytest.raises(ValueError):
        ref.quantize_mxfp8(np.full((1, 32), np.inf, np.float32))
    with pytest.raises(ValueError):
        ref.quantize_mxfp8(np.zeros((1, 48), np.float32))
