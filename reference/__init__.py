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
    records.py     Layout, DispatchResult    (and Group, the option names)
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

from . import fast
from .accounting import combine_bytes, dispatch_bytes
from .backward import combine_backward, dispatch_backward
from .combine import combine
from .dispatch import dispatch
from .errors import InputError, Reason
from .exchange import exchange
from .fp8_block128 import dequantize_fp8_block128, quantize_fp8_block128
from .layout import layout
from .mxfp8 import dequantize_mxfp8, quantize_mxfp8
from .records import DispatchResult, Layout

__all__ = [
    "InputError", "Reason", "Layout", "DispatchResult", "layout", "dispatch", "combine",
    "dispatch_backward", "combine_backward", "exchange", "quantize_mxfp8", "dequantize_mxfp8",
    "quantize_fp8_block128", "dequantize_fp8_block128", "dispatch_bytes", "combine_bytes", "fast",
]
