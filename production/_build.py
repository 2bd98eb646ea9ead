"""Build and load the C++ extension (JIT, cached per machine by torch.utils.cpp_extension).

The first build takes about 40 s on 2 idle cores (minutes on a loaded machine; a few minutes
with the CUDA kernels) and says so on stderr, one line: what is built, where, about how long
(from the last build's time when there was one), then how long it took. Later imports reuse the
cached library (see :func:`build_directory`: inside the virtual environment by default)
silently and take well under a second. CUDA sources (``csrc/cuda/*.cu``, the ``TORCH_LIBRARY_IMPL(epkit, CUDA, ...)`` kernels)
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


def headers(cuda: bool) -> list[str]:
    pats = ["*.h"] + (["cuda/*.cuh"] if cuda else [])
    return sorted(p for pat in pats for p in glob.glob(os.path.join(CSRC, pat)))


def extension_name(cuda: bool) -> str:
    return "epkit_C_cuda" if cuda else "epkit_C"


def _object(build_dir: str, src: str) -> str:
    base = os.path.splitext(os.path.basename(src))[0]
    return os.path.join(build_dir, base + (".cuda.o" if src.endswith(".cu") else ".o"))


def stale_sources(build_dir: str, name: str, cuda: bool) -> list[str]:
    """The sources a build will compile: none while the cached library is newer than every
    source and header (then nothing is built and nothing is said); else those whose object
    file is missing or older than the source or a header (an estimate: ninja follows the
    real includes)."""
    lib = os.path.join(build_dir, f"{name}.so")
    srcs, hdrs = sources(cuda), headers(cuda)
    newest_header = max((os.path.getmtime(h) for h in hdrs), default=0.0)
    if os.path.exists(lib) and os.path.getmtime(lib) >= max(
            [newest_header] + [os.path.getmtime(p) for p in srcs]):
        return []
    out = []
    for p in srcs:
        obj = _object(build_dir, p)
        if not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(p), newest_header):
            out.append(p)
    return out


def _notice_lock(build_dir: str):
    """One notice per build, however many processes wait for it (a group's ranks importing
    epkit at once): the process that takes this lock speaks, the others wait silently for
    torch's build lock. Returns the open lock file, or None."""
    try:
        import fcntl

        f = open(os.path.join(build_dir, "epkit-notice.lock"), "w")
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


_LAST_BUILD = "epkit-seconds-per-source"  # the last build's seconds per compiled source


def _announce(build_dir: str, name: str, cuda: bool, stale: list[str]) -> float:
    """One line on stderr before a build: what, where, about how long."""
    n_all, n = len(sources(cuda)), len(stale)
    what = "the C++ extension" + (" with its CUDA kernels" if cuda else " (CPU kernels)")
    cores = os.cpu_count() or 1
    try:
        with open(os.path.join(build_dir, _LAST_BUILD)) as f:
            per_source = float(f.read())
        estimate = f"about {max(1, round(per_source * n))} s (as fast as the last build)"
    except (OSError, ValueError):  # measured: 8 sources in about 40 s on 2 idle cores
        estimate = ("a few minutes" if cuda else
                    f"about {max(5, round(10 * n / min(cores, n)))} s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > cores:
        estimate += f", longer at this load ({load:.1f} on {cores} cores)"
    verb = "building" if n == n_all else f"rebuilding {n} changed source(s) of {n_all} of"
    sys.stderr.write(f"epkit: {verb} {what} in {build_dir}, once: {estimate}; later imports "
                     "reuse it ...")
    sys.stderr.flush()
    return time.perf_counter()


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


# The library a wheel carries (setup.py builds it ahead of time), by whether it has CUDA kernels.
PREBUILT_NAMES = {False: "_C", True: "_C_cuda"}
loaded_from: str | None = None  # the library this process loaded


def prebuilt_library(cuda: bool) -> str | None:
    """The ahead-of-time library installed with the package (a wheel), if it matches the build
    this process wants (CPU, or with CUDA kernels); ``EPKIT_JIT=1`` ignores it."""
    if os.environ.get("EPKIT_JIT") == "1":
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, PREBUILT_NAMES[cuda] + ".*.so")))
    return found[0] if found else None


def sync_abi_header() -> bool:
    """Rewrite ``csrc/abi.h`` from reference/abi.py where it differs (a checkout whose Python
    side changed); returns whether it wrote. The file is checked in, so a build without the
    package importable (setup.py) compiles the same header; tests/reference/test_abi.py keeps
    the checked-in copy current."""
    try:
        from epkit.reference import abi
    except ImportError:  # run as a script where epkit is not installed (make build-cuda)
        return False
    path = os.path.join(CSRC, "abi.h")
    text = abi.render_header()
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:  # an installed, read-only tree: its header is the one it was built with
        return False
    return True


def load(verbose: bool = False) -> None:
    """Load the extension once per process: the wheel's prebuilt library where there is one,
    else the JIT build (building it first if the cache is stale); then the Triton kernels
    where they are wanted (CUDA, or ``EPKIT_KERNELS=triton``: ``epkit/triton``)."""
    _load_library(verbose)
    from .triton import register

    register()  # outside the build lock: the kernel modules import epkit modules that load()


def _load_library(verbose: bool) -> None:
    global _loaded, loaded_from
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        cuda = cuda_build_wanted()
        prebuilt = prebuilt_library(cuda)
        if prebuilt is not None:  # a wheel's: no compiler needed
            torch.ops.load_library(prebuilt)
            loaded_from, _loaded = prebuilt, True
            return
        sync_abi_header()
        srcs = sources(cuda)
        name = extension_name(cuda)
        build_dir = build_directory(name)
        _clear_stale_lock(build_dir)
        verbose = verbose or os.environ.get("EPKIT_VERBOSE_BUILD") == "1"
        stale = stale_sources(build_dir, name, cuda)
        notice = _notice_lock(build_dir) if stale else None
        t0 = _announce(build_dir, name, cuda, stale) if notice is not None else None
        if t0 is not None and verbose:
            sys.stderr.write("\n")
        if cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # no GPU to ask: Hopper
        try:
            _jit_load(cpp_extension, name, build_dir, srcs, cuda, verbose)
        except BaseException:
            if t0 is not None:
                sys.stderr.write(" failed\n")
            raise
        finally:
            if notice is not None:
                notice.close()  # releases the lock
        _loaded = True
        loaded_from = os.path.join(build_dir, f"{name}.so")
        if t0 is not None:
            took = time.perf_counter() - t0
            sys.stderr.write(f"{'epkit: build' if verbose else ''} done in {took:.0f} s\n")
            try:
                with open(os.path.join(build_dir, _LAST_BUILD), "w") as f:
                    f.write(f"{took / len(stale):.2f}")
            except OSError:
                pass


def _jit_load(cpp_extension, name, build_dir, srcs, cuda, verbose) -> None:
    cpp_extension.load(
        name=name,
        build_directory=build_dir,
        sources=srcs,
        extra_cflags=CFLAGS + (["-DEPKIT_WITH_CUDA"] if cuda else []),
        extra_cuda_cflags=CUDA_CFLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[CSRC],
        is_python_module=False,
        verbose=verbose,
    )


def build_info() -> dict:
    """What ``epkit version`` prints: the build this process would load (CPU or CUDA), where,
    its flags, and whether it loaded (loading it, building first if stale)."""
    cuda = cuda_build_wanted()
    name = extension_name(cuda)
    build_dir = build_directory(name)
    lib = os.path.join(build_dir, f"{name}.so")
    info = {"kind": "CUDA" if cuda else "CPU", "name": name, "directory": build_dir,
            "library": lib, "cflags": CFLAGS + (["-DEPKIT_WITH_CUDA"] if cuda else []),
            "cuda_cflags": CUDA_CFLAGS if cuda else None,
            "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if cuda else None,
            "sources": len(sources(cuda))}
    try:
        load()
        info["loaded"], info["error"] = True, None
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        text = str(exc).strip()
        if len(text) > 600:  # a compiler's output: its last lines
            text = "...\n" + text[-600:].split("\n", 1)[-1]
        info["loaded"], info["error"] = False, f"{type(exc).__name__}: {text}"
    if os.path.exists(lib):
        info["built_at"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(lib)))
    try:
        info["kernels"] = [k for k in ("CPU", "CUDA")
                           if f"{k}: registered" in torch._C._dispatch_dump("epkit::pack")]
    except RuntimeError:
        info["kernels"] = []
    return info


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
