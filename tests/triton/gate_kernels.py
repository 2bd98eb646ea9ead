"""Small kernels with one planted violation each (and clean twins), for the compile gate's tests
(``test_compile_gate.py``): ``epkit kernels --compile ... --module tests/triton/gate_kernels.py``
compiles exactly the specialisations declared here (and, with ``--launches``, the forms recorded
from the launch sites below). Each name says what the gate must find."""

from epkit.triton._runtime import launch, specialization, tl, triton

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


@triton.jit
def float_sum(x, o, n, BLOCK: tl.constexpr, INTS: tl.constexpr):
    # tl.sum in the layout's order (a tree over lanes and warps): over floats not the spec's
    offs = tl.arange(0, BLOCK)
    a = tl.load(x + offs, mask=offs < n, other=0)
    if INTS:
        tl.store(o, tl.sum(a.to(tl.int32, bitcast=True), 0).to(tl.float32, bitcast=True))
    else:
        tl.store(o, tl.sum(a, 0))


@triton.jit
def phases(x, o, n, BLOCK: tl.constexpr, FENCED: tl.constexpr):
    # the plan's two phases merged into one launch: the second reads what the first stored (at
    # another program's place), with only a tl.debug_barrier() between
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(o + offs, tl.load(x + offs, mask=m), mask=m)
    if FENCED:
        tl.debug_barrier()
        v = tl.load(o + (offs + BLOCK) % n, mask=m)
    else:
        v = tl.load(x + (offs + BLOCK) % n, mask=m)
    tl.store(x + offs, v, mask=m)


@triton.jit
def row_mover(src, dst, off, n, H, VB: tl.constexpr, HINT: tl.constexpr, BLOCK: tl.constexpr):
    # rows of H int32 units copied to row offsets read from memory: launched for 16-byte rows
    # (VB = 16), it must tell the compiler (HINT), else each unit moves alone
    r = tl.program_id(0).to(tl.int64)
    o = tl.load(off + r)
    if HINT:
        o = tl.multiple_of(o, VB // 4)
    cols = tl.arange(0, BLOCK)
    m = (cols < H) & (r < n)
    tl.store(dst + o + cols, tl.load(src + r * H + cols, mask=m), mask=m)


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
# (not exact: its tl.max over floats is what makes every element live, and the float-reduction
# rule is another test's)
specialization("spill", live_tile, {"x": "*fp32", "o": "*fp32", "BLOCK": "constexpr"},
               {"BLOCK": 4096, "num_warps": 1, "maxnreg": 32, "waves_per_eu": 8}, exact=False)
specialization("clean_tile", live_tile, {"x": "*fp32", "o": "*fp32", "BLOCK": "constexpr"},
               {"BLOCK": 256}, exact=False)
specialization("too_much_shared", big_shared, {"x": "*fp64", "o": "*fp64", "A": "constexpr", "B": "constexpr"},
               {"A": 128, "B": 256, "num_warps": 16})
specialization("does_not_compile", uses_global, {"x": "*fp32", "o": "*fp32", "n": "i64", "BLOCK": "constexpr"},
               {"BLOCK": 128})
X_O_N = {"x": "*fp32", "o": "*fp32", "n": "i32", "BLOCK": "constexpr"}
specialization("float_sum", float_sum, dict(X_O_N, INTS="constexpr"), {"BLOCK": 128, "INTS": False})
specialization("clean_int_sum", float_sum, dict(X_O_N, INTS="constexpr"), {"BLOCK": 128, "INTS": True})
specialization("not_exact_float_sum", float_sum, dict(X_O_N, INTS="constexpr"), {"BLOCK": 128, "INTS": False},
               exact=False)
ROW_MOVER = {"src": "*i32", "dst": "*i32", "off": "*i64", "n": "i32", "H": "i32"}
for _name, _hint in (("narrow_row_mover", False), ("clean_row_mover", True)):
    specialization(_name, row_mover, ROW_MOVER, {"VB": 16, "HINT": _hint, "BLOCK": 1024},
                   aligned=("src", "dst", "off", "H"))
specialization("barrier_store_then_load", phases, dict(X_O_N, FENCED="constexpr"), {"BLOCK": 128, "FENCED": True})
specialization("clean_two_buffers", phases, dict(X_O_N, FENCED="constexpr"), {"BLOCK": 128, "FENCED": False})


# ---- launch sites: the gate compiles what they launch (recorded, --launches) --------------------
def fused_launch_site(x, y, o):
    """A launch site that turns multiply-add fusion on for an exact kernel."""
    launch(mul_add, (1,), x, y, o, x.numel(), BLOCK=128, FUSED=False, enable_fp_fusion=True)


def clean_launch_site(x, y, o):
    launch(divide, (1,), x, y, o, x.numel(), BLOCK=128, ROUNDED=True)
