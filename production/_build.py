"""Build and load the C++ extension (JIT, cached per machine by torch.utils.cpp_extension).

The first build takes about a minute on a 2-core machine; later imports reuse the cached
library (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and take well under a
second. CUDA sources join the build only where torch has CUDA and ``nvcc`` exists.
"""

from __future__ import annotations

import glob
import os
import threading

import torch

_lock = threading.Lock()
_loaded = False

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]


def sources(cuda: bool) -> list[str]:
    srcs = [os.path.join(CSRC, "registration.cpp")]
    srcs += sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    if cuda:
        srcs += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    return srcs


def cuda_build_wanted() -> bool:
    if os.environ.get("EPKIT_NO_CUDA") == "1":
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available()


def load(verbose: bool = False) -> None:
    """Load the extension once per process (building it first if the cache is stale)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        cuda = cuda_build_wanted()
        srcs = sources(cuda)
        cpp_extension.load(
            name="epkit_C_cuda" if cuda else "epkit_C",
            sources=srcs,
            extra_cflags=CFLAGS + (["-DEPKIT_WITH_CUDA"] if cuda else []),
            extra_cuda_cflags=["-O3", "--fmad=false", "-DEPKIT_WITH_CUDA"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[CSRC],
            is_python_module=False,
            verbose=verbose or os.environ.get("EPKIT_VERBOSE_BUILD") == "1",
        )
        _loaded = True
