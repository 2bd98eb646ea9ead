"""``epkit verify --backend nccl`` at world size 1 under torchrun: every mode against the
reference on CUDA tensors over NCCL (an NCCL-only group, as users launch it)."""

import json
import os
import subprocess
import sys

import pytest

import sim


pytestmark = [pytest.mark.cuda, sim.needs_cuda]


def test_verify_nccl_world_size_1(cuda_ext, tmp_path):
    report = tmp_path / "verify.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "epkit.verify", "--backend", "nccl", "--examples", "4", "--no-progress",
           "--shrink-seconds", "5", "--json", str(report)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert report.exists() and json.loads(report.read_text())
