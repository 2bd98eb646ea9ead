"""Build and load the C++ extension (JIT, cached per machine by torch.utils.cpp_extension).

The extension holds the op schemas and the CPU kernels only: the GPU kernels are Triton
(``epkit/triton``), registered by :func:`load` after the library, so a GPU machine needs no
CUDA toolkit and no compiler beyond the C++ one for this CPU build.

The first build takes about a minute on 2 idle cores (minutes on a loaded machine) and says so
on stderr, one line: what is built, where, about how long (from the last build's time when
there was one), then how long it took. Later imports reuse the cached library (see
:func:`build_directory`: inside the virtual environment by default) silently and take well
under a second. ``MAX_JOBS`` bounds the parallel compiles (ninja).
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
NAME = "epkit_C"  # the JIT build's library name
PREBUILT_NAME = "_C"  # a wheel's ahead-of-time library: epkit/_C.*.so (setup.py)


def sources() -> list[str]:
    srcs = [os.path.join(CSRC, "registration.cpp")]
    srcs += sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    return srcs


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


def headers() -> list[str]:
    found = glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "cpu", "*.h"))
    return sorted(found)


def _object(build_dir: str, src: str) -> str:
    return os.path.join(build_dir, os.path.splitext(os.path.basename(src))[0] + ".o")


def stale_sources(build_dir: str, name: str = NAME) -> list[str]:
    """The sources a build will compile: none while the cached library is newer than every
    source and header (then nothing is built and nothing is said); else those whose object
    file is missing or older than the source or a header (an estimate: ninja follows the
    real includes)."""
    lib = os.path.join(build_dir, f"{name}.so")
    srcs, hdrs = sources(), headers()
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


def _announce(build_dir: str, stale: list[str]) -> float:
    """One line on stderr before a build: what, where, about how long."""
    n_all, n = len(sources()), len(stale)
    what = "the C++ extension (CPU kernels)"
    cores = os.cpu_count() or 1
    try:
        with open(os.path.join(build_dir, _LAST_BUILD)) as f:
            per_source = float(f.read())
        estimate = f"about {max(1, round(per_source * n))} s (as fast as the last build)"
    except (OSError, ValueError):  # measured: 10 sources in about 100 s on 2 idle cores
        estimate = f"about {max(5, round(20 * n / min(cores, n)))} s"
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


loaded_from: str | None = None  # the library this process loaded


def prebuilt_library() -> str | None:
    """The ahead-of-time library installed with the package (a wheel), if any;
    ``EPKIT_JIT=1`` ignores it."""
    if os.environ.get("EPKIT_JIT") == "1":
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, PREBUILT_NAME + ".*.so")))
    return found[0] if found else None


def sync_abi_header() -> bool:
    """Rewrite ``csrc/abi.h`` from reference/abi.py where it differs (a checkout whose Python
    side changed); returns whether it wrote. The file is checked in, so a build without the
    package importable (setup.py) compiles the same header; tests/reference/test_abi.py keeps
    the checked-in copy current."""
    try:
        from epkit.reference import abi
    except ImportError:  # run as a script where epkit is not installed
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

        prebuilt = prebuilt_library()
        if prebuilt is not None:  # a wheel's: no compiler needed
            torch.ops.load_library(prebuilt)
            loaded_from, _loaded = prebuilt, True
            return
        sync_abi_header()
        srcs, name = sources(), NAME
        build_dir = build_directory(name)
        _clear_stale_lock(build_dir)
        verbose = verbose or os.environ.get("EPKIT_VERBOSE_BUILD") == "1"
        stale = stale_sources(build_dir, name)
        notice = _notice_lock(build_dir) if stale else None
        t0 = _announce(build_dir, stale) if notice is not None else None
        if t0 is not None and verbose:
            sys.stderr.write("\n")
        try:
            _jit_load(cpp_extension, name, build_dir, srcs, verbose)
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


def _jit_load(cpp_extension, name, build_dir, srcs, verbose) -> None:
    cpp_extension.load(
        name=name,
        build_directory=build_dir,
        sources=srcs,
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[CSRC],
        is_python_module=False,
        verbose=verbose,
    )


def build_info() -> dict:
    """What ``epkit version`` prints: the C++ build this process loads (loading it, building
    first if stale), where, its flags, and which kernels serve each device: the C++ CPU
    kernels, and the Triton kernels where they are registered (CUDA, or CPU under
    ``EPKIT_KERNELS=triton``, interpreted without a GPU)."""
    build_dir = build_directory(NAME)
    lib = os.path.join(build_dir, f"{NAME}.so")
    info = {"kind": "CPU", "name": NAME, "directory": build_dir, "library": lib,
            "cflags": CFLAGS, "sources": len(sources())}
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
    from . import triton as kernels

    triton_keys = kernels.registered_keys()
    info["kernels"] = {"CPU": "triton" if "CPU" in triton_keys else "C++",
                       "CUDA": "triton" if "CUDA" in triton_keys else None}
    info["triton_interpreted"] = (os.environ.get("TRITON_INTERPRET") == "1") if triton_keys else None
    return info
