"""After ``dist.destroy_process_group()`` epkit keeps no process group alive: no gloo thread of
a destroyed group runs on into the interpreter's teardown, where it can abort the process
(SIGABRT, ``terminate called without an active exception``; docs/usage.md, "Troubleshooting").

Two things used to keep the default group alive: torch.distributed.nn.functional's default
arguments (``group=group.WORLD``, evaluated at its import, which an epkit op's first call
triggers through torch._dynamo) and the strong reference of every Dispatcher, Dispatch and
layer. The program below runs the README's steps and a layer in one process (world size 1,
a FileStore), keeps every result in scope, destroys the group and reports whether the group
object is gone. scripts/exit_stress.py measures the abort itself (many two-rank runs).
"""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = r'''
import gc, sys, weakref
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import epkit
import epkit.nn as enn

T, H, E, K = 8, 16, 4, 2
x = torch.randn(T, H, requires_grad=True)
topk_weights, topk_idx = torch.rand(T, E).softmax(1).topk(K)
d = epkit.dispatch(x, topk_idx, topk_weights, num_experts=E)
out = epkit.combine(d.expert_x * 2.0, d)
out.sum().backward()
torch.manual_seed(0)
layer = enn.ExpertParallelMoE(H, 32, E, K, True, None)
layer(torch.randn(T, H)).sum().backward()
import torch.distributed.nn.functional  # noqa: F401  (what torch._dynamo imports)
import torch._dynamo  # noqa: F401

alive = weakref.ref(dist.group.WORLD)
dist.barrier()
dist.destroy_process_group()
gc.collect()
print("group freed" if alive() is None else f"group alive: {sys.getrefcount(alive()) - 1} references")
try:
    d.handle.config.group
    print("no error after destroy")
except RuntimeError as e:
    print("error:", e)
try:
    layer.group
    print("no error after destroy")
except RuntimeError as e:
    print("error:", e)
'''


def test_destroy_frees_the_group(tmp_path):
    prog = tmp_path / "teardown.py"
    prog.write_text(PROGRAM)
    p = subprocess.run([sys.executable, str(prog), str(tmp_path / "store")], cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "group freed", p.stdout
    assert lines[1].startswith("error: epkit: this Dispatcher's process group was destroyed"), p.stdout
    assert lines[2].startswith("error: epkit: this ExpertParallelMoE's process group was destroyed"), p.stdout
