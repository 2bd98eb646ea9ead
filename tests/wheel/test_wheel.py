"""A wheel carries its kernels: ``pip wheel . --no-build-isolation`` compiles
the CPU extension ahead of time; installed into a fresh virtual environment, the package runs
a dispatch with no compiler and no JIT build (setup.py, production/_build.py)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import re

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def _package_dirs() -> list:
    """Every folder pyproject.toml's package-dir names (so the copy never misses one)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        line = next(ln for ln in f if ln.startswith("package-dir"))
    return sorted(set(re.findall(r'= "([^"]+)"', line)))


TREE = ["pyproject.toml", "setup.py", "README.md", *_package_dirs()]

RUN = """
import os, sys, torch, torch.distributed as dist
import epkit
from epkit import _build
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
d = epkit.dispatch(torch.ones(3, 4), torch.tensor([[0, 1], [1, -1], [0, 1]]), torch.ones(3, 2),
                   num_experts=2)
out = epkit.combine(d.expert_x * 2, d)
want = torch.tensor([[4.0] * 4, [2.0] * 4, [4.0] * 4])  # sum over a token's slots of 1 * 2x
assert torch.equal(out, want), out
print("LOADED", _build.loaded_from)
print("EPKIT", os.path.dirname(epkit.__file__))
print("ROWS", d.expert_x.shape[0])
"""


# One worker runs this module (--dist loadgroup, pyproject.toml): its module fixture is
# costly, and under xdist every worker that took one of its tests would build it again.
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in TREE:
        path = os.path.join(ROOT, name)
        dst = src / name
        if os.path.isdir(path):
            shutil.copytree(path, dst, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(path, dst)
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, MAX_JOBS="2")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wheels = glob.glob(str(out / "epkit-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_carries_the_compiled_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    libs = [n for n in names if n.startswith("epkit/_C.") and n.endswith(".so")]
    assert libs, f"no compiled extension in the wheel: {names[:20]}"
    assert "epkit/csrc/epkit.h" in names  # the sources still travel (JIT with EPKIT_JIT=1)


def test_installed_wheel_runs_without_a_compiler(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # torch, numpy, ml_dtypes from this environment (no download); epkit from the wheel only:
    # a .pth adds this site-packages to the path without running its .pth files (so this
    # checkout's editable epkit stays invisible).
    site = next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))
    new_site = glob.glob(str(venv / "lib" / "python*" / "site-packages"))[0]
    with open(os.path.join(new_site, "deps.pth"), "w") as f:
        f.write(site + "\n")
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
                   check=True, timeout=300)
    nocc = tmp_path / "bin"
    nocc.mkdir()
    for cc in ("c++", "g++", "gcc", "cc", "ninja", "nvcc"):  # any compile attempt fails
        (nocc / cc).write_text("#!/bin/sh\necho no compiler here >&2; exit 1\n")
        (nocc / cc).chmod(0o755)
    env = dict(os.environ, PATH=f"{nocc}:{os.environ['PATH']}", CXX="/nonexistent",
               CC="/nonexistent", EPKIT_BUILD_DIR=str(tmp_path / "jit"))
    env.pop("PYTHONPATH", None)
    res = subprocess.run([py, "-c", RUN.format(port=29700 + os.getpid() % 200)],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path),
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = dict(ln.split(" ", 1) for ln in res.stdout.splitlines() if " " in ln)
    assert lines["EPKIT"].startswith(new_site), lines  # the wheel's epkit, not this checkout
    assert lines["LOADED"].startswith(os.path.join(new_site, "epkit", "_C.")), lines
    assert "epkit: building" not in res.stderr, res.stderr
    jit = tmp_path / "jit"
    assert not jit.exists() or not any(jit.rglob("*.so")), list(jit.rglob("*"))  # no JIT build
