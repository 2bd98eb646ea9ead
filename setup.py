"""Ahead-of-time build of epkit's C++ extension for wheels (pyproject.toml holds the metadata).

``pip wheel . --no-build-isolation`` (or ``python -m build --no-isolation``) compiles the CPU
kernels into ``epkit/_C*.so`` inside the wheel (the GPU kernels are Triton, compiled at run
time by the Triton that torch's CUDA wheels bring: nothing to build for them), with the flags of the JIT build (production/_build.py: one source of truth).
The installed package then loads that library and needs no compiler. Editable installs
(``pip install -e .``, the README's set-up) build nothing here: they keep the JIT build, which
recompiles what changed.

Build isolation would give setup.py an environment without torch (and pulling torch into it
would fetch a multi-GB CUDA wheel on a CPU machine), so without torch the wheel carries the
sources only and the extension is built at first import, as in development; the build says so.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _editable() -> bool:
    return any(cmd in sys.argv for cmd in ("editable_wheel", "develop"))


def _extensions():
    if _editable() or os.environ.get("EPKIT_NO_AOT") == "1" or "egg_info" in sys.argv:
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.stderr.write("epkit: no torch in the build environment: the wheel carries the "
                         "sources only (the kernels build at first import); for a wheel with "
                         "its kernels: pip wheel . --no-build-isolation\n")
        return [], {}
    spec = importlib.util.spec_from_file_location(
        "epkit_build", os.path.join(HERE, "production", "_build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    srcs = [os.path.relpath(s, HERE) for s in build.sources()]
    ext = CppExtension(name=f"epkit.{build.PREBUILT_NAME}", sources=srcs, include_dirs=[build.CSRC],
                       extra_compile_args={"cxx": build.CFLAGS}, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
