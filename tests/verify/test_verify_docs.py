"""docs/verify.md's walk-through is the file the tests run: the page cannot drift from it."""

from __future__ import annotations

import re
from pathlib import Path

import epkit.verify
from epkit.verify import example_adapter

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_show_the_example_adapter_verbatim_and_it_is_short():
    text = (ROOT / "docs" / "verify.md").read_text()
    block = re.search(r"<!-- example_adapter.py -->\n```python\n(.*?)```", text, re.S)
    assert block, "the walk-through block is missing"
    source = Path(example_adapter.__file__).read_text()
    assert block.group(1) == source
    assert len(source.splitlines()) < 40


def test_the_docs_adapter_meets_bounded(pool):
    res = epkit.verify.check("epkit.verify.example_adapter:make", examples=20,
                             contract="bounded", pool=pool, seed=5)
    assert res.met("default") == "bounded"
    assert all(t.checked == t.requested for t in res.tallies["default"].values())
