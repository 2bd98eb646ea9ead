"""``epkit kernels``: epkit's Triton kernels, as the ops launch them, compiled without a GPU.

``epkit kernels`` lists what the ops launch: the launch forms recorded in
``epkit.triton.launched`` (kernel, argument types, 16-byte alignment, constexprs with the tile
sizes, launch options), which ``epkit kernels --record`` writes by running tests/triton at a GPU
launch's tile sizes under the launch hook (``_runtime.record_launches``); every launch in
tests/triton is checked against that record, so it cannot drift from what is launched.
``epkit kernels --compile sm_90,gfx942`` compiles each of them for each target
(``triton.compile`` on an ``ASTSource``, no driver needed), prints registers, spills, scratch,
shared memory / LDS, the widest global load and store and compile time, and fails (exit 1) on
any rule the
compiled code breaks (``kernel_rules.py``): in an exact kernel, fused multiply-add, approximate
division, flush-to-zero or hardware float narrowing in the PTX / AMDGCN; in every kernel, a
spill, shared memory over the target's limit, an int32 multiply fed by a program id; from the
launch and the TTIR, an exact kernel launched with ``enable_fp_fusion=True`` or reducing floats
(``tl.sum``), and any kernel loading a buffer it stored to before a ``tl.debug_barrier()``; a
row mover launched for 16-byte rows (constexpr ``VB`` = 16) whose widest global load or store
is narrower. The
interpreter cannot see any of these: it never fuses, divides exactly and has no registers.

Compiling needs ``TRITON_INTERPRET=0`` before Triton is imported (``epkit.triton`` otherwise
chooses the interpreter on a machine without a GPU), so the command re-runs itself in a child
process with it, and with Triton's cache in a temporary directory (nothing is cached in the
repository or the home directory; every run compiles cold).

Exit status: 0 all kernels keep the rules, 1 a rule is broken (or a kernel does not compile),
2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# target name -> (backend, arch, warp size, shared memory / LDS limit per block in bytes).
# sm_90: 227 KiB opt-in dynamic shared memory; sm_80: 163 KiB; gfx9 CDNA: 64 KiB LDS; gfx950 160 KiB.
TARGETS = {
    "sm_80": ("cuda", 80, 32, 166912),
    "sm_90": ("cuda", 90, 32, 232448),
    "gfx90a": ("hip", "gfx90a", 64, 65536),
    "gfx942": ("hip", "gfx942", 64, 65536),
    "gfx950": ("hip", "gfx950", 64, 163840),
}
# Launch options a specialisation's constexprs may carry (``launch`` passes them to kernel[grid]).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                  "waves_per_eu", "matrix_instr_nonkdim", "kpack")
CHILD_ENV = "EPKIT_KERNELS_COMPILE_CHILD"


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="epkit kernels", formatter_class=HelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\nWithout --compile: list the declared "
        "specialisations. Exit status: 0 pass, 1 a rule broken, 2 usage error.")
    ap.add_argument("--compile", metavar="TARGETS", default=None,
                    help=f"comma-separated targets to compile for ({', '.join(TARGETS)}); "
                         "without it, only list the specialisations")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the table (one object per kernel and target, with its violations) here")
    ap.add_argument("--module", metavar="MODULE", action="append", default=None,
                    help="check the specialisations this module (dotted name or .py path) declares "
                         "instead of epkit.triton's; repeatable")
    ap.add_argument("--launches", metavar="PATH", default=None,
                    help="compile the launch forms in this JSON file ({\"tiles\", \"forms\"}, as "
                         "_runtime.record_launches collects them) instead of epkit's record "
                         "(epkit.triton.launched)")
    ap.add_argument("--record", metavar="PATH", nargs="?", const=LAUNCHED, default=None,
                    help="run tests/triton at a GPU launch's tile sizes, record every launch's form "
                         "and write the record (default: production/triton/launched.py)")
    ap.add_argument("--only", metavar="TEXT", default=None,
                    help="only the specialisations whose name contains TEXT")
    ap.add_argument("--jobs", metavar="N", type=int, default=min(4, os.cpu_count() or 1),
                    help="compiling processes at most (one per 32 compilations)")
    return ap


# ----- declarations --------------------------------------------------------------------------

def _import(module: str):
    if module.endswith(".py"):
        name = "epkit_kernels_" + re.sub(r"\W", "_", os.path.abspath(module))
        spec = importlib.util.spec_from_file_location(name, module)
        if spec is None:
            raise ImportError(f"cannot import {module}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(module)


def declared(modules: list[str] | None):
    """The Specializations that ``modules`` declare at import (all of epkit.triton's kernel
    modules by default)."""
    from epkit.triton import _runtime

    before = len(_runtime.SPECIALIZATIONS)
    if modules:
        for module in modules:
            _import(module)
        return list(_runtime.SPECIALIZATIONS[before:])
    _runtime.kernel_modules()
    return list(_runtime.SPECIALIZATIONS)


def _resolve(name: str, modules: list):
    """The kernel ``module:function`` names: imported by module name, else found in one of the
    ``--module`` modules whose file is ``module``.py (a test's kernels)."""
    mod_name, _, fn = name.partition(":")
    for mod in modules:
        if os.path.splitext(os.path.basename(getattr(mod, "__file__", "") or ""))[0] == mod_name:
            return getattr(mod, fn)
    return getattr(importlib.import_module(mod_name), fn)


def _missing(name: str):
    """A stand-in for a recorded kernel that no longer exists (compile_one reports it)."""
    def missing():
        pass
    missing.__name__ = missing.__qualname__ = name.rsplit(":", 1)[-1]
    missing.missing = name
    return missing


def load_forms(path: str | None) -> dict:
    """The recorded launches: ``{"tiles": ..., "forms": [...]}`` from a JSON file written by a
    recording (``_runtime.record_launches``), or epkit's committed record
    (``epkit.triton.launched``) when ``path`` is None."""
    if path is None:
        from epkit.triton import launched

        return {"tiles": launched.TILES, "forms": launched.FORMS}
    with open(path) as f:
        return json.load(f)


def recorded(path: str | None, modules: list | None = None):
    """Specializations for the forms recorded in ``path`` (module docstring), named
    ``module.function[constexprs]`` (``#n`` where forms differ only in types or alignment)."""
    from epkit.triton import _runtime

    mods = [_import(m) for m in modules or []]
    out, seen = [], {}
    for form in load_forms(path)["forms"]:
        try:
            kernel = _resolve(form["kernel"], mods)
        except (ImportError, AttributeError):
            kernel = _missing(form["kernel"])
        mod, fn = form["kernel"].rsplit(":", 1)
        consts = ",".join(f"{k}={v}" for k, v in form["constexprs"].items())
        name = f"{mod.rsplit('.', 1)[-1]}.{fn}[{consts}]"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name += f"#{seen[name]}"
        signature, consts = dict(form["signature"]), dict(form["constexprs"])
        for one in form.get("ones", []):  # Triton's "equal to 1" specialisation
            signature[one], consts[one] = "constexpr", 1
        out.append(_runtime.Specialization(
            name, kernel, signature, {**consts, **form["options"]},
            exact=form.get("exact", True), aligned=tuple(form["aligned"])))
    return out


# ----- recording -----------------------------------------------------------------------------
LAUNCHED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "production", "triton", "launched.py")
# The workload: tests/triton at the GPU's tiles, derandomized, without the tests that run the
# gate or their kernels in child processes (their launches are not this process's, nor are they
# checked against the record).
RECORD_IGNORE = ("test_compile_gate.py", "test_defects.py", "test_switch.py")


def write_launched(forms: list, path: str = LAUNCHED) -> int:
    """Write ``epkit.triton.launched`` (the committed record) from recorded forms."""
    from epkit.triton import _runtime

    forms = _runtime.canonical(forms)
    lines = ['"""The launch forms of epkit\'s kernels, recorded from the Triton tests run at a GPU',
             "launch's tile sizes: what ``epkit kernels --compile`` compiles, and what every launch in",
             "tests/triton must be one of. Generated by ``epkit kernels --record``; do not edit.",
             '"""', "", 'TILES = "gpu"', "", "# fmt: off", "FORMS = ["]
    lines += [f"    {form!r}," for form in forms]
    lines += ["]", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return len(forms)


def _record(args) -> int:
    """Run the workload in a child (tests/triton of this checkout, at GPU tiles, derandomized)
    and write the record from its launches."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests = os.path.join(root, "tests", "triton")
    if not os.path.isdir(tests):
        print(f"epkit kernels --record: needs the source checkout's tests ({tests})", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="epkit-record-")
    try:
        out = os.path.join(tmp, "launches.json")
        # derandomized: a fixed seed, and no example database replaying earlier failures
        env = dict(os.environ, EPKIT_TILES="gpu", EPKIT_RECORD_LAUNCHES=out, EPKIT_LAUNCH_CHECK="0",
                   HYPOTHESIS_STORAGE_DIRECTORY=os.path.join(tmp, "hypothesis"))
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-m", "not slow and not cuda",
               "--hypothesis-seed=0", "-p", "no:cacheprovider", tests,
               *[f"--ignore={os.path.join(tests, name)}" for name in RECORD_IGNORE]]
        start = time.perf_counter()
        rc = subprocess.run(cmd, cwd=root, env=env).returncode
        if rc != 0 or not os.path.exists(out):
            print(f"epkit kernels --record: the workload failed (exit {rc}); nothing written",
                  file=sys.stderr)
            return 1
        raw = load_forms(out)["forms"]
        n = write_launched(raw, args.record)
        print(f"{len(raw)} launch forms recorded in {time.perf_counter() - start:.0f} s; "
              f"{n} to compile written to {args.record}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def specifications(modules: list[str] | None, launches: str | None, only: str | None = None):
    """What the gate compiles: the forms recorded in ``launches`` (epkit's committed record
    when neither ``launches`` nor ``modules`` is given) and the specialisations ``modules``
    declare."""
    specs = declared(modules) if modules else []
    if launches or not modules:
        specs += recorded(launches, modules)
    return [s for s in specs if not only or only in s.name]


def _where(kernel) -> str:
    if getattr(kernel, "missing", None):
        return kernel.missing
    fn = getattr(kernel, "fn", kernel)
    code = getattr(fn, "__code__", None)
    path = code.co_filename if code else "?"
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, root)
            break
    return f"{path}:{getattr(fn, '__name__', '?')}"


# ----- compiling -----------------------------------------------------------------------------

def _split(spec):
    """(kernel constexprs, launch options) from a specialisation's constexprs, as ``launch``
    passes them: names that are not kernel arguments are options of kernel[grid]."""
    arg_names = list(getattr(spec.kernel, "arg_names", []))
    constexprs = {k: v for k, v in spec.constexprs.items() if k not in LAUNCH_OPTIONS or k in arg_names}
    options = {k: v for k, v in spec.constexprs.items() if k not in constexprs}
    options.setdefault("enable_fp_fusion", False)  # as launch() does on a GPU
    signature = dict(spec.signature)
    for name in constexprs:
        signature.setdefault(name, "constexpr")
    attrs = {(arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.aligned}
    return signature, constexprs, options, attrs


def _cuobjdump(cubin: bytes, tmp: str) -> dict:
    """REG / STACK / SHARED / LOCAL from ``cuobjdump --dump-resource-usage`` (in the wheel)."""
    import triton

    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    tool = triton.knobs.nvidia.cuobjdump.path
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                         check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def _amd_metadata(asm: str) -> dict:
    keys = ("vgpr_count", "sgpr_count", "agpr_count", "vgpr_spill_count", "sgpr_spill_count",
            "private_segment_fixed_size", "group_segment_fixed_size")
    return {k: int(v) for k, v in re.findall(r"^\s*\.(" + "|".join(keys) + r"):\s+(\d+)", asm, re.M)}


def compile_one(spec, target_name: str, tmp: str) -> dict:
    """One row of the table: compile ``spec`` for ``target_name`` and check it."""
    import triton
    from triton.backends.compiler import GPUTarget

    from . import kernel_rules as rules

    backend, arch, warp, shared_limit = TARGETS[target_name]
    signature, constexprs, options, attrs = _split(spec)
    row = {"kernel": spec.name, "where": _where(spec.kernel), "target": target_name,
           "exact": bool(spec.exact), "registers": None, "spills": None, "scratch": None,
           "shared": None, "load_bytes": None, "store_bytes": None, "vector": None,
           "compile_ms": None, "violations": []}
    if getattr(spec.kernel, "missing", None):
        row["violations"].append({"rule": "does not compile: the recorded kernel is gone (renamed "
                                          "or removed since it was recorded? epkit kernels --record)",
                                  "evidence": spec.kernel.missing})
        return row
    params = list(getattr(spec.kernel, "arg_names", []))
    if params and sorted(signature) != sorted(params):
        row["violations"].append({"rule": "does not compile: the form's arguments are not the "
                                          "kernel's (changed since it was recorded? epkit kernels --record)",
                                  "evidence": f"form {sorted(signature)}, kernel {sorted(params)}"})
        return row
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # ptxas -v's log (spills) is printed there
            compiled = triton.compile(triton.compiler.ASTSource(fn=spec.kernel, signature=signature,
                                                                constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget(backend, arch, warp), options=options)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is a failure to report
        row["compile_ms"] = round((time.perf_counter() - start) * 1e3)
        row["violations"].append({"rule": "does not compile", "evidence": f"{type(exc).__name__}: "
                                  + str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ""})
        return row
    row["compile_ms"] = round((time.perf_counter() - start) * 1e3)
    asm = compiled.asm
    found = rules.launch_option_violations(options, spec.exact)
    found += rules.ttir_violations(asm["ttir"]) + rules.ttir_barrier_violations(asm["ttir"])
    if spec.exact:
        found += rules.ttir_exact_violations(asm["ttir"]) + rules.ttir_reduce_violations(asm["ttir"])
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    if backend == "cuda":
        usage = _cuobjdump(asm["cubin"], tmp)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
        # Without the log (it cannot be missing while always_compile holds) the stack frame
        # stands in: it holds the spills, and seldom anything else in Triton's code.
        spills = (int(spill.group(1)) + int(spill.group(2))) if spill else usage.get("STACK", 0)
        row.update(registers=usage.get("REG"), spills=spills,
                   scratch=usage.get("STACK", 0) + usage.get("LOCAL", 0),
                   shared=max(shared, usage.get("SHARED", 0)))
        widths = rules.ptx_access_widths(asm["ptx"])
        if spec.exact:
            found += rules.ptx_violations(asm["ptx"]) + rules.llir_violations(asm["llir"])
        if spills:
            found.append((f"register spill ({spill.group(0) if spill else f'{spills} bytes of stack'})", ""))
    else:
        meta = _amd_metadata(asm["amdgcn"])
        spills = meta.get("vgpr_spill_count", 0) + meta.get("sgpr_spill_count", 0)
        row.update(registers=f"{meta.get('vgpr_count', '?')}v/{meta.get('sgpr_count', '?')}s",
                   spills=spills, scratch=meta.get("private_segment_fixed_size", 0),
                   shared=max(shared, meta.get("group_segment_fixed_size", 0)))
        widths = rules.amdgcn_access_widths(asm["amdgcn"])
        if spec.exact:
            found += rules.amdgcn_violations(asm["amdgcn"]) + rules.amd_llir_violations(asm["llir"])
        if spills:
            found.append((f"register spill ({meta.get('vgpr_spill_count', 0)} VGPR, "
                          f"{meta.get('sgpr_spill_count', 0)} SGPR)", ""))
    row.update(load_bytes=widths[0], store_bytes=widths[1], vector=constexprs.get(rules.ROW_VECTOR))
    found += rules.row_width_violations(constexprs, widths)
    if row["shared"] > shared_limit:
        found.append((f"shared memory / LDS {row['shared']} bytes over {target_name}'s {shared_limit}", ""))
    row["violations"] = [{"rule": r, "evidence": e} for r, e in found]
    return row


# ----- output --------------------------------------------------------------------------------

def _table(rows: list[dict]) -> str:
    head = ("kernel", "target", "registers", "spills", "scratch", "shared", "ld/st B", "VB",
            "compile ms", "rules")
    body = [(r["kernel"], r["target"], str(r["registers"] if r["registers"] is not None else "-"),
             str(r["spills"] if r["spills"] is not None else "-"),
             str(r["scratch"] if r["scratch"] is not None else "-"),
             str(r["shared"] if r["shared"] is not None else "-"),
             f"{r['load_bytes']}/{r['store_bytes']}" if r.get("load_bytes") is not None else "-",
             str(r.get("vector") or "-"), str(r["compile_ms"]),
             "ok" if not r["violations"] else f"{len(r['violations'])} broken")
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *body)]
    legend = ("registers: per thread (sm), VGPR/SGPR (gfx); spills: bytes stored + loaded (sm), "
              "registers spilled (gfx); scratch: stack + local / private segment bytes; shared: "
              "shared memory / LDS bytes per program; ld/st B: the widest global load / store in "
              "bytes; VB: a row mover's guaranteed row alignment in bytes (16: its rows must "
              "move 16 bytes at a time); compile ms: how long this compilation took")
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], legend])


_WORKER: dict = {}


def _worker_init(modules, launches, only, specs=None) -> None:
    """A compiling process: the specialisations (imported again in a spawned worker: kernels
    do not pickle, the declaration order is the same), the ptxas log on, a scratch directory."""
    import atexit

    import triton

    if specs is None:
        specs = specifications(modules, launches, only)
    triton.knobs.nvidia.dump_ptxas_log = True   # the ptxas -v log carries the spill counts
    triton.knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
    tmp = tempfile.mkdtemp(prefix="epkit-kernels-")
    atexit.register(shutil.rmtree, tmp, True)
    _WORKER.update(specs=specs, tmp=tmp)


def _worker_compile(index: int, name: str, target: str) -> dict:
    """Compile the specialisation the parent numbered ``index``, found again by name if the
    numbering differs here (a kernel module edited after the parent imported it)."""
    spec = _WORKER["specs"][index] if index < len(_WORKER["specs"]) else None
    if spec is None or spec.name != name:
        spec = next((s for s in _WORKER["specs"] if s.name == name), None)
    if spec is None:
        return {"kernel": name, "where": "?", "target": target, "exact": None, "registers": None,
                "spills": None, "scratch": None, "shared": None, "compile_ms": None,
                "violations": [{"rule": "declarations changed during the run (a kernel module was "
                                        "edited): run again", "evidence": ""}]}
    return compile_one(spec, target, _WORKER["tmp"])


def _compile_all(args, targets: list[str]) -> int:
    specs = _declared_or_report(args.module, args.launches, args.only)
    if specs is None:
        return 1
    if not specs:
        print("epkit kernels: no specialisation declared" + (f" matching {args.only!r}" if args.only else ""),
              file=sys.stderr)
        return 1
    # One compilation per distinct compiled form (two names may share one), spread over
    # processes: compiling is CPU-bound and each target's backend is single-threaded.
    keys = [(i, (id(spec.kernel), repr(sorted(spec.signature.items())),
                 repr(sorted(spec.constexprs.items())), spec.exact, spec.aligned, target))
            for i, spec in enumerate(specs) for target in targets]
    unique = {}
    for i, key in keys:
        unique.setdefault(key, (i, key[-1]))
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(unique), desc="compiling", unit="kernel", file=sys.stderr, leave=False)
    start = time.perf_counter()
    done: dict = {}
    # A spawned worker first imports torch, Triton and the kernels again (seconds): worth it
    # only over a few dozen compilations.
    jobs = max(1, min(args.jobs, len(unique) // 32))
    if jobs == 1:
        _worker_init(args.module, args.launches, args.only, specs)
        for key, (i, target) in unique.items():
            done[key] = _worker_compile(i, specs[i].name, target)
            if bar:
                bar.update()
    else:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(
                jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                initargs=(args.module, args.launches, args.only)) as pool:
            futures = {pool.submit(_worker_compile, i, specs[i].name, target): key
                       for key, (i, target) in unique.items()}
            for future in concurrent.futures.as_completed(futures):
                done[futures[future]] = future.result()
                if bar:
                    bar.update()
    if bar:
        bar.close()
    rows = [dict(done[key], kernel=specs[i].name) for i, key in keys]
    wall = time.perf_counter() - start
    print(_table(rows))
    broken = [r for r in rows if r["violations"]]
    print(f"\n{len(rows)} compilations ({len(specs)} specialisations x {len(targets)} targets, "
          f"{len(unique)} distinct) in {wall:.1f} s on {jobs} process(es); {len(broken)} break a rule")
    print(f"compiled for {', '.join(targets)}; not run on a GPU: this proves the kernels compile "
          "and that their assembly keeps the rules above, not their results or their speed "
          "(tests/triton, in Triton's interpreter, and scripts/gpu_check.sh on a GPU)")
    for r in broken:
        for v in r["violations"]:
            print(f"  {r['where']} [{r['kernel']}, {r['target']}]: {v['rule']}"
                  + (f"\n      {v['evidence']}" if v["evidence"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": targets, "wall_s": round(wall, 2), "rows": rows}, f, indent=1)
    return 1 if broken else 0


def _declared_or_report(modules, launches, only):
    """specifications(...), or None after saying which module does not import (a kernel module
    that breaks at import breaks every op it serves: a failure, not a usage error)."""
    try:
        return specifications(modules, launches, only)
    except Exception as exc:  # noqa: BLE001 - reported, with where it came from
        import traceback

        last = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"epkit kernels: a kernel module does not import: {type(exc).__name__}: {exc} "
              f"({last.filename}:{last.lineno})", file=sys.stderr)
        return None


def _list(args) -> int:
    specs = _declared_or_report(args.module, args.launches, args.only)
    if specs is None:
        return 1
    for s in specs:
        sig = ", ".join(f"{k}: {v}" for k, v in s.signature.items())
        const = ", ".join(f"{k}={v}" for k, v in s.constexprs.items())
        if s.aligned:
            sig += f"\n    16-byte aligned: {', '.join(s.aligned)}"
        print(f"{s.name}  ({_where(s.kernel)}, {'exact' if s.exact else 'not exact'})\n    {sig}"
              + (f"\n    {const}" if const else ""))
    print(f"{len(specs)} specialisations")
    return 0


def _reexec(argv: list[str]) -> int:
    """Run this command again in a child that imports Triton for compiling, with Triton's cache
    in a temporary directory."""
    cache = tempfile.mkdtemp(prefix="epkit-triton-cache-")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=cache, **{CHILD_ENV: "1"})
    try:
        return subprocess.run([sys.executable, "-m", "epkit.tools.kernels", *argv], env=env).returncode
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for a usage error
        return int(exc.code or 0)
    if args.record:
        return _record(args)
    if args.compile is None:
        return _list(args)
    targets = [t.strip() for t in args.compile.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown:
        print(f"epkit kernels: unknown target(s) {', '.join(unknown) or '(none given)'}; "
              f"known: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    if os.environ.get(CHILD_ENV) != "1":
        return _reexec(argv)
    return _compile_all(args, targets)


if __name__ == "__main__":
    sys.exit(main())
