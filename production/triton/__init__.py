"""epkit's GPU kernels, written in Triton: one module per operation, mirroring ``csrc/cpu/``.

Each module defines, for the ops of its C++ counterpart, a function with the op's name and
schema (``reduce_tokens(back, send_map, ...)``) that launches Triton kernels, plus the
device-generic torch ops that do the integer bookkeeping without a host read. They are
registered for the ``CUDA`` dispatch key of the same ``epkit::`` ops, behind the same fakes
(``production/fakes.py``), so autograd, ``torch.compile``, the static exchange and CUDA graphs see
no difference. No CUDA toolkit and no compiler are needed: torch's CUDA wheels bring Triton.

``EPKIT_KERNELS=triton`` (read when epkit loads its kernels) registers the same functions for
CPU tensors as well, replacing the C++ CPU kernels: without a GPU they then run in Triton's
interpreter (``_runtime.py`` sets ``TRITON_INTERPRET=1`` before Triton is imported), so the
whole library above the kernels, collectives over gloo included, runs the GPU code path on
any machine (``epkit verify --kernels triton``). ``EPKIT_KERNELS=cpp`` (the default) keeps the
C++ kernels on CPU.

| module | ops | C++ counterpart |
| --- | --- | --- |
| ``layout`` | layout, prepare | cpu/layout.cpp |
| ``plan`` | plan | cpu/plan.cpp |
| ``pack`` | pack, pack_into, scatter_rows, scatter_rows_into | cpu/pack.cpp |
| ``unpack`` | unpack | cpu/unpack.cpp |
| ``combine`` | gather_rows, gather_units, reduce_tokens | cpu/combine.cpp |
| ``backward`` | combine_backward_dest, gather_slot_values, scatter_slot_values | cpu/backward.cpp |
| ``mxfp8``, ``fp8_block128`` | quantize_mxfp8, quantize_fp8_block128 | cpu/mxfp8.cpp, cpu/fp8_block128.cpp |
| ``alloc`` | empty_large | cpu/alloc.cpp |

What differs by transport is not in these modules but in one module per transport path,
``pairs`` and ``dedup`` (as DeepEP splits its kernels into intranode and internode), behind one
interface; ``transports`` is their table and resolves an op's ``transport`` code.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Callable

__all__ = ["OPS", "ENV", "mode", "implementations", "register", "registered_keys"]

ENV = "EPKIT_KERNELS"
MODES = ("cpp", "triton")

# op name -> the module of this package that implements it (a function of the op's name).
OPS: dict[str, str] = {
    "layout": "layout", "prepare": "layout",
    "plan": "plan",
    "pack": "pack", "pack_into": "pack", "scatter_rows": "pack", "scatter_rows_into": "pack",
    "unpack": "unpack",
    "gather_rows": "combine", "gather_units": "combine", "reduce_tokens": "combine",
    "combine_backward_dest": "backward", "gather_slot_values": "backward",
    "scatter_slot_values": "backward",
    "quantize_mxfp8": "mxfp8", "quantize_fp8_block128": "fp8_block128",
    "empty_large": "alloc",
}

_library = None  # the torch.library.Library holding the registrations (kept alive)
_keys: tuple[str, ...] = ()


def mode() -> str:
    """``EPKIT_KERNELS``: ``cpp`` (default) or ``triton``; anything else is an error."""
    value = os.environ.get(ENV, "cpp").strip().lower() or "cpp"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def implementations() -> tuple[dict[str, Callable], list[str]]:
    """``(op name -> Triton implementation, ops without one)``; imports the kernel modules."""
    found, missing = {}, []
    for op, module in OPS.items():
        try:
            mod = importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{module}":
                raise
            missing.append(op)
            continue
        fn = getattr(mod, op, None)
        (missing.append(op) if fn is None else found.__setitem__(op, fn))
    return found, missing


def registered_keys() -> tuple[str, ...]:
    """The dispatch keys the Triton kernels are registered for in this process."""
    return _keys


def register() -> tuple[str, ...]:
    """Register the Triton kernels for CUDA (where torch has a GPU) and, with
    ``EPKIT_KERNELS=triton``, for CPU; once per process, after the C++ library (which defines
    the op schemas) is loaded. Imports nothing when there is nothing to register, so a CPU
    machine on the default C++ kernels never pays for importing Triton."""
    global _library, _keys
    if _library is not None:
        return _keys
    import torch

    keys = (["CPU"] if mode() == "triton" else []) + (["CUDA"] if torch.cuda.is_available() else [])
    if not keys:
        return ()
    try:
        from . import _runtime  # noqa: F401  (decides compiled or interpreted, before any kernel)

        found, missing = implementations()
    except ImportError as exc:
        if "CPU" in keys:
            raise ImportError(f"{ENV}=triton needs Triton (pip install triton): {exc}") from exc
        warnings.warn(f"epkit: Triton is not importable ({exc}); CUDA tensors have no epkit "
                      "kernels (torch's CUDA wheels bring Triton)")
        return ()
    if missing:
        warnings.warn(f"epkit: no Triton kernel yet for {', '.join(missing)}: "
                      f"{'the C++ CPU kernel serves them' if 'CPU' in keys else 'CUDA lacks them'}")
    lib = torch.library.Library("epkit", "IMPL")
    with warnings.catch_warnings():
        # Replacing the C++ CPU kernels is the point of EPKIT_KERNELS=triton, not a mistake.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for op, fn in found.items():
            for key in keys:
                lib.impl(op, fn, key)
    _library, _keys = lib, tuple(keys)
    return _keys
