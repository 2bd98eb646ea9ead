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
from typing import Any, Callable

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["triton", "tl", "INTERPRETED", "launch", "Specialization", "SPECIALIZATIONS",
           "specialization", "cdiv", "LAUNCH_HOOKS"]

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
    compiled without multiply-add fusion (a fused sum differs from the spec's)."""
    if not all(g > 0 for g in grid):
        return
    if not INTERPRETED:
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
