"""``epkit.nn.named_expert_parameters`` names exactly the parameters of ``expert_parameters``,
under the qualified names ``model.named_parameters()`` gives them (what DDP's ignore list
takes, docs/usage.md). Run in a subprocess of its own: a world-size-1 gloo group."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = r'''
import sys
import torch
import torch.distributed as dist
import epkit.nn as enn

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.moe = enn.DenseMoE(8, 16, 4, 2, shared_expert=True)

model = torch.nn.Sequential(Block(), Block())
model = enn.to_expert_parallel(model)
named = list(enn.named_expert_parameters(model))
by_name = dict(model.named_parameters())
assert [p for _, p in named] == list(enn.expert_parameters(model)), "not the same parameters"
assert all(by_name[n] is p for n, p in named), [n for n, _ in named]
assert len(named) == 6 and {n.split(".")[0] for n, _ in named} == {"0", "1"}, named
layer = enn.ExpertParallelMoE(8, 16, 4, 2, False, None)
assert [n for n, _ in enn.named_expert_parameters(layer)] == [n for n, _ in layer.named_parameters()
                                                           if n.startswith("experts.")]
print(" ".join(n for n, _ in named))
dist.destroy_process_group()
'''


def test_named_expert_parameters(tmp_path):
    prog = tmp_path / "named.py"
    prog.write_text(PROGRAM)
    p = subprocess.run([sys.executable, str(prog), str(tmp_path / "store")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.split() == [f"{b}.moe.experts.{w}" for b in (0, 1) for w in ("w1", "w3", "w2")]
