"""The switch: ``EPKIT_KERNELS=triton`` puts the Triton kernels behind the ``epkit::`` ops for CPU
tensors (interpreted here), the default keeps the C++ kernels and never imports Triton, and a
wrong value is a clear error. Each case runs in a fresh process: the switch is read at load."""

import os
import subprocess
import sys

PROBE = r"""
import sys, torch
import epkit.ops
from epkit import triton as kernels
print("KEYS", ",".join(kernels.registered_keys()))
print("TRITON_IMPORTED", "triton" in sys.modules and hasattr(sys.modules["triton"], "jit"))
if kernels.registered_keys():
    import contextlib
    from epkit.triton import _runtime
    launches = []
    @contextlib.contextmanager
    def count(kernel, grid, args, constexprs):
        launches.append(kernel)
        yield
    _runtime.LAUNCH_HOOKS.append(count)
    print("INTERPRETED", _runtime.INTERPRETED)
torch.ops.epkit.quantize_mxfp8(torch.randn(4, 64))
idx = torch.tensor([[0, 1], [1, -1]])
torch.ops.epkit.layout(idx, 2, 1)
if kernels.registered_keys():
    print("LAUNCHES", len(launches))
"""


def _probe(kernels):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if kernels is None:
        env.pop("EPKIT_KERNELS", None)
    else:
        env["EPKIT_KERNELS"] = kernels
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                          timeout=300)


def _lines(out):
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def test_triton_kernels_serve_cpu_tensors():
    run = _probe("triton")
    assert run.returncode == 0, run.stderr[-3000:]
    got = _lines(run.stdout)
    assert got["KEYS"] == "CPU"
    assert got["INTERPRETED"] == "True"  # no GPU here: Triton's interpreter
    assert int(got["LAUNCHES"]) >= 1     # the ops ran Triton kernels, not the C++ ones


def test_default_keeps_cpp_and_never_imports_triton():
    run = _probe(None)
    assert run.returncode == 0, run.stderr[-3000:]
    got = _lines(run.stdout)
    assert got["KEYS"] == ""
    assert got["TRITON_IMPORTED"] == "False"


def test_a_wrong_value_is_named():
    run = _probe("cuda")
    assert run.returncode != 0
    assert "EPKIT_KERNELS='cuda': expected one of cpp, triton" in run.stderr
