"""The command outputs the docs quote: `make docs` reruns them into the docs, tests/docs checks them.

A quoted output sits between two marker comments, the command in the first:

    <!-- output: epkit verify --world-size 2 --examples 2 --seed 1 --no-progress -->
    ```text
    $ epkit verify --world-size 2 --examples 2 --seed 1 --no-progress
    ...what it printed...
    ```
    <!-- /output -->

``python tests/docs/doc_outputs.py`` (``make docs``) runs every such command from the repository
root, with this interpreter's ``bin`` folder (the venv's) first on PATH, and writes what it
printed on stdout between the markers (stderr holds progress, which a terminal shows and then
clears). test_doc_outputs.py reruns them and fails when a line differs, timings aside (``8.2s``
and the like are masked): a quoted output is for a deterministic command (``--seed``), quick
enough for the test (under about 30 s on two cores). A marker that reads
``<!-- output (make docs only): CMD -->`` is rerun by `make docs` and left out of the test, for a
slower command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))
MARKED = re.compile(r"<!-- output(?P<only> \(make docs only\))?: (?P<cmd>.+?) -->\n```text\n"
                    r"(?P<body>.*?)```\n<!-- /output -->", re.S)
TIMING = re.compile(r"\b\d+(\.\d+)?s\b")


def quoted(doc: str, tested_only: bool = True) -> list[tuple[int, str, str]]:
    """``(line, command, quoted output)`` of every marked output of ``doc`` (a path under ROOT),
    those marked "make docs only" too unless ``tested_only``; the quoted output without its
    ``$ command`` line."""
    text = open(os.path.join(ROOT, doc)).read()
    out = []
    for m in MARKED.finditer(text):
        if tested_only and m.group("only"):
            continue
        body = m.group("body")
        first, _, rest = body.partition("\n")
        assert first == f"$ {m.group('cmd')}", f"{doc}: the quoted output must start with `$ {m.group('cmd')}`"
        out.append((text.count("\n", 0, m.start()) + 1, m.group("cmd"), rest))
    return out


def run(cmd: str, timeout: float = 300) -> str:
    """What ``cmd`` prints on stdout, run from ROOT with the venv first on PATH; raises when it
    fails."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"`{cmd}` exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def masked(text: str) -> list[str]:
    """The lines of ``text`` with timings masked: what must repeat exactly."""
    return [TIMING.sub("<time>", ln.rstrip()) for ln in text.strip("\n").splitlines()]


def regenerate(doc: str) -> int:
    """Rerun every marked command of ``doc`` and write its output in; returns how many."""
    path = os.path.join(ROOT, doc)
    text = open(path).read()

    def fresh(m: re.Match) -> str:
        cmd = m.group("cmd")
        print(f"make docs: {doc}: {cmd}", flush=True)
        return (f"<!-- output{m.group('only') or ''}: {cmd} -->\n```text\n$ {cmd}\n"
                f"{run(cmd).strip(chr(10))}\n```\n<!-- /output -->")

    new, n = MARKED.subn(fresh, text)
    if new != text:
        open(path, "w").write(new)
    return n


if __name__ == "__main__":
    total = sum(regenerate(doc) for doc in DOCS)
    print(f"make docs: {total} quoted outputs rerun")
