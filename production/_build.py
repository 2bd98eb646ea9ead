"""Build and load the C++ extension (JIT, cached per machine by torch.utils.cpp_extension).

The first build takes about a minute on a 2-core machine; later imports reuse the cached
library (see :func:`build_directory`: inside the virtual environment by default) and take well
under a second. CUDA sources (``csrc/cuda/*.cu``, the ``TORCH_LIBRARY_IMPL(epkit, CUDA, ...)`` kernels)
join the build where torch has CUDA, ``nvcc`` exists and a GPU is visible, or, for a compile
check on a machine without a GPU, where ``EPKIT_FORCE_CUDA_BUILD=1`` (``make build-cuda``).

The CUDA build targets ``TORCH_CUDA_ARCH_LIST`` when set, else the visible GPUs' architecture
(torch's default; ``9.0`` on an H200), else ``9.0``. nvcc gets ``--fmad=false`` and no fast-math
flag, so every float32 multiply and add is rounded on its own, as in the CPU kernels.
``MAX_JOBS`` bounds the parallel compiles (ninja).
"""

from __future__ import annotations

import glob
import os
import sys
import threading
import time

import torch

_lock = threading.Lock()
_loaded = False

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
CUDA_CFLAGS = ["-O3", "--fmad=false", "-DEPKIT_WITH_CUDA", "-Xcompiler", "-ffp-contract=off",
               "-lineinfo"]


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

    if os.environ.get("EPKIT_FORCE_CUDA_BUILD") == "1":
        if torch.version.cuda is None or CUDA_HOME is None:
            raise RuntimeError("epkit: EPKIT_FORCE_CUDA_BUILD=1 needs a CUDA build of torch and nvcc "
                               f"(torch {torch.__version__}, CUDA_HOME {CUDA_HOME})")
        if not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
            raise RuntimeError(f"epkit: CUDA_HOME={CUDA_HOME} has no include/cuda_runtime.h; "
                               "set CUDA_HOME to the toolkit (e.g. /usr/local/cuda)")
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available()


STALE_LOCK_S = 600  # a build takes about a minute; a lock this old belongs to a dead build


def _clear_stale_lock(build_dir: str) -> None:
    """torch's build lock waits forever on a lock file left by a killed build: remove one that
    is far older than any build, and say so."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        # Some torch versions leave the lock behind after a good build: only a lock that no
        # finished build followed deserves a word.
        built = [os.path.getmtime(p) for p in glob.glob(os.path.join(build_dir, "*.so"))]
        if not built or max(built) < os.path.getmtime(lock):
            import warnings

            warnings.warn(f"epkit: removing a stale build lock ({age:.0f} s old): {lock}")
        try:
            os.remove(lock)
        except OSError:
            pass


def build_directory(name: str) -> str:
    """Where the extension is built and cached: per environment, so checkouts and virtual
    environments never rebuild over each other (they would share torch's default
    ``~/.cache/torch_extensions/<name>``, and one's build lock would block the others).
    ``EPKIT_BUILD_DIR`` overrides; else ``<venv>/epkit-build/<name>``; else, where the prefix
    is not writable, ``~/.cache/epkit/<hash of this source tree>/<name>``."""
    root = os.environ.get("EPKIT_BUILD_DIR")
    if not root:
        root = os.path.join(sys.prefix, "epkit-build")
        if not os.access(sys.prefix, os.W_OK):
            import hashlib

            tag = hashlib.sha1(CSRC.encode()).hexdigest()[:12]
            root = os.path.join(os.path.expanduser("~"), ".cache", "epkit", tag)
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path


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
        name = "epkit_C_cuda" if cuda else "epkit_C"
        build_dir = build_directory(name)
        _clear_stale_lock(build_dir)
        if cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # no GPU to ask: Hopper
        cpp_extension.load(
            name=name,
            build_directory=build_dir,
            sources=srcs,
            extra_cflags=CFLAGS + (["-DEPKIT_WITH_CUDA"] if cuda else []),
            extra_cuda_cflags=CUDA_CFLAGS,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[CSRC],
            is_python_module=False,
            verbose=verbose or os.environ.get("EPKIT_VERBOSE_BUILD") == "1",
        )
        _loaded = True


if __name__ == "__main__":  # `make build-cuda`: build (and load) the extension, say what it holds
    t0 = time.perf_counter()
    load(verbose=os.environ.get("EPKIT_VERBOSE_BUILD") == "1")
    cuda = cuda_build_wanted()
    names = [os.path.relpath(s, CSRC) for s in sources(cuda)]
    impls = torch._C._dispatch_dump("epkit::pack")
    print(f"epkit: built {'with' if cuda else 'without'} CUDA in {time.perf_counter() - t0:.0f} s: "
          f"{len(names)} sources ({', '.join(names)})")
    print("epkit: epkit::pack kernels:",
          ", ".join(k for k in ("CPU", "CUDA") if f"{k}: registered" in impls))
