"""A toy fourth transport built from docs/design.md's recipe alone (toy_transport.py: its code,
one module per tier, one row per table) runs through the conformance suite, and the suite sees
a toy whose row lies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epkit.reference as ref

TOY = Path(__file__).resolve().parent / "toy_transport.py"


def _verify(tmp_path, *args, env=None):
    out = tmp_path / "toy.json"
    proc = subprocess.run(
        [sys.executable, "-m", "epkit.verify", "--impl", f"{TOY}:factory", "--world-size", "2",
         "--no-progress", "--json", str(out), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_the_toy_transport_passes_the_conformance_suite(tmp_path):
    """Every mode the table lists for the toy (its exchanges x payloads, from epkit verify's
    own mode list) conforms, exactly."""
    from epkit import collectives
    from epkit.reference import payloads

    proc, report = _verify(tmp_path, "--examples", "3", "--seed", "35")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    modes = set(report["modes"])
    assert {m.split("/")[0] for m in modes} == {"toy"}
    assert len(modes) == len(collectives.EXCHANGES) * (1 + len(payloads.NAMES))
    assert report["failed"] == 0 and report["passed"] > 20 * len(modes), report["passed"]


def test_the_suite_sees_a_toy_row_that_lies(tmp_path):
    """Planted: the toy's row names dedup's kernel path while its facts (the static chunk's
    size) are pairs'. The static mode fails."""
    proc, report = _verify(tmp_path, "--examples", "2", "--seed", "35", "--modes", "toy/static",
                           "--shrink-seconds", "0", env={"TOY_PATH": "dedup"})
    assert proc.returncode != 0 and report["failed"] > 0, proc.stdout[-3000:]


@pytest.fixture
def toy():
    sys.path.insert(0, str(TOY.parent))
    try:
        import toy_transport
    finally:
        sys.path.remove(str(TOY.parent))
    toy_transport.register()
    yield toy_transport
    toy_transport.unregister()


def test_the_reference_runs_the_toy_as_a_transport(toy):
    """The reference's table carries the toy: a dispatch through it moves pairs' rows and bytes,
    its combine and backward return through it, bit for bit pairs'."""
    from epkit.reference import transports

    rng = np.random.default_rng(35)
    R, E, T, H, K = 3, 6, 7, 8, 2
    xs = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(R)]
    idx = [np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(R)]
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(R)]
    for exchange in ("ragged", "padded", "static"):
        kw = dict(num_experts=E, exchange=exchange, max_tokens_per_rank=T)
        got, want = (ref.dispatch(xs, idx, ws, transport=t, **kw) for t in ("toy", "pairs"))
        assert isinstance(transports.of_results(got), toy.ReferenceToy)
        ys = [rng.standard_normal(r.expert_x.shape).astype(np.float32) for r in want]
        for g, w in zip(got, want):
            assert np.array_equal(g.expert_x, w.expert_x) and np.array_equal(g.bytes_sent,
                                                                             w.bytes_sent)
        outs = [(ref.combine(ys, res), ref.dispatch_backward(ys, res),
                 ref.combine_backward(xs, ys, res)[1]) for res in (got, want)]
        for a, b in zip(*outs):
            assert all(np.array_equal(u, v) for u, v in zip(a, b)), exchange
    with pytest.raises(ref.InputError, match="transport"):
        toy.unregister()
        ref.dispatch(xs, idx, ws, num_experts=E, transport="toy")


def test_a_refusing_transport_is_named_in_its_refusal(toy):
    """A transport that does not run an option (its ``exchanges`` and ``quantized`` facts)
    refuses it with ``UNSUPPORTED`` naming itself, not hier: the toy row, narrowed."""
    from epkit import transports
    from epkit.reference.errors import Reason, format_reason

    row = transports.TABLE["toy"]
    narrowed = type("NarrowToy", (type(row),), {"exchanges": ("auto",), "quantized": False})()
    assert row.option_error(4, 1, "static", None) == (Reason.OK, 0, 0)
    for exchange, payload, what in (("static", None, "exchange='static'"),
                                    ("lazy", None, "exchange='lazy'"),
                                    ("auto", "mxfp8", "a payload")):
        code, a, b = narrowed.option_error(4, 1, exchange, payload)
        assert code == Reason.UNSUPPORTED
        assert format_reason(code, a, b).startswith(
            f"transport='toy' does not support {what} in production"), (exchange, payload)
