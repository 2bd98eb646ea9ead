"""Every Python block of README.md, docs/usage.md and docs/migrating.md runs, in order, so a snippet that stops
working fails CI (issue 18 item 1).

Each file's blocks run in one namespace per rank, on every rank of a 2-rank gloo group (the
docs' multi-rank code needs peers; a one-rank block runs the same on both). The names the prose
assumes (``H``, ``x``, ``my_router``, a model, a data loader, ...) are defined by PREAMBLE, and
by SETUP for the block whose first code line is the key. A block the docs mark with an HTML
comment ``<!-- snippet: skip (reason) -->`` on the line before it is not run (none is today).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
FILES = ["README.md", "docs/usage.md", "docs/migrating.md"]

PREAMBLE = r'''
import torch
import torch.distributed as dist
import epkit
import epkit.nn as enn
from epkit.nn import DenseMoE

group = dist.group.WORLD
dist.init_process_group = lambda *a, **k: None    # the docs' own call: the group exists already
R, rank = dist.get_world_size(), dist.get_rank()
torch.manual_seed(0)
H, F, E, K, T, T_max = 32, 64, 4, 2, 6, 8
x = torch.randn(T, H)
topk_idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
topk_weights = torch.rand(T, K)


def my_router(x):
    return topk_idx, topk_weights


def my_experts(expert_x, expert_offsets):
    return expert_x.float() * 2.0


def shared_expert(x):
    return x * 0.5


class MyTransformer(torch.nn.Module):
    """Embedding -> DenseMoE -> vocabulary head: the smallest model with a DenseMoE inside."""

    # the docs write MyTransformer(...); sizes bound now (a later block rebinds F)
    def __init__(self, *placeholders, vocab=16, hidden=H, ffn=F):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.moe = DenseMoE(hidden=hidden, ffn_hidden=ffn, num_experts=E, top_k=K,
                            shared_expert=False)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.head(self.moe(self.embed(tokens)))


dense = DenseMoE(hidden=H, ffn_hidden=F, num_experts=E, top_k=K, shared_expert=False)
'''

SETUP = {
    # the training loop: F is torch.nn.functional there, and it needs data and an optimizer
    "for tokens, targets in loader:": r'''
F = torch.nn.functional
model = enn.to_expert_parallel(MyTransformer())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)
loader = [(torch.randint(0, 16, (2, 3), generator=gen), torch.randint(0, 16, (2, 3), generator=gen))
          for _ in range(2)]
global_tokens = 2 * 3 * R
''',
}

RUNNER = r'''
import datetime, json, sys, traceback
import torch.distributed as dist
rank, world, store_path, blocks_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
blocks = json.load(open(blocks_path))
ns = {"__name__": "__doc_snippets__"}
exec(blocks["preamble"], ns)
for i, (line, setup, code) in enumerate(blocks["blocks"]):
    try:
        exec(setup, ns)
        exec(compile(code, f"<block {i} at line {line}>", "exec"), ns)
    except BaseException:
        print(f"SNIPPET FAILED: block {i} (line {line}):\n{code}\n{traceback.format_exc()}")
        sys.exit(1)
dist.barrier()
print(f"rank {rank}: {len(blocks['blocks'])} blocks ran", flush=True)
dist.barrier()
# Skip interpreter teardown: gloo's threads can still be winding down when the process group
# is destroyed at exit ("terminate called without an active exception"): a harness race, not
# something the docs' code does.
import os
os._exit(0)
'''


def python_blocks(path: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```python block (indented ones dedented), in order."""
    lines = open(path).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```python\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = len(m.group(1)), i + 1, []
        skip = i > 0 and "<!-- snippet: skip" in lines[i - 1]
        i += 1
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:] if lines[i].strip() else "")
            i += 1
        if not skip:
            out.append((start + 1, "\n".join(body)))
        i += 1
    return out


def first_code_line(code: str) -> str:
    """The first line that holds code, without its comment (the key of SETUP)."""
    lines = (ln.split("#")[0].strip() for ln in code.splitlines())
    return next((ln for ln in lines if ln), "")


@pytest.mark.parametrize("doc", FILES)
def test_every_python_block_runs(doc, tmp_path):
    import json

    blocks = python_blocks(os.path.join(ROOT, doc))
    assert blocks, f"{doc} has no python block: the parser is broken"
    spec = {"preamble": PREAMBLE,
            "blocks": [(line, SETUP.get(first_code_line(code), ""), code) for line, code in blocks]}
    blocks_path = tmp_path / "blocks.json"
    blocks_path.write_text(json.dumps(spec))
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    store = tempfile.mktemp(dir=tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(runner), str(r), "2", store, str(blocks_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=ROOT) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{doc}: the snippets did not finish in 240 s")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{doc}, rank {r}:\n{out[-4000:]}"
        assert f"{len(blocks)} blocks ran" in out, out[-2000:]
