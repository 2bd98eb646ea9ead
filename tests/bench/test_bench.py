"""epkit bench: a smoke run at a tiny size (no timing asserts: speed claims live in
docs/benchmarks.md, measured by `epkit bench` itself)."""

import importlib.util
import json
import math

import pytest

pytest.importorskip("torch")

from epkit.tools import bench  # noqa: E402


def _number(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_tiny_run_writes_the_ratios(tmp_path, capsys, monkeypatch):
    from epkit.tools.bench_group import progress_units

    seen, totals, real = [], [], bench.run_group

    def spy(world, cfg, deadline, on_message=None):  # rank 0's reports, as the bar sees them
        totals.append(progress_units(cfg))
        return real(world, cfg, deadline, lambda k, p: (seen.append((k, p)), on_message(k, p)))

    monkeypatch.setattr(bench, "run_group", spy)
    monkeypatch.chdir(tmp_path)  # where the default picture goes
    out = tmp_path / "bench.json"
    rc = bench.main(["--world-size", "2", "--tokens", "32", "--hidden", "64", "--experts", "8",
                     "--topk", "2", "--iters", "10", "--warmup", "1", "--kernel-reps", "3",
                     "--timeout", "60", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("speedup_vs_naive", "overhead_vs_exchange", "pack_vs_memcpy",
                "speedup_vs_plain_torch", "speedup_vs_plain_torch_padded",
                "speedup_vs_megatron_style"):
        assert _number(res[key]), key
    names = {r["name"] for r in res["rows"]}
    assert names == set(bench.ALL_METHODS)
    for r in res["rows"]:
        assert r["iters"] == 10 and len(r["times_ms"]) == 10
        assert _number(r["median_ms"]) and _number(r["algo_gbps"]) and r["bytes"] > 0
    rows = {r["name"]: r for r in res["rows"]}
    # memory: every row has its peak growth (Linux: clear_refs) and the bytes its step holds;
    # epkit's step holds at least x, its gradient, out, grad_out and expert_x (bfloat16)
    T, H = 32, 64
    assert rows["epkit dedup"]["held_bytes"] >= 5 * T * H * 2
    for r in res["rows"]:
        assert r["held_bytes"] > 0 and r["peak_rss_growth_bytes"] >= 0, r["name"]
        assert r["peak_rss_growth_max_bytes"] >= r["peak_rss_growth_bytes"]
        assert r["rss_growth_vs_held"] == r["peak_rss_growth_bytes"] / r["held_bytes"]
    assert res["memory_vs_held"] == rows["epkit dedup"]["rss_growth_vs_held"]
    # what the epkit rows keep between steps is reported beside their growth
    for name in ("epkit dedup", "epkit pairs"):
        assert rows[name]["workspace_bytes"] > 0, name
        assert rows[name]["kept_bytes"] >= rows[name]["workspace_bytes"]
    d = rows["epkit dedup"]
    assert res["kept_vs_held"] == (d["peak_rss_growth_bytes"] + d["kept_bytes"]) / d["held_bytes"]
    assert "memory_vs_held" in res["targets"]
    # the floor replays epkit dedup's exchanges: the same bytes; "floor + kernels" the same
    # exchanges with its kernel calls, and the bound's ratios follow from the medians
    assert rows["floor"]["bytes"] == rows["epkit dedup"]["bytes"]
    assert rows["floor + kernels"]["bytes"] == rows["epkit dedup"]["bytes"]
    assert rows["floor + kernels"]["exchanges"] == rows["floor"]["exchanges"]
    assert res["overhead_bound"] == (rows["floor + kernels"]["median_ms"]
                                     / rows["floor"]["median_ms"])
    assert res["epkit_vs_bound"] == (rows["epkit dedup"]["median_ms"]
                                     / rows["floor + kernels"]["median_ms"])
    assert rows["epkit dedup"]["ratio_to_epkit"] == 1.0
    ov = res["overlap"]
    assert ov["available"] in (True, False) and "dispatch then compute" in ov["rows"]
    kern = res["kernels"][0]["rows"]
    assert {"pack_into", "unpack", "gather_units", "reduce_tokens", "scatter_rows_into"} <= set(kern)
    # out fresh: the first-touch floor of a kernel's output; the kernels that write into the
    # workspace they are given have none
    from epkit.tools.bench_kernels import INTO

    into = lambda n: n.split(" #")[0] in INTO  # noqa: E731
    assert all(_number(k["out_fresh_ms"]) for n, k in kern.items() if not into(n))
    assert all(k["out_fresh_ms"] == 0 for n, k in kern.items() if into(n))
    text = capsys.readouterr().out
    assert "speedup_vs_naive" in text
    # speedup_vs_naive is the smallest of the baselines' ratios: against the fastest baseline
    base = [res[k] for k in bench.BASELINES.values()]
    assert res["speedup_vs_naive"] == min(base) and res["naive_row"] in bench.BASELINES
    # progress: one unit per round and kernel replay, exactly the bar's total; each part's
    # table reported as it finished, in order, and printed once, before the figures of merit
    assert sum(p for k, p in seen if k == "progress") == sum(totals) > 0
    parts = [k for k, _ in seen if k != "progress"]
    assert parts == ["workload", "kernels", "overlap"]
    assert text.count("2 ranks, 32 tokens/rank") == 1 and text.count("local kernels") == 1
    assert "peak MB/step" in text and "memory_vs_held" in text
    assert text.index("local kernels") < text.index("overlap (") < text.index("figures of merit")
    # the picture, by default: the workload's methods, its path printed
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "epkit-bench.png").stat().st_size > 0
        assert "wrote epkit-bench.png (--no-plot to skip)" in text


def test_ratios_and_targets():
    rows = [{"name": "epkit dedup", "median_ms": 10.0}, {"name": "plain-torch", "median_ms": 40.0},
            {"name": "megatron-style", "median_ms": 35.0}, {"name": "floor", "median_ms": 8.0}]
    r = bench.ratios(rows)
    # against the faster baseline, each reported
    assert r["speedup_vs_naive"] == 3.5 and r["naive_row"] == "megatron-style"
    assert r["speedup_vs_plain_torch"] == 4.0 and r["speedup_vs_megatron_style"] == 3.5
    assert r["overhead_vs_exchange"] == 1.25
    lines = bench.target_lines({**r, "pack_vs_memcpy": 0.4})
    assert any("pack_vs_memcpy" in ln and "MISSED" in ln for ln in lines)
    assert any("speedup_vs_naive" in ln and "met" in ln for ln in lines)


def test_plot_annotates_the_ratios_and_replots_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for t, ms in ((256, 10.0), (1024, 40.0)):
        rows += [{"name": "epkit dedup", "tokens": t, "world_size": 4, "median_ms": ms},
                 {"name": "plain-torch", "tokens": t, "world_size": 4, "median_ms": 3 * ms},
                 {"name": "floor", "tokens": t, "world_size": 4, "median_ms": ms / 2.5}]
    fig, ax = plt.subplots()
    bench._panel(ax, rows, "tokens", "world_size", 4, "log")
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["×3.0", "×3.0", "÷2.5", "÷2.5"]      # plain-torch / epkit, epkit / floor
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "1024"]
    assert any("floor: bare all_to_all_single" in str(h.get_label()) for h in ax.get_lines())
    plt.close(fig)
    cfg = {"world_size": 4, "tokens": 1024, "hidden": 64, "topk": 2, "experts": 8,
           "dtype": "bfloat16"}
    png = tmp_path / "p.png"
    bench.plot(str(png), {"rows": rows, "config": cfg})      # no args: the JSON's config
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_rss_sees_a_buffer_freed_within_the_step():
    import torch

    from epkit.tools.bench_group import PeakRss

    probe = PeakRss()
    if not probe.ok:
        pytest.skip("no writable /proc/self/clear_refs here")
    probe.start()
    t = torch.ones(64 << 18)  # 64 MiB, touched, then freed: only the peak remembers it
    del t
    assert probe.growth() >= 60 << 20
    probe.start()
    assert probe.growth() < 16 << 20  # nothing allocated: the peak was reset


def test_held_bytes_counts_each_storage_once_and_the_saved_tensors():
    import torch

    from epkit.tools.bench_group import held_bytes, holding

    a = torch.zeros(100)
    assert held_bytes([a, a[:10], a.view(10, 10), torch.zeros(5, dtype=torch.float64)]) == 440
    x = torch.ones(256, requires_grad=True)
    with holding([]) as saved:
        y = (x * x.exp()).sum()  # saves x (twice) and exp(x)
    assert len(saved) >= 3 and held_bytes(saved) == 2 * 256 * 4
    y.backward()


def test_table_prints_the_memory_columns():
    row = {"name": "epkit dedup", "median_ms": 10.0, "p10_ms": 9.0, "p90_ms": 11.0,
           "algo_gbps": 1.0, "bytes": 2e6, "ratio_to_epkit": 1.0,
           "peak_rss_growth_bytes": 30e6, "held_bytes": 20e6}
    text = bench.format_table([row, dict(row, name="floor", peak_rss_growth_bytes=None)], "t")
    assert "30.0" in text and "20.0" in text and "n/a" in text
    figures = bench.ratios([dict(row, rss_growth_vs_held=1.5)])
    assert figures["memory_vs_held"] == 1.5
    assert any("memory_vs_held" in ln and "met" in ln for ln in bench.target_lines(figures))


def test_each_table_is_headed_by_its_own_run():
    """A sweep's group runs at its own world size and tokens: its table says so, not the
    command line's (a 2-rank sweep table was headed "4 ranks")."""
    printed = []

    class Bar:
        def update(self, n):
            pass

        def write(self, text, file=None):
            printed.append(text)

    args = bench.parse_args(["--world-size", "4", "--tokens", "2048"])
    row = {"median_ms": 10.0, "p10_ms": 9.0, "p90_ms": 11.0, "bytes": 2e6, "times_ms": [10.0]}
    for world, tokens in ((4, 2048), (2, 512)):   # one reporter per group, as main makes them
        on_message = bench._reporter(args, Bar())
        on_message("workload", {"world_size": world, "tokens": tokens, "algo_bytes": 1e6,
                                "rows": {"epkit dedup": row}})
    assert printed[0].strip().startswith("4 ranks, 2048 tokens/rank")
    assert printed[1].strip().startswith("2 ranks, 512 tokens/rank"), printed[1]


def test_missed_targets_are_explained_once():
    missed = bench.target_lines({"overhead_vs_exchange": 2.7, "speedup_vs_naive": 1.0})
    assert sum("MISSED" in ln for ln in missed) == 3          # two figures and the one note
    assert missed.count(bench.MISSED_NOTE) == 1
    assert "not an error" in bench.MISSED_NOTE and "this machine" in bench.MISSED_NOTE
    assert bench.MISSED_NOTE not in bench.target_lines({"overhead_vs_exchange": 1.2})


def test_quick_sweeps_show_a_trend_with_spread_and_a_legend_off_the_lines():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    args = bench.parse_args(["--quick", "--sweep"])
    assert len(args.sweep_tokens) >= 4 and len(args.sweep_world) >= 3
    rows = [{"name": name, "tokens": t, "world_size": w, "median_ms": f * t * w / 100,
             "p10_ms": 0.9 * f * t * w / 100, "p90_ms": 1.2 * f * t * w / 100, "iters": 10}
            for f, name in ((1, "epkit dedup"), (3, "plain-torch"), (0.5, "floor"))
            for t, w in [(t, 4) for t in args.sweep_tokens] + [(args.tokens, w)
                                                               for w in args.sweep_world if w != 4]]
    fig = bench.figure({"rows": rows}, args)
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    for ax in fig.axes:
        assert not legend.overlaps(ax.get_window_extent())   # below the panels, not over them
        assert len(ax.collections) == 3                        # a p10-p90 band per line
        assert all(len(line.get_xdata()) >= 3 for line in ax.get_lines())
    assert "median of 10 timed iterations" in " ".join(t.get_text() for t in fig.texts)
    plt.close(fig)
