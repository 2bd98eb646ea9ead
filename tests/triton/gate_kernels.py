"""Small kernels with one planted violation each (and clean twins), for the compile gate's tests
(``test_compile_gate.py``): ``epkit kernels --compile ... --module tests/triton/gate_kernels.py``
compiles exactly the specialisations declared here. Each name says what the gate must find."""

from epkit.triton._runtime import specialization, tl, triton

F32x3 = {"x": "*fp32", "y": "*fp32", "o": "*fp32", "n": "i64", "BLOCK": "constexpr"}


@triton.jit
def mul_add(x, y, o, n, BLOCK: tl.constexpr, FUSED: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(x + offs, mask=m)
    b = tl.load(y + offs, mask=m)
    if FUSED:
        r = tl.fma(a, b, a)  # an explicit fused multiply-add
    else:
        r = a * b + a  # separate mul and add once compiled without fusion
    tl.store(o + offs, r, mask=m)


@triton.jit
def divide(x, y, o, n, BLOCK: tl.constexpr, ROUNDED: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(x + offs, mask=m)
    b = tl.load(y + offs, mask=m, other=1.0)
    r = tl.div_rn(a, b) if ROUNDED else a / b
    # a multiply-add after the division: the AMD check must tell it from the Newton steps
    tl.store(o + offs, r * b + a, mask=m)


@triton.jit
def to_bf16(x, o, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(o + offs, tl.load(x + offs, mask=m).to(tl.bfloat16), mask=m)


@triton.jit
def to_e4m3(x, o, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(o + offs, tl.load(x + offs, mask=m).to(tl.float8e4nv), mask=m)


@triton.jit
def rows(x, o, stride, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        row = pid.to(tl.int64) + 1
    else:
        row = pid + 1  # still int32: row * stride wraps past 2^31
    offs = row * stride + tl.arange(0, BLOCK)
    tl.store(o + offs, tl.load(x + offs))


@triton.jit
def live_tile(x, o, BLOCK: tl.constexpr):
    # every element stays live across the reduction: with few registers, a spill
    offs = tl.arange(0, BLOCK)
    a = tl.load(x + offs)
    tl.store(o + offs, a - tl.max(a, 0))


@triton.jit
def big_shared(x, o, A: tl.constexpr, B: tl.constexpr):
    # a transpose goes through shared memory / LDS: [128, 256] float64 is 256 KiB of it
    r = tl.arange(0, A)
    c = tl.arange(0, B)
    a = tl.load(x + r[:, None] * B + c[None, :])
    tl.store(o + c[:, None] * A + r[None, :], tl.trans(a))


LIMIT = 3  # a plain global: the interpreter reads it, the compiler refuses it


@triton.jit
def uses_global(x, o, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o + offs, tl.load(x + offs, mask=offs < n) + LIMIT, mask=offs < n)


F32x3_FUSED = dict(F32x3, FUSED="constexpr")
F32x3_ROUNDED = dict(F32x3, ROUNDED="constexpr")
specialization("fused_mul_add", mul_add, F32x3_FUSED, {"BLOCK": 128, "FUSED": True})
specialization("fusion_on", mul_add, F32x3_FUSED, {"BLOCK": 128, "FUSED": False, "enable_fp_fusion": True})
specialization("clean_mul_add", mul_add, F32x3_FUSED, {"BLOCK": 128, "FUSED": False})
specialization("slash_division", divide, F32x3_ROUNDED, {"BLOCK": 128, "ROUNDED": False})
specialization("clean_div_rn", divide, F32x3_ROUNDED, {"BLOCK": 128, "ROUNDED": True})
specialization("not_exact_division", divide, F32x3_ROUNDED, {"BLOCK": 128, "ROUNDED": False}, exact=False)
specialization("to_bf16", to_bf16, {"x": "*fp32", "o": "*bf16", "n": "i64", "BLOCK": "constexpr"},
               {"BLOCK": 128})
specialization("to_e4m3", to_e4m3, {"x": "*fp32", "o": "*fp8e4nv", "n": "i64", "BLOCK": "constexpr"},
               {"BLOCK": 128})
ROWS = {"x": "*fp32", "o": "*fp32", "stride": "i32", "BLOCK": "constexpr", "WIDE": "constexpr"}
specialization("int32_pid_product", rows, ROWS, {"BLOCK": 128, "WIDE": False})
specialization("clean_int64_rows", rows, ROWS, {"BLOCK": 128, "WIDE": True})
# maxnreg (NVIDIA) and waves_per_eu (AMD: 8 waves leave 64 VGPRs) bound the registers so that a
# 4,096-element tile in one warp spills on both targets within a second of compiling.
specialization("spill", live_tile, {"x": "*fp32", "o": "*fp32", "BLOCK": "constexpr"},
               {"BLOCK": 4096, "num_warps": 1, "maxnreg": 32, "waves_per_eu": 8})
specialization("clean_tile", live_tile, {"x": "*fp32", "o": "*fp32", "BLOCK": "constexpr"},
               {"BLOCK": 256})
specialization("too_much_shared", big_shared, {"x": "*fp64", "o": "*fp64", "A": "constexpr", "B": "constexpr"},
               {"A": 128, "B": 256, "num_warps": 16})
specialization("does_not_compile", uses_global, F32x3, {"BLOCK": 128})
