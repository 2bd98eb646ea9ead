"""epkit bench: a smoke run at a tiny size (no timing asserts: speed claims live in
docs/benchmarks.md, measured by `epkit bench` itself)."""

import json
import math

import pytest

pytest.importorskip("torch")

from epkit import bench  # noqa: E402


def _number(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_tiny_run_writes_the_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--world-size", "2", "--tokens", "32", "--hidden", "64", "--experts", "8",
                     "--topk", "2", "--iters", "10", "--warmup", "1", "--kernel-reps", "3",
                     "--timeout", "60", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("speedup_vs_naive", "overhead_vs_exchange", "pack_vs_memcpy",
                "speedup_vs_naive_padded"):
        assert _number(res[key]), key
    names = {r["name"] for r in res["rows"]}
    assert names == set(bench.ALL_METHODS)
    for r in res["rows"]:
        assert r["iters"] == 10 and len(r["times_ms"]) == 10
        assert _number(r["median_ms"]) and _number(r["algo_gbps"]) and r["bytes"] > 0
    rows = {r["name"]: r for r in res["rows"]}
    # the floor replays epkit dedup's exchanges: the same bytes
    assert rows["floor"]["bytes"] == rows["epkit dedup"]["bytes"]
    assert rows["epkit dedup"]["ratio_to_epkit"] == 1.0
    ov = res["overlap"]
    assert ov["available"] in (True, False) and "dispatch then compute" in ov["rows"]
    kern = res["kernels"][0]["rows"]
    assert {"pack", "unpack", "gather_rows", "reduce_tokens"} <= set(kern)
    assert "speedup_vs_naive" in capsys.readouterr().out


def test_ratios_and_targets():
    rows = [{"name": "epkit dedup", "median_ms": 10.0}, {"name": "plain-torch", "median_ms": 20.0},
            {"name": "floor", "median_ms": 8.0}]
    r = bench.ratios(rows)
    assert r["speedup_vs_naive"] == 2.0 and r["overhead_vs_exchange"] == 1.25
    lines = bench.target_lines({**r, "pack_vs_memcpy": 0.4})
    assert any("pack_vs_memcpy" in ln and "MISSED" in ln for ln in lines)
    assert any("speedup_vs_naive" in ln and "met" in ln for ln in lines)
