"""Exact float-format conversions written on the bits, for every Triton kernel of epkit.

Why not ``.to()``: Triton's interpreter converts float32 to bfloat16 by truncation and to E4M3
wrongly in thousands of cases, and compiled code would use the GPU's hardware ``cvt``, so the
interpreter and the GPU would disagree with each other and with the C++ kernels. Here every
conversion is integer operations on ``x.to(tl.uint32, bitcast=True)``: the same bits on the
interpreter, on sm_90 and on gfx942 (which has no OCP E4M3 hardware at all), and the same bits
as the C++ kernels (csrc/epkit.h ``narrow``, c10's ``fp8e4m3fn_from_fp32_value``).

Kernels keep bfloat16 data as its 16-bit integer view (the host passes ``t.view(torch.int16)``)
and float32 data that is only moved as ``int32``: the kernels never hold a bfloat16 tensor.

| function | from | to |
| --- | --- | --- |
| ``bf16_to_f32(b)`` | 16-bit integers (bfloat16 bits) | float32, exact (``bits << 16``) |
| ``f32_to_bf16(x)`` | float32 | int16 bits: round to nearest even, NaN -> 0x7FC0 |
| ``to_f32(v, BF16)`` / ``from_f32(x, BF16)`` | a row's integer view | float32 and back |
| ``f32_to_e4m3(x)`` | float32 | uint8 E4M3 (float8_e4m3fn) bits, torch's saturating rule |
| ``pow2(e)`` | int32 e in [-149, 127] | float32 2**e, exact (subnormal below -126) |
"""

from __future__ import annotations

from ._runtime import tl, triton

__all__ = ["bf16_to_f32", "f32_to_bf16", "to_f32", "from_f32", "f32_to_e4m3", "e4m3_to_f32", "pow2"]


@triton.jit
def bf16_to_f32(b):
    """bfloat16 bits (int16 or uint16) -> float32: the bits as the high half, exact for every
    pattern (subnormals and NaN payloads included)."""
    # (int16 -> int32 sign-extends; the shift drops the extension)
    return (b.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(x):
    """float32 -> bfloat16 bits as int16: c10's rule (csrc/epkit.h ``narrow``): NaN -> 0x7FC0,
    else round to nearest even on the bits (the high half of u + 0x7FFF + its last kept bit;
    overflow carries into the exponent and gives inf, as it should)."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def to_f32(v, BF16: tl.constexpr):
    """A loaded row's integer view -> float32: bfloat16 bits (int16) widened, float32 bits
    (int32) reinterpreted."""
    if BF16:
        return bf16_to_f32(v)
    else:
        return v.to(tl.float32, bitcast=True)


@triton.jit
def from_f32(x, BF16: tl.constexpr):
    """float32 -> the integer view a row of that dtype is stored as: int16 bfloat16 bits
    (rounded by ``f32_to_bf16``) or the int32 bits of x itself."""
    if BF16:
        return f32_to_bf16(x)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def f32_to_e4m3(x):
    """float32 -> float8_e4m3fn bits (uint8), torch's conversion (c10
    ``fp8e4m3fn_from_fp32_value``) in integers only: NaN -> 0x7F with x's sign; a magnitude
    that does not round to at most 448 (inf included) saturates to 448 (0x7E); below 2**-6 the
    subnormal grid of 2**-9, rounded to nearest even; else the mantissa rounded to 3 bits,
    nearest even. The sign is kept (-0.0 -> 0x80).

    c10 rounds the subnormal range with one float add (``|x| + 2**14``, whose ulp is 2**-9); the
    shift below is that add's round-to-nearest-even in integers, so no float operation (and no
    flush-to-zero) can change it."""
    u = x.to(tl.uint32, bitcast=True)
    sign = ((u >> 24) & 0x80).to(tl.uint8)
    a = u & 0x7FFFFFFF
    # normal E4M3 (|x| >= 2**-6 = bits 121 << 23): rebias the exponent, round the mantissa to 3
    # bits to nearest even; a carry past 0x7E (448) would be the NaN pattern: saturate
    odd = (a >> 20) & 1
    normal = (a - (120 << 23) + 0x7FFFF + odd) >> 20
    normal = tl.minimum(normal, 0x7E)
    # subnormal E4M3: |x| / 2**-9 rounded to nearest even; |x| = mant * 2**(exp - 150) with the
    # implicit bit, so the quotient is mant >> (141 - exp) (a float32 subnormal counts as exp 1)
    exp = a >> 23
    mant = tl.where(exp > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    shift = tl.minimum(141 - tl.maximum(exp, 1), 31)  # >= 21 here; 31 already gives 0
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.uint32)  # may reach 8: the smallest normal, 0x08, as in c10
    # 480 (1087 << 20) and up, inf included, is past 448's rounding range: saturate
    mag = tl.where(a >= (1087 << 20), 0x7E, tl.where(a < (121 << 23), sub, normal))
    mag = tl.where(a > 0x7F800000, 0x7F, mag)
    return mag.to(tl.uint8) | sign


@triton.jit
def e4m3_to_f32(b):
    """float8_e4m3fn bits (uint8) -> float32, torch's conversion (c10
    ``fp8e4m3fn_to_fp32_value``) in integers: a normal code rebiased (exponent + 120, the
    3 mantissa bits on top), a subnormal one m * 2**-9 (an exact small product), the NaN
    pattern (0x7F) 0x7FF00000; the sign kept (0x80 -> -0.0)."""
    u = b.to(tl.uint32)
    sign = (u & 0x80) << 24
    e = (u >> 3) & 0xF
    m = u & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # m * 2**-9, exact
    mag = tl.where(e == 0, sub, tl.where((e == 15) & (m == 7), 0x7FF00000, normal))
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def pow2(e):
    """int32 e in [-149, 127] -> float32 2**e, exact: the biased exponent for e >= -126, the
    subnormal bit 1 << (e + 149) below (float32's 2**-127 is 0x00400000)."""
    normal = (e + 127).to(tl.uint32) << 23
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 31)).to(tl.uint32)
    return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)
