"""epkit.triton.mxfp8 / fp8_block128 (quantize_mxfp8, quantize_fp8_block128) against the C++
kernels, bit for bit: elements, E8M0 codes and float32 scales, on blocks of every magnitude
(subnormal scales, the clamp at 2**-127, E4M3's subnormals and saturation), on every float32
bit class (NaN payloads, infinities, subnormals, -0) and on zero / NaN-only blocks."""

import numpy as np
import pytest
import torch

from test_combine import DTYPES, same, same_sum, special

from epkit.triton.fp8_block128 import quantize_fp8_block128
from epkit.triton.mxfp8 import quantize_mxfp8

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
QUANTIZERS = [("quantize_mxfp8", quantize_mxfp8, 32),
              ("quantize_fp8_block128", quantize_fp8_block128, 128)]


def scaled_blocks(rng, T, H, block, dtype):
    """Normal values times a power of two per block, from 2**-149 to 2**127 (and some blocks
    left as drawn); some blocks zero, -0, or holding one NaN / inf among zeros."""
    v = rng.standard_normal((T, H // block, block)).astype(np.float32)
    e = rng.integers(-149, 128, (T, H // block, 1))
    v = (v.astype(np.float64) * np.exp2(e.astype(np.float64))).astype(np.float32)
    flat = v.reshape(-1, block)
    for i, kind in enumerate(rng.integers(0, 8, len(flat))):
        if kind == 0:
            flat[i] = 0.0
        elif kind == 1:
            flat[i] = -0.0
        elif kind == 2:
            flat[i] = 0.0
            flat[i, rng.integers(0, block)] = np.float32(np.nan)
        elif kind == 3:
            flat[i, rng.integers(0, block)] = np.float32(-np.inf)
        elif kind == 4:  # a maximum that lands on 448 (or one rounding above it)
            flat[i] *= np.float32(448.0) / np.abs(flat[i]).max()
    return torch.from_numpy(v.reshape(T, H)).to(dtype)


@pytest.mark.parametrize("name,fn,block", QUANTIZERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(0, 256), (1, 128), (7, 384), (40, 256)])
def test_quantize_matches_cpp(cpp, name, fn, block, dtype, T, H):
    rng = np.random.default_rng(T * 100 + H + block)
    for x in (scaled_blocks(rng, T, H, block, dtype), special(rng, (T, H), dtype),
              special(rng, (T, H), dtype, finite=True)):
        got, want = fn(x), getattr(cpp, name)(x)
        assert same(got[0], want[0]) and same(got[1], want[1])


def test_mxfp8_codes_cover_the_clamp(cpp):
    """Every code from 0 to 254's range edges: amax from 2**-149 (clamped to e = -127) to the
    float32 maximum (e = 119), each block a power of two and one just below it."""
    e = np.arange(-149, 128)
    top = np.exp2(e.astype(np.float64)).astype(np.float32)
    below = np.nextafter(top, np.float32(0))
    x = torch.from_numpy(np.repeat(np.concatenate([top, below])[:, None], 32, 1).astype(np.float32))
    x[:, 1::2] *= -0.37
    got, want = quantize_mxfp8(x), cpp.quantize_mxfp8(x)
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert int(got[1].min()) == 0 and int(got[1].max()) == 119 + 127


@pytest.mark.parametrize("name,fn,block", QUANTIZERS)
def test_quantize_refuses_what_cpp_refuses(cpp, name, fn, block):
    for x, match in [(torch.zeros(2, block + 16), f"H % {block} == 0"),
                     (torch.zeros(block), "x must be 2-D"),
                     (torch.zeros(2, block, dtype=torch.float16), "float32 or bfloat16")]:
        for impl in (getattr(cpp, name), fn):
            with pytest.raises(RuntimeError, match=match):
                impl(x)


@pytest.mark.parametrize("name,block", [("mxfp8", 32), ("fp8_block128", 128)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(0, 256), (1, 128), (7, 384), (40, 256)])
def test_wire_rows_are_the_host_ops(cpp, name, block, dtype, T, H):
    """The one-launch wire rows each way (triton/<payload>.py quantize_rows, dequantize_rows)
    against the host path's (the C++ quantize, then the copies and the payload's torch
    dequantize: epkit.payloads), bit for bit: every E4M3 code (NaN, subnormals, saturation, -0)
    through the dequantize, and the scales' bytes in the row."""
    import importlib

    from epkit import payloads

    kernels = importlib.import_module(f"epkit.triton.{name}")
    pl = payloads.TABLE[name]
    rng = np.random.default_rng(T * 10 + H + block)
    for x in (scaled_blocks(rng, T, H, block, dtype), special(rng, (T, H), dtype, finite=True)):
        q, scale = getattr(cpp, f"quantize_{name}")(x)
        want = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)
        got = kernels.quantize_rows(x)
        assert got.dtype == torch.uint8 and torch.equal(got, want)
    # every E4M3 byte, under every scale a row may carry (codes 0 .. 255; scales of each
    # magnitude, subnormal ones included)
    P = H + H // block * pl.scale_dtype.itemsize
    rows = torch.from_numpy(rng.integers(0, 256, (max(T, 1) * 8, P), dtype=np.uint8))
    rows[0, :min(H, 256)] = torch.arange(min(H, 256), dtype=torch.uint8)
    q, scale, hp = kernels.dequantize_rows(rows, H)
    wq = rows[:, :H].contiguous().view(torch.float8_e4m3fn)
    ws = rows[:, H:].contiguous().view(pl.scale_dtype)
    assert same(q, wq) and same(scale, ws)
    # a NaN times a NaN (a NaN scale is random bytes here, never a quantizer's) is either
    # operand's NaN (IEEE 754; docs/verify.md): any NaN matches there, every other bit must
    assert same_sum(hp, pl.dequantize(wq, ws))
