"""examples/megatron_cpu.py and examples/torchtitan_cpu.py run as a user runs them
(``torchrun --nproc-per-node 2 examples/...``), outside their frameworks' trainers, and each
rank reports agreement with the framework's own dispatcher (the examples compare, and exit 1
when a tensor differs). The Megatron example runs against megatron-core 0.16.1 too
(test_megatron_versions.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def run_example(name: str, env=None) -> str:
    """What the example's ranks print on stdout. stderr (torch's warnings, torchrun's lines)
    is kept apart: merged into the same pipe it can land inside a rank's line; and the two
    ranks share stdout, so the checks look for each rank's line anywhere, not at line starts."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "examples", name)]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(env or os.environ, OMP_NUM_THREADS="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout


def test_megatron_example():
    pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (epkit[frameworks])")
    out = run_example("megatron_cpu.py")
    said = sorted(re.findall(r"rank (\d): megatron-core 0\.19\.2, (\d+) tensors compared with "
                             r"Megatron's own dispatcher: all bit for bit equal", out))
    assert [r for r, _ in said] == ["0", "1"] and all(int(n) >= 5 for _, n in said), out[-3000:]


def test_torchtitan_example():
    pytest.importorskip("torchtitan", reason="torchtitan is a test dependency (epkit[frameworks])")
    out = run_example("torchtitan_cpu.py")
    said = sorted(re.findall(r"rank (\d): output and expert gradients bit for bit equal to "
                             r"torchtitan's dispatcher; router and input gradients within "
                             r"([0-9.e+-]+) ", out))
    assert [r for r, _ in said] == ["0", "1"], out[-3000:]
    assert all(float(v) <= 1e-6 for _, v in said), said
