"""Triton for epkit's kernels: decides, before any kernel is defined, whether they are compiled
for a GPU or run in Triton's interpreter, and holds what every kernel module shares.

Triton chooses at *decoration* time (``@triton.jit`` reads ``TRITON_INTERPRET`` then): a
kernel decorated while the variable is ``1`` is an interpreted function that runs on CPU
tensors; otherwise it is compiled for the GPU of its tensors. So this module sets
``TRITON_INTERPRET=1`` on a machine without a GPU before importing triton, unless the caller
set it (``TRITON_INTERPRET=0``: compile only, as ``epkit kernels --compile`` does), and every
kernel module imports ``triton`` / ``tl`` from here.

Rules every kernel follows (../../docs/design.md, "GPU kernels"; they keep the spec's bits on
the interpreter and on the GPU alike):
- offsets are int64 from the first product: ``tl.program_id(0).to(tl.int64)``;
- float sums are written-out sequential loops from +0.0 in the spec's order (``tl.sum`` only
  for integers), exact kernels are compiled with ``enable_fp_fusion=False`` and divide with
  ``tl.div_rn``;
- conversions between float formats are done on the bits (``bits.py``), never with ``.to()``;
- one writer per output byte, and no program reads what another program of the same launch
  writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Any, Callable

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["triton", "tl", "INTERPRETED", "launch", "Specialization", "SPECIALIZATIONS",
           "specialization", "cdiv", "LAUNCH_HOOKS", "gpu_tiles", "tiles", "gpu_constants",
           "TILES_ENV", "TILE_CONSTEXPRS", "SIZE_CONSTEXPRS", "kernel_modules", "kernel_name",
           "launch_form", "form_key", "canonical", "record_launches", "check_recorded",
           "UnrecordedLaunch", "vb16"]

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

if INTERPRETED and isinstance(tl.zeros, triton.runtime.jit.JITFunction):
    # Triton's own library (tl.zeros, tl.where, ...) was decorated for compiling: Triton was
    # imported (by torch.compile's inductor, say) before this module could choose the
    # interpreter, and an interpreted kernel would fail on its first library call.
    raise ImportError(
        "epkit: Triton was imported before epkit could select its interpreter (no GPU here): "
        "set TRITON_INTERPRET=1 in the environment, or import epkit's kernels first")

if INTERPRETED:
    import warnings

    # The interpreter computes with NumPy, which warns on NaN and infinity arithmetic; those
    # are values the spec gives exact results for (and the tests plant), not mistakes.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

cdiv = triton.cdiv

# Context-manager factories entered as hook(kernel, grid, args, constexprs) around every
# launch (the tests' race checker installs one); empty in production.
LAUNCH_HOOKS: list[Callable] = []


def launch(kernel, grid, *args, **constexprs) -> None:
    """Launch ``kernel`` over ``grid`` (a tuple of program counts; an empty grid launches
    nothing); every epkit kernel goes through here, so one hook sees every launch. Kernels are
    compiled without multiply-add fusion (a fused sum differs from the spec's); the option is
    passed to the interpreter too (it ignores it), so a hook sees the launch options a GPU gets."""
    if not all(g > 0 for g in grid):
        return
    constexprs.setdefault("enable_fp_fusion", False)
    with contextlib.ExitStack() as stack:
        for hook in LAUNCH_HOOKS:
            stack.enter_context(hook(kernel, grid, args, constexprs))
        kernel[grid](*args, **constexprs)


@dataclasses.dataclass(frozen=True)
class Specialization:
    """One compiled form of a kernel, as the ops launch it: what ``epkit kernels --compile``
    compiles for each target. ``signature`` maps every argument to its Triton type
    (``"*fp32"``, ``"*u8"``, ``"i64"``, ``"constexpr"``); ``constexprs`` gives the constexpr
    values; ``exact`` kernels must keep the spec's bits (no fused multiply-add, no approximate
    division, no flush-to-zero, no hardware float conversions in their assembly). The gate
    compiles the forms recorded from launches (``launched.py``, ``launch_form``); a declaration
    is for kernels outside that record (the gate's own planted tests)."""

    name: str
    kernel: Any
    signature: dict
    constexprs: dict
    exact: bool = True
    aligned: tuple = ()  # arguments specialised 16-byte aligned / divisible by 16, as a launch's


SPECIALIZATIONS: list[Specialization] = []


def specialization(name: str, kernel, signature: dict, constexprs: dict | None = None,
                   exact: bool = True, aligned: tuple = ()) -> None:
    """Declare a specialisation. The gate compiles declarations only for ``epkit kernels
    --module`` (its own planted kernels); epkit's launches are compiled from their record
    (``launched.py``), so the kernel modules' declarations are no longer what is checked.
    ``aligned``: the arguments compiled as 16-byte aligned (as a launch would specialise them)."""
    SPECIALIZATIONS.append(Specialization(name, kernel, dict(signature), dict(constexprs or {}),
                                          exact, tuple(aligned)))


def vb16(H: int, *bufs: torch.Tensor) -> int:
    """A row kernel's ``VB`` over rows of H 2- or 4-byte elements: 16 when every row is whole
    16-byte pieces in every buffer (H a multiple of 8 and each buffer 16-byte aligned), else 1.
    (Byte rows, whose alignment may be any power of two, take byterows.write_rows' gcd.)"""
    return 16 if H % 8 == 0 and all(b.data_ptr() % 16 == 0 for b in bufs) else 1


# ----- tile sizes: the interpreter's or a GPU launch's -----------------------------------------
# A kernel module picks its tiles from INTERPRETED at import (``ROWS = 64 if INTERPRETED else
# 8``: the interpreter pays per operation and takes few, large programs; a GPU many small ones),
# or at call time (byterows.tile). gpu_tiles() gives the interpreted kernels the GPU's choice,
# so the tile sizes and program counts of a run are a GPU launch's: what the race checker must
# see (two programs can race only where there are two programs) and what the compile gate must
# compile. The module's own line stays the one source of each size.
TILES_ENV = "EPKIT_TILES"  # "gpu": tests/triton runs every test at the GPU's tiles
TILE_CONSTEXPRS = ("ROWS", "BLOCK", "BR", "TB", "KEYS", "BLOCKS")  # the launch constexprs that are tile sizes
# Constexprs whose value follows the data (a data dimension padded to a power of two: KP for
# top-k, CP for recv_map's columns, RP for the ranks; reduce, slot and places kernels): a
# launch may take a value the recording never saw, so the record's check takes any value of
# these (the gate compiles the largest recorded). A new one is added here by name. VB, a row
# mover's alignment (16 for every real model's rows), follows the data's sizes and pointers; WP
# a few plan sections' words (counts.py), padded to a power of two.
SIZE_CONSTEXPRS = ("KP", "CP", "RP", "VB", "WP")
_TILE_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)\s*=\s*(.+?)\s+if\s+INTERPRETED\s+else\s+(.+?)\s*(#.*)?$")
_TILES = ["gpu" if not INTERPRETED else "interpreter"]


def tiles() -> str:
    """``"interpreter"`` or ``"gpu"``: whose tile sizes the kernels launch with now."""
    return _TILES[0]


def kernel_modules() -> list:
    """Every kernel module of this package, imported: the modules beside this one (found on
    disk, so this bottom module imports nothing of the package above it)."""
    import importlib
    import pkgutil
    import sys

    for info in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))]):
        if info.name != __name__.rsplit(".", 1)[-1]:
            importlib.import_module(f"{__package__}.{info.name}")
    return [m for name, m in sorted(sys.modules.items())
            if m is not None and name.startswith(__package__ + ".") and name != __name__]


def gpu_constants(module) -> dict[str, Any]:
    """The GPU values of ``module``'s tile sizes: each top-level ``NAME = a if INTERPRETED
    else b`` line, ``b`` evaluated in the module."""
    import inspect

    out = {}
    for line in inspect.getsource(module).splitlines():
        m = _TILE_LINE.match(line)
        if m:
            out[m.group(1)] = eval(m.group(3), vars(module))  # noqa: S307 - the module's own source
    return out


@contextlib.contextmanager
def gpu_tiles(*modules):
    """Within: interpreted kernels launch with the tile sizes (and so the program counts) a GPU
    launch uses. Patches each kernel module of this package (and ``modules``): its tile-size
    constants to their GPU values, its ``INTERPRETED`` (read at call time for tiles) to False;
    restored on exit. A no-op where the kernels are compiled (they have the GPU's already)."""
    if not INTERPRETED or _TILES[0] == "gpu":
        yield
        return
    saved = []
    for module in [*kernel_modules(), *modules]:
        values = gpu_constants(module)
        if "INTERPRETED" in vars(module):
            values["INTERPRETED"] = False
        for name, value in values.items():
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
    _TILES[0] = "gpu"
    try:
        yield
    finally:
        _TILES[0] = "interpreter"
        for module, name, value in reversed(saved):
            setattr(module, name, value)


# ----- what is launched: the compiled form of each launch ------------------------------------
def _is_constexpr(param) -> bool:
    ann = param.annotation
    return ann is tl.constexpr or "constexpr" in str(ann)


def kernel_name(kernel) -> str:
    """``module:function`` of a kernel (interpreted or compiled)."""
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}:{fn.__qualname__}"


_PARAMS: dict = {}


def _params(fn) -> list:
    """``fn``'s parameters as (name, is constexpr, default or _NONE), cached (inspect is slow;
    a launch hook runs at every launch)."""
    params = _PARAMS.get(fn)
    if params is None:
        import inspect

        params = _PARAMS[fn] = [
            (p.name, _is_constexpr(p), _NONE if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values()]
    return params


_NONE = object()


def launch_form(kernel, args, constexprs) -> dict:
    """The compiled form a GPU launch of ``kernel`` with ``args`` / ``constexprs`` (as given to
    :func:`launch`) gets, by Triton's own rule (``native_specialize_impl``, as ``JITFunction``
    binds a launch): each argument's type (``*fp32``, ``i32``, ``i64``, ``u1``...), the pointers
    and integers it specialises as 16-byte aligned / divisible by 16 (``aligned``), the integers
    equal to 1 (``ones``: Triton makes them constexprs); the constexprs; the launch options
    (``num_warps``, ``enable_fp_fusion``...). Plain data (JSON), what ``epkit kernels --compile``
    compiles."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fn = getattr(kernel, "fn", kernel)
    params = _params(fn)
    signature, aligned, ones, consts = {}, [], [], {}
    for i, (name, is_constexpr, default) in enumerate(params):
        if name in constexprs:
            value = constexprs[name]
        elif i < len(args):
            value = args[i]
        elif default is not _NONE:
            value = default
        else:
            raise TypeError(f"{kernel_name(kernel)}: no value for {name}")
        if is_constexpr:
            signature[name], consts[name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr" and isinstance(value, int):  # Triton's "equal to 1" specialisation
            ty, spec = ("i64" if value >= 1 << 31 else "i32"), ""
            ones.append(name)
        signature[name] = ty
        if ty == "constexpr":
            consts[name] = spec
        elif spec == "D":
            aligned.append(name)
    options = {k: v for k, v in constexprs.items() if k not in signature}
    return {"kernel": kernel_name(kernel), "signature": signature, "aligned": aligned,
            "ones": ones, "constexprs": consts, "options": dict(sorted(options.items()))}


_INT_TYPES = ("i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")


def form_key(form: dict, with_tiles: bool = True, with_sizes: bool = True) -> str:
    """What identifies a launch site's form, as one string: the kernel, its pointer types, its
    constexprs, its launch options; not what the data decides (an integer's width and whether
    it is 1, the 16-byte alignment: ``canonical`` merges those). Without tiles: the tile-size
    constexprs left out too (a run at the interpreter's tiles against a GPU recording); without
    sizes: the SIZE_CONSTEXPRS' values."""
    sig = {k: "int" if v in _INT_TYPES else v for k, v in form["signature"].items()}
    consts = {k: v if with_sizes or k not in SIZE_CONSTEXPRS else "any"
              for k, v in form["constexprs"].items() if with_tiles or k not in TILE_CONSTEXPRS}
    return json.dumps([form["kernel"], sig, consts, form["options"]], sort_keys=True)


def canonical(forms) -> list[dict]:
    """One form per :func:`form_key` (sizes aside) for the gate to compile: the widest integer
    type seen for each argument, no "equal to 1" specialisation, every argument aligned that was
    aligned in some launch (a real model's launches: pointers 16-byte aligned, sizes multiples
    of 16, the case that decides the vector width), the largest value of each SIZE_CONSTEXPRS
    (the most registers; the numeric rules do not depend on it). Sorted: a recording gives one
    text."""
    merged: dict[str, dict] = {}
    for form in forms:
        key = form_key(form, True, False)
        if key not in merged:
            merged[key] = dict(form, signature=dict(form["signature"]),
                               constexprs=dict(form["constexprs"]),
                               aligned=list(form["aligned"]), ones=[])
            continue
        m = merged[key]
        for name, ty in form["signature"].items():
            if ty == "i64":
                m["signature"][name] = "i64"
        for name in SIZE_CONSTEXPRS:
            if name in form["constexprs"]:
                m["constexprs"][name] = max(m["constexprs"][name], form["constexprs"][name])
        m["aligned"] = sorted(set(m["aligned"]) | set(form["aligned"]),
                              key=list(m["signature"]).index)
    return [merged[k] for k in sorted(merged)]


class LaunchRecorder:
    """A launch hook that collects the distinct launch forms (:func:`record_launches`), each
    as launched (``canonical`` merges them per launch site form)."""

    def __init__(self, keep=None):
        self.forms: dict[str, dict] = {}
        self.keep = keep or (lambda kernel: True)

    @contextlib.contextmanager
    def __call__(self, kernel, grid, args, constexprs):
        if self.keep(kernel):
            form = launch_form(kernel, args, constexprs)
            self.forms.setdefault(json.dumps(form, sort_keys=True), form)
        yield


@contextlib.contextmanager
def record_launches(keep=None):
    """Within: every launch's form is recorded (``keep(kernel)`` chooses the kernels); yields
    the :class:`LaunchRecorder` (``.forms``: key -> form)."""
    recorder = LaunchRecorder(keep)
    LAUNCH_HOOKS.append(recorder)
    try:
        yield recorder
    finally:
        LAUNCH_HOOKS.remove(recorder)


class UnrecordedLaunch(AssertionError):
    """A launch whose form the committed record (``launched.py``) does not hold: the compile
    gate has not compiled what it launches."""


def check_recorded(forms, keep=None):
    """A launch hook that raises :class:`UnrecordedLaunch` for a launch whose :func:`form_key`
    (with the tile sizes when the kernels run at a GPU's tiles, without them at the
    interpreter's; any SIZE_CONSTEXPRS value) is not among ``forms``' (``keep(kernel)``: the
    kernels checked)."""
    known = {gpu: {form_key(f, gpu, False) for f in forms} for gpu in (True, False)}
    keep = keep or (lambda kernel: kernel_name(kernel).startswith("epkit."))

    @contextlib.contextmanager
    def hook(kernel, grid, args, constexprs):
        if keep(kernel):
            gpu = tiles() == "gpu"
            form = launch_form(kernel, args, constexprs)
            if form_key(form, gpu, False) not in known[gpu]:
                raise UnrecordedLaunch(
                    f"{form['kernel']} launched in a form the compile gate does not compile "
                    f"({'at GPU tiles' if gpu else 'tile sizes aside'}): signature "
                    f"{form['signature']}, constexprs {form['constexprs']}, options "
                    f"{form['options']}. If the launch is meant, record it: epkit kernels --record "
                    "(EPKIT_LAUNCH_CHECK=0 skips this check while a kernel is being written)")
        yield

    return hook
