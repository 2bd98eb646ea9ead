"""Every ```python block of README.md and docs/*.md runs exactly as it appears, so a reader can
paste it and a block that stops working fails CI.

A block is a whole program. One that calls ``init_process_group`` is written to a file and run
on two ranks, ``torchrun --nproc-per-node 2 --standalone block.py``, as the first lines of its
document tell the reader to; any other block runs in one process, ``python block.py``. Each runs
in a fresh temporary folder, with nothing defined beforehand. A block that is not meant to run
(a signature, a fragment that needs a framework's built layer) is fenced as ```text instead.
Blocks use tiny sizes; a torchrun launch (three processes importing torch) is most of a block's
cost. Measured with tests/docs on the 2-core machine under load (10 to 16): 171 s wall, 150 s of
CPU time, so about 80 to 90 s on two idle cores; under ``make test -n 2`` the blocks spread over
the workers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from doc_outputs import DOCS, ROOT

LAUNCH_TIMEOUT = 180  # s; a block takes a few seconds on two idle cores


def python_blocks(doc: str) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of every ```python block of ``doc`` (a path under
    ROOT), in order; a block indented under a list item is dedented."""
    lines = open(os.path.join(ROOT, doc)).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```python\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = len(m.group(1)), i + 1, []
        i += 1
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:] if lines[i].strip() else "")
            i += 1
        out.append((start, "\n".join(body) + "\n"))
        i += 1
    return out


def multi_rank(code: str) -> bool:
    return "init_process_group(" in code


BLOCKS = [(doc, line, code) for doc in DOCS for line, code in python_blocks(doc)]
README_FIRST = next((doc, line) for doc, line, _ in BLOCKS if doc == "README.md")


def test_blocks_found():
    """The parser finds the blocks (README's first program among them)."""
    assert any(doc == "README.md" and multi_rank(code) for doc, _, code in BLOCKS), BLOCKS[:1]


@pytest.mark.parametrize("doc", sorted({doc for doc, _, code in BLOCKS if multi_rank(code)}))
def test_doc_says_how_to_run_its_multi_rank_blocks(doc):
    """A document with a two-rank block tells the reader, before its first block, to run it
    under torchrun on two ranks."""
    text = open(os.path.join(ROOT, doc)).read()
    head = text[:text.index("```python")]
    assert "torchrun --nproc-per-node 2" in head, (
        f"{doc}: its Python blocks need `torchrun --nproc-per-node 2`; say so before the first one")


@pytest.mark.parametrize("doc,line,code", BLOCKS, ids=[f"{d}:{n}" for d, n, _ in BLOCKS])
def test_block_runs_as_pasted(doc, line, code, tmp_path):
    path = tmp_path / "block.py"
    path.write_text(code)
    if multi_rank(code):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        p = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{doc}:{line}: the block did not finish in {LAUNCH_TIMEOUT} s:\n"
                    f"{code}\n{(e.output or '')[-3000:]}")
    assert p.returncode == 0, (
        f"{doc}:{line}: the block failed (exit {p.returncode}) run as "
        f"`{' '.join(cmd[2:] if multi_rank(code) else cmd[1:])}`:\n{code}\n{p.stdout[-4000:]}")
    if (doc, line) == README_FIRST:
        # README's first program prints one line a rank that a person can check: its combine
        # equals the weighted sum done locally, bit for bit.
        # (unanchored: two ranks printing at once can run their lines together in the pipe)
        said = sorted(re.findall(r"rank (\d): (\d+) rows routed here, max \|out - expected\| = "
                                 r"([0-9.e+-]+|nan|inf)", p.stdout))
        assert [(r, d) for r, _, d in said] == [("0", "0.0"), ("1", "0.0")], p.stdout[-3000:]
