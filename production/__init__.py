"""epkit: expert-parallel dispatch and combine for PyTorch.

``import epkit`` is cheap and torch-free until a torch-backed name is touched, so that
``epkit.reference`` (pure NumPy, the spec) never pulls torch in.
"""

from ._version import __version__
from epkit.reference.errors import InputError

# name -> module that defines it; resolved on first access (PEP 562).
_LAZY = {
    "dispatch": "epkit.api",
    "combine": "epkit.api",
    "Dispatcher": "epkit.api",
    "Dispatch": "epkit.api",
    "DispatchOptions": "epkit.options",
    "layout": "epkit.api",
    "group_of_one": "epkit.api",
    "quantize_mxfp8": "epkit.payloads.mxfp8",
    "dequantize_mxfp8": "epkit.payloads.mxfp8",
    "quantize_fp8_block128": "epkit.payloads.fp8_block128",
    "dequantize_fp8_block128": "epkit.payloads.fp8_block128",
    "PendingDispatch": "epkit.lazy",
    "PendingCombine": "epkit.lazy",
    "exchange": "epkit.row_exchange",
    "PeerError": "epkit.collectives",
    "topk_from_routing_map": "epkit.routing",
    "routing_map_from_topk": "epkit.routing",
    "nn": "epkit.nn",  # a subpackage: the module itself (MoE layers)
    "payloads": "epkit.payloads",  # a subpackage: the payload table
}

__all__ = ["__version__", "InputError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        value = module if name in ("nn", "payloads") else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epkit' has no attribute {name!r}")
