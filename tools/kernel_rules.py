"""The rules an epkit Triton kernel must keep, read off its compiled code (``epkit kernels
--compile``): pure text checks on Triton's TTIR, LLVM IR, PTX and AMDGCN, one function each.

Why the assembly: the interpreter never fuses, never flushes and divides exactly, so a kernel
that breaks a numeric rule passes every CPU test; and fusion is decided in the backend, not in
the LLVM IR, so only the final PTX / AMDGCN shows it. Each function returns ``[(rule,
evidence)]``, evidence being the offending instruction (first few of each rule).
"""

from __future__ import annotations

import re

# One evidence line per occurrence is enough to find it; more would flood the report.
MAX_EVIDENCE = 3

# ----- PTX (NVIDIA) -----------------------------------------------------------------------

_PTX_FLOAT = ("f16", "bf16", "f32", "f64", "f16x2", "bf16x2", "f32x2")


def _ptx_instructions(ptx: str):
    for line in ptx.splitlines():
        text = line.split("//", 1)[0].strip()
        text = re.sub(r"^@!?%\w+\s+", "", text)  # a predicate guard is not the instruction
        if not text or text.startswith((".", "{", "}", "$")) or text.endswith(":"):
            continue
        yield text.split(None, 1)[0], text


def ptx_violations(ptx: str) -> list[tuple[str, str]]:
    """An exact kernel's PTX: no fused multiply-add, no approximate division, reciprocal or other
    ``.approx`` math, no flush-to-zero, no hardware narrowing to bfloat16 or fp8 (the spec rounds on the bits)."""
    found: list[tuple[str, str]] = []
    for mnemonic, text in _ptx_instructions(ptx):
        parts = mnemonic.split(".")
        op = parts[0]
        rule = None
        if op in ("fma", "mad") and parts[-1] in _PTX_FLOAT:
            rule = "fused multiply-add (fma.rn.f32): compile with enable_fp_fusion=False"
        elif op == "div" and ("full" in parts or "approx" in parts):
            rule = "approximate division (div.full / div.approx): use tl.div_rn"
        elif op == "rcp" and "approx" in parts:
            rule = "approximate reciprocal (rcp.approx): use tl.div_rn"
        elif "approx" in parts:  # ex2 / lg2 / sqrt / rsqrt / sin / cos / tanh .approx
            rule = "approximate math (.approx): the interpreter computes it exactly"
        elif "ftz" in parts:
            rule = "flush-to-zero (.ftz)"
        elif op == "cvt" and len(parts) >= 3:
            dst, src = parts[-2], parts[-1]
            if dst.startswith("bf16") and src.startswith(("f32", "f64")):
                rule = "hardware float-to-bfloat16 conversion (cvt.rn.bf16.f32): convert on the bits"
            elif dst.startswith(("e4m3", "e5m2")):
                rule = "hardware fp8 conversion (cvt to e4m3 / e5m2): convert on the bits"
        if rule:
            found.append((rule, text))
    return _cap(found)


# ----- AMDGCN (AMD) -----------------------------------------------------------------------

# Float multiply-adds of every encoding (v_fmac_f32_e32, v_fmamk_f32, v_pk_fma_f32, legacy mad).
_AMD_FMA = re.compile(r"^v_(pk_)?(fma|fmac|fmamk|fmaak|mad|mac|madmk|madak)(_mix\w*|_legacy)?_(f16|f32|f64)\b"
                      r"|^v_fma_mix")
# The int64 division expansion builds a float from the halves with fmamk by +-2^32 (exact
# there: an integer below 2^32 times 2^32); a user's fma by exactly +-2^32 would pass too, and
# is exact unless it overflows.
_INT_DIV_CONSTANTS = ("0x4f800000", "0xcf800000")
_AMD_NO_DEF = ("global_store", "buffer_store", "flat_store", "scratch_store", "ds_write", "ds_store",
               "s_store", "s_waitcnt", "s_cbranch", "s_branch", "s_endpgm", "s_cmp", "s_bitcmp",
               "s_nop", "s_barrier", "s_setprio", "s_denorm_mode", "s_round_mode", "s_sleep",
               "s_set_gpr_idx", "exp ", "s_dcache", "buffer_wbl2", "buffer_inv", "s_trap")
_REG = re.compile(r"\b([vsa])(?:(\d+)|\[(\d+):(\d+)\])")


def _regs(operand: str) -> set[str]:
    out = set()
    for kind, one, lo, hi in _REG.findall(operand):
        if one:
            out.add(f"{kind}{one}")
        else:
            out.update(f"{kind}{i}" for i in range(int(lo), int(hi) + 1))
    return out


def _amd_instructions(asm: str):
    for line in asm.splitlines():
        text = line.split(";", 1)[0].strip()
        if not text or text.startswith(".") or text.endswith(":"):
            continue
        mnemonic, _, rest = text.partition(" ")
        operands = [o.strip() for o in rest.split(",")] if rest else []
        yield mnemonic, operands, text


def amdgcn_violations(asm: str) -> list[tuple[str, str]]:
    """An exact kernel's AMDGCN: no float multiply-add outside the IEEE division expansion, no
    approximate reciprocal outside a division expansion.

    The IEEE expansion of ``a / b`` (``tl.div_rn``, and ``/`` on AMD) is ``v_div_scale`` ->
    ``v_rcp`` -> four ``v_fma`` / ``v_fmac`` Newton steps -> ``v_div_fmas`` -> ``v_div_fixup``;
    the scheduler interleaves other instructions with it, so a window between ``v_div_scale``
    and ``v_div_fixup`` would also excuse an unrelated fma scheduled inside. Instead this
    follows the data: registers written by ``v_div_scale`` are marked, the mark flows through
    ``v_rcp`` / ``v_mul`` / ``v_fma*`` of marked operands, any other write clears it; an fma is
    part of a division exactly when one of its operands is marked. (Straight-line tracking over
    the text: the expansion never branches.)"""
    found: list[tuple[str, str]] = []
    div_marked: set[str] = set()   # from v_div_scale: the IEEE division's Newton steps
    int_marked: set[str] = set()   # from the int64 division's +-2^32 fmamk
    for mnemonic, operands, text in _amd_instructions(asm):
        base = re.sub(r"_e(32|64)$|_dpp$|_sdwa$", "", mnemonic)
        if not operands or mnemonic.startswith(_AMD_NO_DEF):
            continue
        dst = _regs(operands[0])
        srcs = set().union(*(_regs(o) for o in operands[1:])) if len(operands) > 1 else set()
        if base in ("v_fmac_f32", "v_fmac_f16", "v_fmac_f64", "v_mac_f32", "v_pk_fmac_f16"):
            srcs |= dst  # the accumulator is read too
        in_div = bool(srcs & div_marked)
        in_int_div = bool(srcs & int_marked) or any(c in text for c in _INT_DIV_CONSTANTS)
        is_fma = bool(_AMD_FMA.match(base))
        if base.startswith("v_div_scale_"):
            div_marked |= {r for r in dst if r[0] == "v"}
            int_marked -= dst
            continue
        if is_fma and not in_div and not in_int_div:
            found.append(("fused multiply-add (v_fma / v_fmac) outside a division expansion: "
                          "compile with enable_fp_fusion=False", text))
        if base in ("v_rcp_f32", "v_rcp_f64") and not in_div and not in_int_div:
            found.append(("approximate reciprocal (v_rcp) outside a division expansion: use tl.div_rn",
                          text))
        carries = base in ("v_rcp_f32", "v_rcp_f64", "v_mul_f32", "v_trunc_f32") or is_fma
        div_marked = (div_marked | dst) if carries and in_div else (div_marked - dst)
        int_marked = (int_marked | dst) if carries and in_int_div else (int_marked - dst)
    return _cap(found)


def amd_llir_violations(llir: str) -> list[tuple[str, str]]:
    """An exact kernel's LLVM IR for AMD: float32 denormals kept (``denormal-fp-math-f32`` =
    ieee on the kernel), no explicit fma / fmuladd intrinsic."""
    found: list[tuple[str, str]] = []
    modes = re.findall(r'"denormal-fp-math-f32"="([^"]*)"', llir)
    if not modes:
        found.append(("float32 denormal mode not stated (denormal-fp-math-f32 = ieee expected)", ""))
    for mode in modes:
        if any(part != "ieee" for part in mode.split(",")):
            found.append(("float32 denormals flushed (denormal-fp-math-f32 != ieee)",
                          f'"denormal-fp-math-f32"="{mode}"'))
    return _cap(found + llir_violations(llir))


def llir_violations(llir: str) -> list[tuple[str, str]]:
    """Either target's LLVM IR: no fma / fmuladd intrinsic and no fast-math flag that lets the
    backend contract or approximate (``contract``, ``afn``, ``fast``, ``reassoc``, ``arcp``)."""
    found: list[tuple[str, str]] = []
    for line in llir.splitlines():
        text = line.strip()
        if re.search(r"@llvm\.(fma|fmuladd)\.", text) and not text.startswith("declare"):
            found.append(("fused multiply-add intrinsic (llvm.fma / llvm.fmuladd) in the LLVM IR", text))
        elif re.search(r"=\s*(fmul|fadd|fsub|fdiv|frem|fneg)\s+([a-z]+\s+)*(fast|contract|afn|reassoc|arcp)\b",
                       text):
            found.append(("fast-math flag on a float operation in the LLVM IR", text))
    return found


# ----- TTIR (both targets) ----------------------------------------------------------------

_SSA_DEF = re.compile(r"(%[\w.$-]+)(?::\d+)?\s*=")
_SSA_USE = re.compile(r"%[\w.$-]+")


# Ops whose result no longer carries the id's magnitude in 32 bits: comparisons (an i1, though
# the pretty form prints the operand type), loads (data), widening to int64.
_NOT_CARRYING = ("arith.cmpi", "arith.cmpf", "tt.load", "tt.atomic", "arith.extsi", "arith.extui")


def _result_type(text: str) -> str:
    body = re.sub(r"\s+loc\(.*$", "", text).rstrip(" {")
    tail = body.rsplit(" : ", 1)[-1] if " : " in body else ""
    for arrow in (" -> ", " to "):
        if arrow in tail:
            tail = tail.rsplit(arrow, 1)[-1]
    return tail.strip()


def _is_int_type(ty: str) -> bool:
    return bool(re.search(r"(^|x|<)i(32|64)\b|^index$", ty)) or ty == ""


def ttir_violations(ttir: str) -> list[tuple[str, str]]:
    """No 32-bit integer multiply fed by a program id or count (``pid * stride`` wraps at 2^31
    exactly as on the GPU; offsets are int64 from the first product). "Fed" is transitive through integer
    arithmetic (``row = pid * ROWS + r; row * stride``), and stops at a comparison, a load or a
    widening to int64 (the value no longer carries the id's magnitude in 32 bits)."""
    lines = []
    for line in ttir.splitlines():
        text = line.strip()
        if text.startswith("#loc") or not text:
            continue
        defs = _SSA_DEF.findall(text.split("(", 1)[0] if "scf.for" not in text else text)
        lines.append((text, defs, set(_SSA_USE.findall(text)) - set(defs)))
    marked: set[str] = set()
    changed = True
    while changed:  # to a fixed point (cheap; robust to the order regions are printed in)
        changed = False
        for text, defs, uses in lines:
            if not defs or set(defs) <= marked:
                continue
            if "tt.get_program_id" in text or "tt.get_num_programs" in text:
                new = set(defs)
            elif (uses & marked and _is_int_type(_result_type(text))
                  and not any(op in text for op in _NOT_CARRYING)):
                new = set(defs)
            else:
                continue
            marked |= new
            changed = True
    found = []
    for text, defs, uses in lines:
        if "arith.muli" in text and uses & marked and re.search(r"(^|x|<)i32\b", _result_type(text)):
            found.append(("int32 multiply fed by a program id (offsets are int64 from the first "
                          "product: tl.program_id(0).to(tl.int64))", re.sub(r"\s+loc\(.*$", "", text)))
    return _cap(found)


def ttir_exact_violations(ttir: str) -> list[tuple[str, str]]:
    """An exact kernel's TTIR: no conversion between float formats (``.to()``: ``arith.truncf``,
    ``arith.extf``, ``tt.fp_to_fp``). The interpreter's conversions differ from the spec's
    (float32 to bfloat16 truncates, E4M3 is wrong in thousands of cases, bfloat16 subnormals
    widen wrongly) and the GPU's differ from both, whatever instruction the target picks (gfx942
    has no bfloat16 cvt, so the PTX rule alone would miss it there): convert on the bits."""
    found = []
    for line in ttir.splitlines():
        text = re.sub(r"\s+loc\(.*$", "", line.strip())
        if re.search(r"=\s*(arith\.truncf|arith\.extf|tt\.fp_to_fp)\b", text):
            found.append(("conversion between float formats (.to()) in an exact kernel: convert on "
                          "the bits", text))
    return _cap(found)


_FLOAT_TYPE = re.compile(r"(^|[x<(, ])(f16|bf16|f32|f64)\b")


def ttir_reduce_violations(ttir: str) -> list[tuple[str, str]]:
    """An exact kernel's TTIR: no reduction or scan over floats (``tl.sum`` / ``tl.reduce`` /
    ``tl.cumsum`` of a float tile: ``tt.reduce`` / ``tt.scan``). Their order is the layout's
    (a tree over lanes and warps, another per target), never the spec's sequential one; float
    sums are written-out loops, integer reductions are exact in any order."""
    found = []
    lines = [re.sub(r"\s+loc\(.*$", "", line.strip()) for line in ttir.splitlines()]
    for i, text in enumerate(lines):
        m = re.search(r'"(tt\.reduce|tt\.scan)"\(', text)
        if not m:
            continue
        for close in lines[i:]:  # the op's types follow its combine region: }) : (operands) -> results
            if close.startswith("})") and " : (" in close:
                operands = close.split(" : (", 1)[1].split(") ->", 1)[0]
                if _FLOAT_TYPE.search(operands):
                    found.append((f"float {'reduction' if m.group(1) == 'tt.reduce' else 'scan'} "
                                  f"({m.group(1)}: tl.sum / tl.reduce / tl.cumsum of floats) in an exact "
                                  "kernel: its order is the layout's; write the sum out in the spec's order",
                                  f"{text} ... {close}"))
                break
    return _cap(found)


_FUNC_PTR_ARG = re.compile(r"(%[\w.$-]+): !tt\.ptr<")


def ttir_barrier_violations(ttir: str) -> list[tuple[str, str]]:
    """Any kernel's TTIR: no load of a buffer that this kernel stored to before a
    ``tl.debug_barrier()`` (``gpu.barrier`` / ``ttg.barrier``). The barrier orders the threads
    of one program and, on AMD, only shared memory (LDS), not global memory; and other programs
    of the launch are not ordered by it at all: a store-then-load through global memory belongs
    in two launches. Each pointer value is traced back to the kernel's pointer arguments it
    derives from (through splat / addptr / select / loop arguments; a loaded value starts
    afresh); the check follows the text order of one kernel."""
    args: set[str] = set()
    lines = []
    for line in ttir.splitlines():
        text = line.strip()
        if not text or text.startswith("#loc"):
            continue
        if text.startswith("tt.func"):
            args |= set(_FUNC_PTR_ARG.findall(text))
            continue
        text = re.sub(r"\s+loc\(.*$", "", text)
        defs = _SSA_DEF.findall(text.split("(", 1)[0] if "scf.for" not in text else text)
        lines.append((text, defs, [u for u in _SSA_USE.findall(text) if u not in defs]))
    roots: dict[str, set[str]] = {a: {a} for a in args}
    changed = True
    while changed:  # to a fixed point, as ttir_violations
        changed = False
        for text, defs, uses in lines:
            if not defs or re.search(r"=\s*tt\.(load|atomic)", text):
                continue
            got = set().union(*(roots.get(u, set()) for u in uses)) if uses else set()
            for d in defs:
                if not got <= roots.get(d, set()):
                    roots[d] = roots.get(d, set()) | got
                    changed = True
    found = []
    stored: set[str] = set()
    fenced: set[str] = set()  # stored to before a barrier
    for text, defs, uses in lines:
        body = text.split("=", 1)[1].strip() if defs else text
        if re.match(r"(gpu\.barrier|ttg\.barrier)\b", body):
            fenced |= stored
        elif body.startswith("tt.store") and uses:
            stored |= roots.get(uses[0], set())
        elif body.startswith("tt.load") and uses:
            hit = roots.get(uses[0], set()) & fenced
            if hit:
                found.append((f"load of {', '.join(sorted(hit))} after a store to it and a "
                              "tl.debug_barrier(): the barrier does not order global memory "
                              "(gfx942) nor other programs; use a second launch", text))
    return _cap(found)


def launch_option_violations(options: dict, exact: bool) -> list[tuple[str, str]]:
    """A launch's options: an exact kernel is launched with ``enable_fp_fusion=False`` (the
    default of ``_runtime.launch``; a launch site that turns it on lets the backend fuse every
    multiply-add, whatever the kernel's code shows today)."""
    if exact and options.get("enable_fp_fusion", False):
        return [("exact kernel launched with enable_fp_fusion=True (a fused sum differs from the "
                 "spec's): drop the option at its launch site", "enable_fp_fusion=True")]
    return []


def _cap(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """At most MAX_EVIDENCE occurrences of each rule, in order."""
    seen: dict[str, int] = {}
    out = []
    for rule, evidence in found:
        seen[rule] = seen.get(rule, 0) + 1
        if seen[rule] <= MAX_EVIDENCE:
            out.append((rule, evidence))
    return out


# ----- access widths (every target) ------------------------------------------------------------

_PTX_BITS = {"8": 1, "16": 2, "32": 4, "64": 8, "128": 16}
_AMD_WIDTH = {"dwordx4": 16, "dwordx3": 12, "dwordx2": 8, "dword": 4, "b128": 16, "b96": 12,
              "b64": 8, "b32": 4, "short": 2, "ushort": 2, "sshort": 2, "b16": 2, "short_d16": 2,
              "short_d16_hi": 2, "byte": 1, "ubyte": 1, "sbyte": 1, "b8": 1, "u8": 1, "i8": 1,
              "u16": 2, "i16": 2, "ubyte_d16": 1, "sbyte_d16": 1, "ubyte_d16_hi": 1,
              "sbyte_d16_hi": 1, "byte_d16_hi": 1}


def ptx_access_widths(ptx: str) -> tuple[int, int]:
    """The widest global load and store of a PTX listing, in bytes (0: none): ``ld.global.v4.b32``
    is 16, ``st.global.b16`` 2."""
    widest = {"ld": 0, "st": 0}
    for op, _ in _ptx_instructions(ptx):
        parts = op.split(".")
        if parts[0] not in widest or "global" not in parts[1:]:
            continue
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((_PTX_BITS[m.group(1)] for p in reversed(parts)
                     if (m := re.fullmatch(r"[bsuf](\d+)", p)) and m.group(1) in _PTX_BITS), 0)
        widest[parts[0]] = max(widest[parts[0]], vec * bits)
    return widest["ld"], widest["st"]


def amdgcn_access_widths(asm: str) -> tuple[int, int]:
    """The widest global (or buffer) load and store of an AMDGCN listing, in bytes (0: none):
    ``global_load_dwordx4`` is 16, ``global_store_short`` 2."""
    widest = {"load": 0, "store": 0}
    for op, _, _ in _amd_instructions(asm):
        m = re.fullmatch(r"(?:global|buffer)_(load|store)_(\w+)", op)
        if m and m.group(2) in _AMD_WIDTH:
            widest[m.group(1)] = max(widest[m.group(1)], _AMD_WIDTH[m.group(2)])
    return widest["load"], widest["store"]


# A row mover (pack, unpack, scatter_rows, the return path's units, the reduce, the backward's
# row kernel) takes the constexpr VB: the bytes every row offset, row length and buffer of the
# launch is a multiple of, up to 16. Launched with VB = 16 it must move rows 16 bytes at a time.
ROW_VECTOR = "VB"
ROW_VECTOR_BYTES = 16


def row_width_violations(constexprs: dict, widths: tuple[int, int]) -> list[tuple[str, str]]:
    """A row mover launched for 16-byte rows (``VB`` = 16) whose widest global load or store
    is narrower: the rows move in smaller pieces than the launch allows (an offset or length
    whose alignment the compiler cannot see: ``tl.multiple_of`` it)."""
    if constexprs.get(ROW_VECTOR) != ROW_VECTOR_BYTES:
        return []
    load, store = widths
    if load >= ROW_VECTOR_BYTES and store >= ROW_VECTOR_BYTES:
        return []
    return [(f"row mover launched for {ROW_VECTOR_BYTES}-byte rows (VB={ROW_VECTOR_BYTES}) moves "
             f"them {min(load, store)} bytes at a time (widest global load {load} B, store "
             f"{store} B)", f"load {load} B, store {store} B")]
