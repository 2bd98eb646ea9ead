"""The command outputs the docs quote (between ``<!-- output: CMD -->`` markers) are what the
commands print today, timings aside; `make docs` rewrites them (tests/docs/doc_outputs.py)."""

from __future__ import annotations

import difflib

import pytest

from doc_outputs import DOCS, masked, quoted, run

QUOTED = [(doc, line, cmd, body) for doc in DOCS for line, cmd, body in quoted(doc)]


def test_verify_sample_is_marked():
    """docs/verify.md's sample run is one of them (the parser finds the markers)."""
    assert any(doc == "docs/verify.md" for doc, *_ in QUOTED)


@pytest.mark.parametrize("doc,line,cmd,body", QUOTED, ids=[f"{d}:{n}" for d, n, _, _ in QUOTED])
def test_quoted_output_is_current(doc, line, cmd, body):
    want, got = masked(body), masked(run(cmd))
    assert got == want, (
        f"{doc}:{line}: `{cmd}` no longer prints what the doc quotes (`make docs` rewrites it):\n"
        + "\n".join(difflib.unified_diff(want, got, "quoted", "printed", lineterm="")))
