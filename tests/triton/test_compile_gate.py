"""``epkit kernels --compile``: it finds each violation planted in a small kernel
(``gate_kernels.py``) on the target that shows it, passes the clean twins, and passes epkit's
own declared specialisations. The gate runs as a command (it re-executes itself with
``TRITON_INTERPRET=0``: this process runs Triton interpreted)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GATE_KERNELS = os.path.join(HERE, "gate_kernels.py")
TARGETS = ("sm_90", "gfx942")


def gate(*args, tmp_path=None):
    """Run ``epkit kernels`` with ``args``: (exit status, output, json rows or None)."""
    out_json = os.path.join(str(tmp_path), "gate.json") if tmp_path is not None else None
    cmd = [sys.executable, "-m", "epkit.tools.kernels", *args] + (["--json", out_json] if out_json else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    rows = None
    if out_json and os.path.exists(out_json):
        with open(out_json) as f:
            rows = json.load(f)["rows"]
    return proc.returncode, proc.stdout + proc.stderr, rows


def record_launch_sites(path):
    """Run gate_kernels' launch sites (interpreted) under the recorder; write the forms to
    ``path`` as ``epkit kernels --launches`` reads them."""
    import torch

    import gate_kernels
    from epkit.triton import _runtime

    x, y, o = torch.rand(100), torch.rand(100) + 1, torch.zeros(100)
    with _runtime.record_launches() as rec:
        gate_kernels.fused_launch_site(x, y, o)
        gate_kernels.clean_launch_site(x, y, o)
    with open(path, "w") as f:
        json.dump({"tiles": _runtime.tiles(), "forms": list(rec.forms.values())}, f)


# One worker runs this module (--dist loadgroup, pyproject.toml): its module fixture is
# costly, and under xdist every worker that took one of its tests would build it again.
pytestmark = pytest.mark.xdist_group("compile_gate")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(kernel, target) -> the rules broken, for every specialisation of gate_kernels.py and
    every form its launch sites launch."""
    tmp = tmp_path_factory.mktemp("gate")
    record_launch_sites(tmp / "launches.json")
    rc, out, rows = gate("--compile", ",".join(TARGETS), "--module", GATE_KERNELS,
                         "--launches", str(tmp / "launches.json"), tmp_path=tmp)
    assert rows is not None, out
    assert rc == 1, out  # planted violations: the gate must fail
    return {(r["kernel"], r["target"]): [v["rule"] for v in r["violations"]] for r in rows}


def broken(planted, kernel, target, words):
    rules = planted[(kernel, target)]
    return any(words in rule for rule in rules)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["fused_mul_add", "fusion_on"])
def test_fused_multiply_add_is_caught(planted, kernel, target):
    # tl.fma, and a * b + a compiled with fusion left on: fma.rn.f32 / v_fmac_f32
    assert broken(planted, kernel, target, "fused multiply-add"), planted[(kernel, target)]


def test_slash_division_is_caught_on_nvidia(planted):
    assert broken(planted, "slash_division", "sm_90", "approximate division"), planted[("slash_division", "sm_90")]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["to_bf16", "to_e4m3"])
def test_float_conversion_is_caught(planted, kernel, target):
    assert broken(planted, kernel, target, "conversion between float formats"), planted[(kernel, target)]


@pytest.mark.parametrize("kernel,words", [("to_bf16", "cvt.rn.bf16.f32"), ("to_e4m3", "fp8 conversion")])
def test_hardware_conversion_is_caught_in_ptx(planted, kernel, words):
    assert broken(planted, kernel, "sm_90", words), planted[(kernel, "sm_90")]


@pytest.mark.parametrize("target", TARGETS)
def test_int32_program_id_product_is_caught(planted, target):
    assert broken(planted, "int32_pid_product", target, "int32 multiply fed by a program id")


@pytest.mark.parametrize("target", TARGETS)
def test_spill_is_caught(planted, target):
    assert broken(planted, "spill", target, "register spill"), planted[("spill", target)]


@pytest.mark.parametrize("target", TARGETS)
def test_shared_memory_over_the_limit_is_caught(planted, target):
    assert broken(planted, "too_much_shared", target, "over " + target), planted[("too_much_shared", target)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["fusion_on", "gate_kernels.mul_add[BLOCK=128,FUSED=False]"])
def test_fusion_enabled_at_a_launch_site_is_caught(planted, kernel, target):
    # the option itself, whatever the code compiles to today; the second is a recorded launch
    assert broken(planted, kernel, target, "launched with enable_fp_fusion=True"), planted[(kernel, target)]


@pytest.mark.parametrize("target", TARGETS)
def test_float_reduction_is_caught(planted, target):
    assert broken(planted, "float_sum", target, "float reduction (tt.reduce"), planted[("float_sum", target)]


@pytest.mark.parametrize("target", TARGETS)
def test_store_then_load_across_a_barrier_is_caught(planted, target):
    rules = planted[("barrier_store_then_load", target)]
    assert broken(planted, "barrier_store_then_load", target, "load of %o after a store to it and a "
                  "tl.debug_barrier()"), rules


@pytest.mark.parametrize("target", TARGETS)
def test_a_row_mover_below_16_bytes_is_caught(planted, target):
    # launched for 16-byte rows, its offsets' alignment not told to the compiler: 4-byte moves
    assert broken(planted, "narrow_row_mover", target, "moves them 4 bytes at a time"), \
        planted[("narrow_row_mover", target)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["clean_mul_add", "clean_row_mover", "clean_div_rn", "clean_int64_rows", "clean_tile",
                                    "not_exact_division", "clean_int_sum", "not_exact_float_sum",
                                    "clean_two_buffers", "gate_kernels.divide[BLOCK=128,ROUNDED=True]"])
def test_clean_kernels_pass(planted, kernel, target):
    # clean_div_rn multiplies and adds after an IEEE division: on gfx942 its Newton-step fmas
    # must not be taken for fusion; not_exact_division is exempt from the numeric rules.
    assert planted[(kernel, target)] == []


@pytest.mark.parametrize("target", TARGETS)
def test_kernel_that_only_the_interpreter_accepts_is_caught(planted, target):
    # a non-constexpr global: runs interpreted, refused by the compiler
    assert broken(planted, "does_not_compile", target, "does not compile")


def test_slash_division_is_ieee_on_amd(planted):
    # AMD compiles / to the IEEE expansion: nothing to report, and its fmas are not flagged.
    assert planted[("slash_division", "gfx942")] == []


def test_exit_status(tmp_path):
    rc, out, rows = gate("--compile", "sm_90", "--module", GATE_KERNELS, "--only", "clean_",
                         tmp_path=tmp_path)
    assert rc == 0, out
    assert rows and all(r["violations"] == [] for r in rows)
    # The columns are labelled, and the run closes with what it proved and what it did not.
    assert any(ln.startswith("kernel ") and "compile ms" in ln for ln in out.splitlines()), out
    assert "compile ms: how long" in out and "compiled for sm_90; not run on a GPU" in out, out
    rc, out, _ = gate("--compile", "sm_42", "--module", GATE_KERNELS)
    assert rc == 2 and "unknown target" in out


# A gfx942 division expansion (tl.div_rn(a, b) * b + a compiled with fusion on) with the user's
# multiply-add moved inside the expansion's window: the data flow, not the position, decides.
AMD_DIVISION_THEN_FMA = """
	v_div_scale_f32 v4, s[4:5], v2, v2, v1
	v_rcp_f32_e32 v5, v4
	v_div_scale_f32 v6, vcc, v1, v2, v1
	v_fma_f32 v7, -v4, v5, 1.0
	v_fmac_f32_e32 v5, v7, v5
	v_fmac_f32_e32 v10, v11, v12
	v_mul_f32_e32 v7, v6, v5
	v_fma_f32 v8, -v4, v7, v6
	v_fmac_f32_e32 v7, v8, v5
	v_fma_f32 v4, -v4, v7, v6
	v_div_fmas_f32 v4, v4, v5, v7
	v_div_fixup_f32 v4, v4, v2, v1
	v_fmac_f32_e32 v1, v2, v4
"""


def test_amd_fma_inside_a_division_window_is_caught():
    from epkit.tools.kernel_rules import amdgcn_violations

    found = [evidence for rule, evidence in amdgcn_violations(AMD_DIVISION_THEN_FMA)]
    assert found == ["v_fmac_f32_e32 v10, v11, v12", "v_fmac_f32_e32 v1, v2, v4"]


# TTIR of a persistent loop: the step is an int32 product of the program count, the offset
# an int32 product of a value carried from the program id; the int64 product is fine.
TTIR_PROGRAM_COUNT = """
    %c128_i32 = arith.constant 128 : i32 loc(#loc1)
    %pid = tt.get_program_id x : i32 loc(#loc2)
    %nprog = tt.get_num_programs x : i32 loc(#loc3)
    %step = arith.muli %nprog, %c128_i32 : i32 loc(#loc4)
    %row = arith.addi %pid, %c128_i32 : i32 loc(#loc5)
    %wide = arith.extsi %row : i32 to i64 loc(#loc6)
    %ok = arith.muli %wide, %stride : i64 loc(#loc7)
    %lt = arith.cmpi slt, %row, %n : i32 loc(#loc8)
    %sel = arith.select %lt, %n, %c128_i32 : i32 loc(#loc9)
    %fine = arith.muli %sel, %c128_i32 : i32 loc(#loc10)
    %0 = scf.for %i = %row to %n step %step iter_args(%acc = %row) -> (i32)  : i32 {
      %off = arith.muli %acc, %c128_i32 : i32 loc(#loc11)
"""


def test_ttir_program_id_flow():
    from epkit.tools.kernel_rules import ttir_violations

    found = [evidence for rule, evidence in ttir_violations(TTIR_PROGRAM_COUNT)]
    assert found == ["%step = arith.muli %nprog, %c128_i32 : i32", "%off = arith.muli %acc, %c128_i32 : i32"]


@pytest.mark.slow
def test_epkit_specialisations_keep_the_rules(tmp_path):
    """Every specialisation epkit's kernel modules declare compiles for both targets within the
    rules. Fails, naming file, kernel and rule, while a kernel breaks one."""
    rc, out, rows = gate("--compile", ",".join(TARGETS), tmp_path=tmp_path)
    assert rows, out
    assert rc == 0, out


# ---- the record: every launch is one of the forms the gate compiles -----------------------------

def _write_rows_40x64():
    import torch

    from epkit.triton import byterows

    Q, W = 40, 64
    out, src = torch.zeros(Q * W, dtype=torch.uint8), torch.ones(Q * W, dtype=torch.uint8)
    offs = torch.arange(Q, dtype=torch.int64) * W
    byterows.write_rows(out, offs, W, src, offs, W, align=4)
    assert bool((out == 1).all())


def test_a_tile_size_outside_the_record_fails_its_launch(monkeypatch):
    """conftest.py installs this check for every test here; built again so that the test does
    not depend on it. A launch site whose tile size nobody recorded fails at launch (at a GPU's
    tiles); the recorded one passes, at the interpreter's tiles too (tile sizes aside)."""
    from epkit.triton import _runtime, byterows, launched

    hook = _runtime.check_recorded(launched.FORMS)
    monkeypatch.setattr(_runtime, "LAUNCH_HOOKS", [hook])
    _write_rows_40x64()
    with _runtime.gpu_tiles():
        _write_rows_40x64()  # 16 int32 units a row: the recorded GPU tile (32, 16)
        monkeypatch.setattr(byterows, "GPU_TILES", ((4, 1024), (8, 128), (16, 16)))
        with pytest.raises(_runtime.UnrecordedLaunch, match=r"byterows:_rows_kernel launched in a "
                                                            r"form the compile gate does not compile"):
            _write_rows_40x64()


def test_the_record_is_canonical():
    """launched.py is what write_launched makes of its own forms: one form per launch site form,
    sorted (a hand edit, or a record from another version, reads differently)."""
    from epkit.triton import _runtime, launched

    assert launched.FORMS and launched.TILES == "gpu"
    assert _runtime.canonical(launched.FORMS) == launched.FORMS


def test_a_form_that_is_not_the_kernels_is_refused(tmp_path):
    """A recorded form whose arguments are no longer the kernel's (the kernel changed after
    the record) is a failure naming --record, found before compiling."""
    import gate_kernels
    from epkit.tools.kernels import compile_one
    from epkit.triton._runtime import Specialization

    spec = Specialization("stale", gate_kernels.to_bf16, {"x": "*fp32", "o": "*bf16", "BLOCK": "constexpr"},
                          {"BLOCK": 128})  # no n
    row = compile_one(spec, "sm_90", str(tmp_path))
    assert [v["rule"] for v in row["violations"]] == [
        "does not compile: the form's arguments are not the kernel's (changed since it was "
        "recorded? epkit kernels --record)"]
    # a recorded kernel that is gone: reported, not a crash of the gate
    from epkit.tools.kernels import recorded

    path = tmp_path / "launches.json"
    path.write_text(json.dumps({"tiles": "gpu", "forms": [
        {"kernel": "gate_kernels:renamed", "signature": {"x": "*fp32"}, "aligned": [], "ones": [],
         "constexprs": {}, "options": {}}]}))
    (gone,) = recorded(str(path), [GATE_KERNELS])
    row = compile_one(gone, "gfx942", str(tmp_path))
    assert row["where"] == "gate_kernels:renamed" and "the recorded kernel is gone" in row["violations"][0]["rule"]


def test_launch_form_reads_what_triton_specialises():
    """A launch's form by Triton's rule: an int equal to 1 is specialised (``ones``), one past
    2^31 is i64, 16-byte aligned pointers and ints divisible by 16 are ``aligned``, launch
    options apart from constexprs."""
    import torch

    import gate_kernels
    from epkit.triton._runtime import form_key, launch_form

    x, odd = torch.zeros(64), torch.zeros(65)[1:]
    form = launch_form(gate_kernels.mul_add, (x, odd, x, 1),
                       {"BLOCK": 128, "FUSED": False, "num_warps": 2, "enable_fp_fusion": False})
    assert form["signature"] == {"x": "*fp32", "y": "*fp32", "o": "*fp32", "n": "i32",
                                 "BLOCK": "constexpr", "FUSED": "constexpr"}
    assert form["aligned"] == ["x", "o"] and form["ones"] == ["n"]
    assert form["constexprs"] == {"BLOCK": 128, "FUSED": False}
    assert form["options"] == {"enable_fp_fusion": False, "num_warps": 2}
    wide = launch_form(gate_kernels.mul_add, (x, x, x, 1 << 36), {"BLOCK": 128, "FUSED": False,
                                                                  "num_warps": 2, "enable_fp_fusion": False})
    assert wide["signature"]["n"] == "i64" and wide["aligned"] == ["x", "y", "o", "n"]
    assert form_key(wide) == form_key(form)  # what the data decides is not the launch site's form
    fused = launch_form(gate_kernels.mul_add, (x, x, x, 16), {"BLOCK": 128, "FUSED": False,
                                                              "num_warps": 2, "enable_fp_fusion": True})
    assert form_key(fused) != form_key(form)


def test_every_launched_kernel_is_in_the_record():
    """Each kernel a module of epkit.triton launches (``launch(kernel, ...)`` in its source) has
    a recorded form: a kernel only launched on a path the tests never take would otherwise be
    compiled by nothing."""
    import inspect
    import re

    from epkit.triton import _runtime, launched

    recorded = {form["kernel"] for form in launched.FORMS}
    launched_here = {f"{m.__name__}:{name}" for m in _runtime.kernel_modules()
                     for name in re.findall(r"\blaunch\(\s*(\w+)\s*,", inspect.getsource(m))
                     if name != "kernel"}
    assert launched_here and launched_here <= recorded, sorted(launched_here - recorded)


# The widest global load and store read off each target's listing (predicated, vector, cached
# and byte forms); shared and local accesses are not global.
PTX_ACCESSES = """
	ld.global.b64 	%rd5, [%rd4+0];
	@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd9 + 0 ];
	ld.shared.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];
	@!%p2 st.global.v2.b32 [ %rd10 + 0 ], { %r1, %r2 };
	st.global.b8 [ %rd11 + 0 ], %rs1;
	st.local.v4.b32 [ %rd12 + 0 ], { %r1, %r2, %r3, %r4 };
"""
AMD_ACCESSES = """
	global_load_dwordx4 v[0:3], v[4:5], off
	global_load_ushort v6, v[4:5], off
	buffer_store_dwordx2 v[0:1], v2, s[0:3], 0 offen
	global_store_byte v[4:5], v6, off
	ds_write_b128 v1, v[0:3]
"""


def test_access_widths_are_read_from_the_assembly():
    from epkit.tools.kernel_rules import amdgcn_access_widths, ptx_access_widths

    assert ptx_access_widths(PTX_ACCESSES) == (16, 8)
    assert amdgcn_access_widths(AMD_ACCESSES) == (16, 8)
    assert ptx_access_widths("") == (0, 0)


def test_the_row_width_rule_applies_to_16_byte_launches_only():
    from epkit.tools.kernel_rules import row_width_violations

    assert row_width_violations({"VB": 16}, (16, 16)) == []
    assert row_width_violations({"VB": 8}, (8, 8)) == []     # 8-byte rows: 8 is their best
    assert row_width_violations({}, (1, 1)) == []            # not a row mover
    [(rule, _)] = row_width_violations({"VB": 16}, (16, 4))
    assert "moves them 4 bytes at a time" in rule
