"""epkit.reference: the pure-NumPy multi-rank simulator that *is* the spec.

Every function takes per-rank lists (one entry per rank, ``R = len(xs)``) and returns per-rank
lists: it simulates the whole expert-parallel group in one process. docs/semantics.md is the
spec in prose; each module's docstring states its part exactly:

    abi.py         (every code and name table: reasons, dtypes, options, plan, wire format)
    errors.py      InputError, Reason        the message of every reason
    dtypes.py      (dtypes, dtype codes, the E4M3 helpers of the quantized payloads)
    mxfp8.py       quantize_mxfp8, dequantize_mxfp8
    fp8_block128.py  quantize_fp8_block128, dequantize_fp8_block128
    payloads.py    the payload table: how a row travels under payload=None / "mxfp8" /
                   "fp8_block128" (the rule of each quantized payload: the two modules above)
    records.py     Layout, DispatchResult    (and its Source, RankMajor; Group, the option names)
    exchange.py    exchange                  the all-to-all variants on raw row bytes, and the
                                             table of exchange= options
    validate.py    the checks, and which rank an InputError names
    arith.py       (exact float32 arithmetic shared by combine and the backward passes)
    capacity.py    (kept slots)              which slots a capacity keeps (both tiers)
    layout.py      layout                    the prepare step's counts; token rows after capacity
    expertmajor.py, rankmajor.py             the two output layouts of a rank
    transports/    the transports carried out for real, one class each behind one interface
                   (base.py): pairs.py, dedup.py (their shared body: direct.py), hier.py
    accounting.py  dispatch_bytes, combine_bytes   the bytes a transport moves, without moving
    dispatch.py    dispatch                  expert-major output (canonical), rank-major option
    combine.py     combine                   the ordered two-level sum
    backward.py    dispatch_backward, combine_backward
    fast.py        the same operations vectorized for scale (``epkit.reference.fast``)

Imports go one way, up this list: a module imports only modules above it (abi.py imports
nothing of epkit), at the top of the module; no import cycle.

Pure NumPy and ml_dtypes; never imports torch.
"""

import importlib
import sys
import types

# name -> the module that defines it, imported on first access (PEP 562): ``import epkit`` needs
# only InputError (errors.py, abi.py), not NumPy, ml_dtypes and every operation.
_LAZY = {
    "InputError": "errors", "Reason": "errors", "Layout": "records", "DispatchResult": "records",
    "layout": "layout", "dispatch": "dispatch", "combine": "combine",
    "dispatch_backward": "backward", "combine_backward": "backward", "exchange": "exchange",
    "quantize_mxfp8": "mxfp8", "dequantize_mxfp8": "mxfp8",
    "quantize_fp8_block128": "fp8_block128", "dequantize_fp8_block128": "fp8_block128",
    "dispatch_bytes": "accounting", "combine_bytes": "accounting", "fast": None,
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
        value = module if _LAZY[name] is None else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """The package's module type. An operation and its module share a name (``dispatch`` in
    dispatch.py): importing the module makes Python set the package's attribute to it, so the
    operation is kept there instead, as ``epkit.reference.dispatch(...)`` promises."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = list(_LAZY)
