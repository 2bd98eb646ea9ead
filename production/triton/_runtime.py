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
           "TILES_ENV", "TILE_CONSTEXPRS"]

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
    division, no flush-to-zero, no hardware float conversions in their assembly)."""

    name: str
    kernel: Any
    signature: dict
    constexprs: dict
    exact: bool = True


SPECIALIZATIONS: list[Specialization] = []


def specialization(name: str, kernel, signature: dict, constexprs: dict | None = None,
                   exact: bool = True) -> None:
    """Declare a specialisation the ops launch (kernel modules call this at import)."""
    SPECIALIZATIONS.append(Specialization(name, kernel, dict(signature), dict(constexprs or {}),
                                          exact))


# ----- tile sizes: the interpreter's or a GPU launch's -----------------------------------------
# A kernel module picks its tiles from INTERPRETED at import (``ROWS = 64 if INTERPRETED else
# 8``: the interpreter pays per operation and takes few, large programs; a GPU many small ones),
# or at call time (byterows.tile). gpu_tiles() gives the interpreted kernels the GPU's choice,
# so the tile sizes and program counts of a run are a GPU launch's: what the race checker must
# see (two programs can race only where there are two programs) and what the compile gate must
# compile. The module's own line stays the one source of each size.
TILES_ENV = "EPKIT_TILES"  # "gpu": tests/triton runs every test at the GPU's tiles
TILE_CONSTEXPRS = ("ROWS", "BLOCK", "BR")  # the launch constexprs that are tile sizes
_TILE_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)\s*=\s*(.+?)\s+if\s+INTERPRETED\s+else\s+(.+?)\s*(#.*)?$")
_TILES = ["gpu" if not INTERPRETED else "interpreter"]


def tiles() -> str:
    """``"interpreter"`` or ``"gpu"``: whose tile sizes the kernels launch with now."""
    return _TILES[0]


def kernel_modules() -> list:
    """Every kernel module of this package, imported."""
    import importlib
    import sys

    from . import OPS

    for module in sorted(set(OPS.values())):
        try:
            importlib.import_module(f"{__package__}.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{module}":
                raise
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
