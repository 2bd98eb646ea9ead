"""``epkit bench``: epkit against the plain-torch dispatcher and the bare exchange.

Spawns a local gloo group (``--world-size`` processes, one thread each by default) and times,
interleaved round by round, forward + backward of dispatch -> identity expert -> combine for:
epkit (dedup), epkit (pairs), the plain-torch dispatcher (Megatron / torchtitan style), the same
over the padded exchange, and the floor (bare ``all_to_all_single`` calls moving exactly epkit
dedup's bytes). A row's figure is the median over the timed iterations of the slowest rank's
time (see :mod:`epkit.tools.bench_group`). Also: the lazy exchange overlapping independent compute,
and epkit's local kernels against memcpy (:mod:`epkit.tools.bench_kernels`).
A progress bar runs on stderr (where it is a terminal) and each table prints as soon as its
part of the run finishes.

    epkit bench                          # the default workload, full report
    epkit bench --quick --json out.json  # the default workload, fewer iterations (--help: how long)
    epkit bench --sweep --plot docs/bench.png  # adds the sweeps over tokens per rank and world size

Every run draws its picture (``--plot``, epkit-bench.png in the working folder unless named;
the path is printed; ``--no-plot`` skips it): the methods' times on the default workload, or,
with ``--sweep``, time against tokens per rank and against world size.
    epkit bench --launches --world-size 2  # kernels, collectives, host waits per phase

Figures of merit (in the JSON):
    speedup_vs_naive      fastest baseline median / epkit dedup median (target >= 3); the
                          baselines: plain-torch, plain-torch padded, megatron-style (the
                          permute + all_to_all + index_add_ dispatcher users run); each one's
                          own ratio is speedup_vs_plain_torch, ..._padded, ..._megatron_style
    overhead_vs_exchange  epkit dedup median / floor median            (target <= 1.5)
    overhead_bound        "floor + kernels" median / floor median: epkit dedup's exchanges and
                          C++ kernel calls replayed in order, nothing else, so the least
                          overhead_vs_exchange this design's kernels allow on this machine
    epkit_vs_bound        epkit dedup median / "floor + kernels" median: what the rest (Python,
                          call headers, count exchange, index ops, allocation) costs
    pack_vs_memcpy        pack kernel GB/s / memcpy GB/s, one thread   (target >= 0.5)
    memory_vs_held        epkit dedup's peak resident-set growth per step / the bytes the
                          step must hold (inputs, outputs, saved tensors) (target <= 1.5)
    kept_vs_held          (that growth + what epkit keeps between steps: its Dispatcher's
                          workspace and the freed large CPU blocks it reuses) / held bytes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time

TARGETS = {"speedup_vs_naive": (">=", 3.0), "overhead_vs_exchange": ("<=", 1.5),
           "pack_vs_memcpy": (">=", 0.5), "memory_vs_held": ("<=", 1.5)}
ALLOC_ENV = {"default": {}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
             "reuse": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}}
ALLOC_VARS = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
ALL_METHODS = ("epkit dedup", "epkit pairs", "megatron-style", "plain-torch", "plain-torch padded",
               "floor", "floor + kernels")
MISSED_NOTE = ("  MISSED is not an error: the run succeeded. The targets are the project's own "
               "goals for these ratios on this machine (docs/benchmarks.md), and a figure "
               "that misses one is reported as measured.")
QUICK_DURATION = ("measured: 44 s on 2 cores at a load of 0.38 to 2.26, most of it the load's; "
                  "the first extension build aside; docs/benchmarks.md")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter

    ap = argparse.ArgumentParser(prog="epkit bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--world-size", type=int, default=4, help="ranks of the local gloo group")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size H of a token row")
    ap.add_argument("--topk", type=int, default=8, help="experts per token K")
    ap.add_argument("--experts", type=int, default=64, help="experts E (a multiple of --world-size)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="token dtype")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations (at least 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (at least 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0, help="seed of every rank's inputs")
    ap.add_argument("--quick", action="store_true",
                    help="10 iterations, 2 warm-up rounds, no padded plain-torch row, no overlap "
                         f"rows, kernels at one thread ({QUICK_DURATION})")
    ap.add_argument("--json", metavar="PATH", help="write every row and the ratios here")
    ap.add_argument("--plot", metavar="PATH", default="epkit-bench.png",
                    help="where the PNG goes: the methods' times on the default workload, or "
                         "with --sweep time against tokens per rank and world size")
    ap.add_argument("--no-plot", action="store_true", help="draw no picture")
    ap.add_argument("--sweep", action="store_true",
                    help="also run the sweeps over tokens per rank and world size (their picture "
                         "is --plot's)")
    ap.add_argument("--sweep-tokens", type=_ints, default=None,
                    help="tokens per rank of the sweep (default 256,512,1024,2048,4096; "
                         "with --quick: tokens/8,tokens/4,tokens/2,tokens)")
    ap.add_argument("--sweep-world", type=_ints, default=None,
                    help="world sizes of the sweep (default 2,4,8, --quick too)")
    ap.add_argument("--methods", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                    default=None, help="comma list of rows (default all; with --quick all but "
                                       "'plain-torch padded')")
    ap.add_argument("--overlap", action="store_true",
                    help="run the lazy-exchange rows with --quick")
    ap.add_argument("--no-overlap", action="store_true", help="skip the lazy-exchange rows")
    ap.add_argument("--profile", action="store_true",
                    help="also profile epkit dedup steps on rank 0 (self CPU time per op)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the local kernel rows")
    ap.add_argument("--kernel-reps", type=int, default=None,
                    help="calls per kernel timing (default 30; 10 with --quick)")
    ap.add_argument("--alloc", choices=sorted(ALLOC_ENV), default="default",
                    help="how the ranks get large buffers: glibc and torch defaults; 'thp': "
                         "torch's THP_MEM_ALLOC_ENABLE=1 (2 MiB-aligned, transparent huge "
                         "pages); 'reuse': glibc's mmap off and trim threshold high, so freed "
                         "large buffers are reused rather than mapped and first-touched anew")
    ap.add_argument("--launches", action="store_true",
                    help="instead of timing: count the kernel launches, collectives and host "
                         "waits of one training step per transport and exchange on the device "
                         "path (epkit.tools.bench_launches; uses --world-size, --json)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a collective may wait before the group gives up")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar (it is shown on stderr when stderr is a terminal)")
    return ap


def parse_args(argv):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.warmup = 10, 2
    if args.methods is None:
        args.methods = [m for m in ALL_METHODS if not (args.quick and m == "plain-torch padded")]
    unknown = sorted(set(args.methods) - set(ALL_METHODS))
    if unknown or "epkit dedup" not in args.methods:
        ap.error(f"--methods: choose from {', '.join(ALL_METHODS)} (epkit dedup always); "
                 f"got {unknown}")
    if args.quick and not args.overlap:
        args.no_overlap = True
    if args.kernel_reps is None:
        args.kernel_reps = 10 if args.quick else 30
    if args.iters < 10:
        ap.error("--iters must be at least 10")
    if args.warmup < 1:
        ap.error("--warmup must be at least 1")
    if args.experts % args.world_size:
        ap.error("--experts must be a multiple of --world-size")
    if args.sweep_tokens is None:
        args.sweep_tokens = (sorted({max(1, args.tokens >> i) for i in range(4)}) if args.quick
                             else [256, 512, 1024, 2048, 4096])
    if args.sweep_world is None:
        args.sweep_world = [2, 4, 8]
    bad = [w for w in args.sweep_world if args.experts % w]
    if args.sweep and bad:
        ap.error(f"--sweep-world sizes {bad} do not divide --experts {args.experts}")
    return args


# ---- running a group -----------------------------------------------------------------------

def run_group(world: int, cfg: dict, deadline_s: float, on_message=None) -> dict:
    """Spawn ``world`` ranks (``epkit.verify.procs.run_ranks``: a FileStore rendezvous in a
    private temp dir, so no port is raced for), run :func:`epkit.tools.bench_group.worker` on
    each, return rank 0's result. ``on_message(kind, payload)``: rank 0's reports as it goes
    (``"progress"``, then each finished part: ``"workload"``, ``"kernels"``, ``"overlap"``,
    ``"profile"``)."""
    from . import bench_group
    from epkit.verify.procs import RanksFailed, run_ranks

    report = None if on_message is None else (lambda rank, kind, payload: on_message(kind, payload))
    try:
        got = run_ranks(bench_group.worker, world, (cfg,), deadline_s=deadline_s,
                        on_message=report, prefix="epkit-bench-")
    except RanksFailed as exc:
        raise RuntimeError(f"epkit bench: world size {world}: {exc}") from None
    errors = [f"rank {r}: {payload}" for r, (kind, payload) in sorted(got.items())
              if kind == "error"]
    if errors:
        raise RuntimeError(f"epkit bench: world size {world}: {errors[0]}")
    return got[0][1]


# ---- machine -------------------------------------------------------------------------------

def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "backend": "gloo", "loadavg_start": list(os.getloadavg())}


# ---- report --------------------------------------------------------------------------------

def table_rows(wl: dict) -> list[dict]:
    """Flat JSON rows of one workload, with algorithmic GB/s and the ratio to epkit dedup."""
    base = wl["rows"].get("epkit dedup", {}).get("median_ms")
    out = []
    for name, r in wl["rows"].items():
        row = {"name": name, "tokens": wl["tokens"], "world_size": wl["world_size"]}
        row.update({k: v for k, v in r.items() if k != "times_ms"})
        row["algo_gbps"] = wl["algo_bytes"] / (r["median_ms"] * 1e-3) / 1e9
        row["ratio_to_epkit"] = r["median_ms"] / base if base else None
        row["times_ms"] = r["times_ms"]
        out.append(row)
    return out


def format_table(rows: list[dict], title: str) -> str:
    lines = [title,
             f"  {'method':<20}{'median ms':>10}{'p10-p90 ms':>17}{'algo GB/s':>11}"
             f"{'MB sent/rank':>14}{'x epkit':>9}{'peak MB/step':>14}{'held MB':>9}"
             f"{'kept MB':>9}"]
    for r in rows:
        spread = f"{r['p10_ms']:.1f}-{r['p90_ms']:.1f}"
        ratio = "" if r["ratio_to_epkit"] is None else f"{r['ratio_to_epkit']:.2f}"
        peak = r.get("peak_rss_growth_bytes")
        peak = "n/a" if peak is None else f"{peak / 1e6:.1f}"
        kept = "" if r.get("kept_bytes") is None else f"{r['kept_bytes'] / 1e6:.1f}"
        lines.append(f"  {r['name']:<20}{r['median_ms']:>10.1f}{spread:>17}"
                     f"{r['algo_gbps']:>11.2f}{r['bytes'] / 1e6:>14.1f}{ratio:>9}"
                     f"{peak:>14}{r.get('held_bytes', 0) / 1e6:>9.1f}{kept:>9}")
    lines.append("  (peak MB/step: the resident set's peak growth in a step, per rank; held MB: "
                 "the step's inputs, outputs and saved tensors; kept MB: what epkit keeps "
                 "between steps, its Dispatcher's workspace and the freed large CPU blocks it "
                 "reuses, so not growth)")
    return "\n".join(lines)


BASELINES = {"plain-torch": "speedup_vs_plain_torch",
             "plain-torch padded": "speedup_vs_plain_torch_padded",
             "megatron-style": "speedup_vs_megatron_style"}


def ratios(rows: list[dict]) -> dict:
    """The figures of merit from one run's medians. ``speedup_vs_naive`` is taken against the
    *fastest* baseline row that ran (so it never flatters epkit by picking a slow one); each
    baseline's own ratio is reported too."""
    med = {r["name"]: r["median_ms"] for r in rows}
    ep = med.get("epkit dedup")
    out = {}
    if ep:
        ran = {name: med[name] for name in BASELINES if name in med}
        for name, ms in ran.items():
            out[BASELINES[name]] = ms / ep
        if ran:
            fastest = min(ran, key=ran.get)
            out["speedup_vs_naive"] = ran[fastest] / ep
            out["naive_row"] = fastest
        if "floor" in med:
            out["overhead_vs_exchange"] = ep / med["floor"]
            if "floor + kernels" in med:  # the machine's bound for this design, and the rest
                out["overhead_bound"] = med["floor + kernels"] / med["floor"]
                out["epkit_vs_bound"] = ep / med["floor + kernels"]
        if "epkit pairs" in med:
            out["pairs_vs_dedup"] = med["epkit pairs"] / ep
    mem = next((r.get("rss_growth_vs_held") for r in rows if r["name"] == "epkit dedup"), None)
    if mem is not None:
        out["memory_vs_held"] = mem
    ep_row = next((r for r in rows if r["name"] == "epkit dedup"), {})
    if ep_row.get("kept_bytes") is not None and ep_row.get("held_bytes"):
        # growth plus what is kept between steps: the memory epkit's step really costs
        out["kept_vs_held"] = ((ep_row.get("peak_rss_growth_bytes") or 0) + ep_row["kept_bytes"]
                               ) / ep_row["held_bytes"]
    return out


def target_lines(figures: dict) -> list[str]:
    lines = []
    for key, (op, goal) in TARGETS.items():
        if key not in figures:
            continue
        v = figures[key]
        ok = v >= goal if op == ">=" else v <= goal
        lines.append(f"  {key:<22}{v:>7.2f}   target {op} {goal}   {'met' if ok else 'MISSED'}")
    if "overhead_bound" in figures:  # why overhead_vs_exchange is what it is
        lines.append(f"  (overhead_bound {figures['overhead_bound']:.2f}: floor + kernels / floor, "
                     "the least overhead_vs_exchange epkit's kernels allow here; epkit_vs_bound "
                     f"{figures['epkit_vs_bound']:.2f}: the rest of epkit's step)")
    if "kept_vs_held" in figures:  # memory_vs_held counts growth only: what is kept, too
        lines.append(f"  (kept_vs_held {figures['kept_vs_held']:.2f}: epkit dedup's growth plus what "
                     "it keeps between steps (workspace, reused blocks) / its held bytes)")
    if any(line.endswith("MISSED") for line in lines):
        lines.append(MISSED_NOTE)
    if "naive_row" in figures:  # speedup_vs_naive is against this row; the others for context
        lines.append(f"  (speedup_vs_naive is against {figures['naive_row']}, the fastest baseline; "
                     + ", ".join(f"{k} {figures[k]:.2f}" for k in BASELINES.values() if k in figures)
                     + ")")
    return lines


def format_overlap(ov: dict) -> str:
    lines = ["overlap (forward dispatch, no autograd; compute = "
             f"{ov['compute_reps']} x [T,H]@[H,128] float32 matmul):"]
    for name, r in ov["rows"].items():
        lines.append(f"  {name:<30}{r['median_ms']:>10.1f} ms")
    if ov["available"]:
        lines.append(f"  lazy speedup {ov['speedup']:.2f}x, hidden fraction of the shorter "
                     f"part {ov['hidden_fraction']:.2f}")
    else:
        lines.append(f"  lazy: unavailable ({ov['reason']})")
    return "\n".join(lines)


def format_profile(rows: list[dict]) -> str:
    lines = ["epkit dedup step on rank 0, self CPU time per op (torch.profiler; the collective "
             "ops' self time includes waiting for their exchange):"]
    for r in rows:
        lines.append(f"  {r['op'][:52]:<54}{r['self_ms_per_step']:>9.1f} ms"
                     f"{r['calls_per_step']:>7.1f} calls")
    return "\n".join(lines)


def format_kernels(kr: list[dict]) -> str:
    lines = ["local kernels (rank 0 replays one step's kernel calls alone, best of "
             "N calls; GB/s = (arguments + outputs) / time; out fresh: a memcpy into a fresh "
             "buffer of the kernel's first output size, the first-touch floor):"]
    for k in kr:
        lines.append(f"  {k['transport']}, {k['threads']} thread(s): memcpy of "
                     f"{k['memcpy_bytes'] / 1e6:.1f} MB {k['memcpy_gbps']:.1f} GB/s (fresh dst "
                     f"{k['memcpy_fresh_gbps']:.1f})")
        for name, r in k["rows"].items():
            lines.append(f"    {name:<26}{r['best_ms']:>8.2f} ms{r['gbps']:>8.1f} GB/s"
                         f"{r['vs_memcpy']:>7.2f} x memcpy   out fresh "
                         f"{r.get('out_fresh_ms', 0):>6.2f} ms")
    return "\n".join(lines)


STYLE = {"epkit dedup": ("C0", "o", "-"), "epkit pairs": ("C1", "s", "-"),
         "megatron-style": ("C2", "P", "-"),
         "plain-torch": ("C3", "^", "-"), "plain-torch padded": ("C4", "v", "--"),
         "floor": ("0.35", "D", ":"), "floor + kernels": ("0.6", "d", ":")}
LABELS = {"floor": "floor: bare all_to_all_single of epkit dedup's bytes",
          "floor + kernels": "floor + kernels: the same with epkit dedup's C++ kernel calls"}


def _log_ticks(ax, values) -> None:
    """Log y axis with ticks at 1, 2, 5 x 10^n labelled in plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    lo, hi = min(values), max(values)
    ax.set_ylim(lo / 1.6, hi * 1.6)


def _panel(ax, rows, key, fixed, fixed_value, xscale) -> list[float]:
    """One panel: median ms against ``key`` (tokens or world size) at ``fixed = fixed_value``,
    each line with a band from its p10 to its p90 over the timed iterations (the spread);
    every non-epkit-dedup point annotated with its ratio to epkit dedup at the same x."""
    pts, band = {}, {}
    for r in rows:
        if r[fixed] == fixed_value:
            pts.setdefault(r["name"], {})[r[key]] = r["median_ms"]
            band.setdefault(r["name"], {})[r[key]] = (r.get("p10_ms", r["median_ms"]),
                                                      r.get("p90_ms", r["median_ms"]))
    base = pts.get("epkit dedup", {})
    values = []
    for name in ALL_METHODS:
        if name not in pts:
            continue
        xs = sorted(pts[name])
        ys = [pts[name][x] for x in xs]
        lo, hi = zip(*[band[name][x] for x in xs])
        values += ys + list(lo) + list(hi)
        color, marker, ls = STYLE[name]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
        ax.plot(xs, ys, marker=marker, ls=ls, color=color, label=LABELS.get(name, name))
        if name == "epkit dedup":
            continue
        for x, y in zip(xs, ys):
            if x not in base:
                continue
            text = (f"÷{base[x] / y:.1f}" if name == "floor" else f"×{y / base[x]:.1f}")
            ax.annotate(text, (x, y), textcoords="offset points", fontsize=7, color=color,
                        xytext=(5, -10 if name == "floor" else 3),
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.75))
    xs = sorted({r[key] for r in rows if r[fixed] == fixed_value})
    ax.set_xscale(xscale)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.margins(x=0.1)
    return values


def _points_note(rows, args) -> str:
    """How many timed iterations each point is the median of."""
    iters = sorted({r["iters"] for r in rows if r.get("iters")}) or [getattr(args, "iters", "the")]
    return (f"Each point: the median of {'/'.join(map(str, iters))} timed iterations (slowest "
            "rank each).")


def plot(path: str, results: dict, args=None) -> None:
    """Time against tokens per rank and against world size; ``args``: the run's options
    (default: ``results["config"]``, so a JSON written by ``--json`` replots alone)."""
    import matplotlib.pyplot as plt

    fig = figure(results, args)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(results: dict, args=None):
    """The figure :func:`plot` saves: two panels, the legend below them (never over a line)."""
    import types

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    if args is None:
        args = types.SimpleNamespace(**results["config"])
    rows = results["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6.2), layout="constrained")
    va = _panel(a, rows, "tokens", "world_size", args.world_size, "log")
    vb = _panel(b, rows, "world_size", "tokens", args.tokens, "linear")
    a.set(xlabel="tokens per rank",
          ylabel="median ms per step (forward + backward, slowest rank)",
          title=f"{args.world_size} ranks, hidden {args.hidden}, top-{args.topk} of "
                f"{args.experts} experts")
    b.set(xlabel="world size (ranks)", ylabel="median ms per step",
          title=f"{args.tokens} tokens per rank")
    for ax, vals in ((a, va), (b, vb)):
        if vals:
            _log_ticks(ax, vals)
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = a.get_legend_handles_labels()
    band = matplotlib.patches.Patch(color="0.5", alpha=0.3)
    fig.legend(handles + [band], labels + ["band: p10 to p90 of the timed iterations"],
               loc="lower center", bbox_to_anchor=(0.5, 0.075), ncol=4, fontsize=8,
               frameon=False)   # below the panels (the layout keeps the bottom 17 % free)
    machine = results.get("machine", {})
    load = ""
    if "loadavg_start" in machine and "loadavg_end" in machine:
        load = (f" (1-minute load {machine['loadavg_start'][0]:.1f} at the start, "
                f"{machine['loadavg_end'][0]:.1f} at the end)")
    fig.suptitle(f"epkit bench: dispatch -> identity expert -> combine, gloo on "
                 f"{machine.get('cores', os.cpu_count())} CPU cores{load}, {args.dtype}",
                 fontsize=11)
    caption = (f"{_points_note(rows, args)} Numbers beside the points: ×r = that row's time ÷ "
               "epkit dedup's at the same x (the fastest baseline's r is speedup_vs_naive); ÷r on "
               "the floor = epkit dedup's time ÷ the floor's (overhead_vs_exchange, target ≤ 1.5). "
               "The floor replays exactly the all_to_all_single calls of one epkit dedup step "
               "(same split sizes and bytes, buffers made once): the exchange alone, no packing, "
               "no plan, no autograd.")
    fig.text(0.01, 0.005, textwrap.fill(caption, 190), fontsize=8, ha="left", va="bottom")
    fig.get_layout_engine().set(rect=(0, 0.17, 1, 0.83))
    return fig


# ---- main ----------------------------------------------------------------------------------

def _progress_bar(total: int, off: bool):
    """A tqdm bar on stderr (shown where stderr is a terminal, never with ``off``); its
    ``write`` prints a table above it."""
    from tqdm import tqdm

    return tqdm(total=total, desc="epkit bench", unit="round", file=sys.stderr,
                disable=True if off else None, dynamic_ncols=True, leave=False)


def main(argv=None) -> int:
    """Parse, build the extension outside the timed groups, run the groups with a progress bar
    and each table printed as it finishes, then the figures of merit, JSON and plot."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.launches:
        from . import bench_launches

        return bench_launches.main(args)
    started = time.monotonic()
    os.environ.update(ALLOC_ENV[args.alloc])  # read by glibc / torch when each rank starts
    import epkit.ops  # noqa: F401  (builds the extension here, if stale, not inside a timed group)

    info = machine_info()
    info["alloc"] = {"mode": args.alloc, **{k: os.environ[k] for k in ALLOC_VARS
                                            if k in os.environ}}
    groups = _groups(args)
    print(f"epkit bench: {args.world_size} ranks (gloo, {args.threads} thread(s) each, "
          f"{info['cores']} cores, alloc {args.alloc}), {args.tokens} tokens/rank, "
          f"hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, {args.dtype}, forward + backward; "
          f"median of {args.iters} iterations after {args.warmup} warm-up", flush=True)
    from .bench_group import progress_units

    bar = _progress_bar(sum(progress_units(c) for _, c in groups), args.no_progress)
    deadline = max(120.0, 4 * args.timeout)
    try:
        runs = [run_group(w, c, deadline, _reporter(args, bar)) for w, c in groups]
    finally:
        bar.close()
    results = _results(args, info, runs)
    print("\nfigures of merit:")
    print("\n".join(target_lines(results)))
    info["loadavg_end"] = list(os.getloadavg())
    results["seconds"] = time.monotonic() - started
    print(f"\n{results['seconds']:.1f} s; load average {info['loadavg_start'][0]:.2f} at start, "
          f"{info['loadavg_end'][0]:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    if not args.no_plot:
        _picture(args.plot, results, args)
    return 0


def _picture(path: str, results: dict, args) -> None:
    """Draw the run's picture at ``path`` (printed); without matplotlib, say how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no picture: matplotlib is not installed (pip install 'epkit[plot]'; "
              "--no-plot to skip)")
        return
    (plot if args.sweep else plot_workload)(path, results, args)
    print(f"wrote {path} (--no-plot to skip)")


def plot_workload(path: str, results: dict, args) -> None:
    """The methods' median time per step on the default workload, p10 to p90 as a whisker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r.get("tokens", args.tokens) == args.tokens
            and r.get("world_size", args.world_size) == args.world_size
            and r.get("median_ms") is not None]
    rows.sort(key=lambda r: r["median_ms"])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6), layout="constrained")
    med = [r["median_ms"] for r in rows]
    lo = [r["median_ms"] - r.get("p10_ms", r["median_ms"]) for r in rows]
    hi = [r.get("p90_ms", r["median_ms"]) - r["median_ms"] for r in rows]
    ax.barh([r["name"] for r in rows], med, xerr=[lo, hi], color="0.6", capsize=3)
    ax.invert_yaxis()
    for y, (m, h) in enumerate(zip(med, hi)):
        ax.text(m + h, y, f"  {m:.1f}", va="center", fontsize=8)  # beyond the whisker
    ax.set(xlabel="median ms per step (forward + backward, slowest rank); whisker: p10 to p90",
           title=f"epkit bench: {args.world_size} ranks, {args.tokens} tokens per rank, hidden "
                 f"{args.hidden}, top-{args.topk} of {args.experts} experts, {args.dtype}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _groups(args) -> list:
    """``[(world size, config)]``: the default workload, and with ``--sweep`` the world-size
    sweep (the token sweep rides in the first group's ``token_list``)."""
    cfg = dict(hidden=args.hidden, topk=args.topk, experts=args.experts, dtype=args.dtype,
               iters=args.iters, warmup=args.warmup, threads=args.threads, seed=args.seed,
               timeout=args.timeout, methods=tuple(args.methods), tokens=args.tokens,
               token_list=[args.tokens], overlap=not args.no_overlap,
               profile=args.profile, kernel_reps=args.kernel_reps,
               kernel_threads=[] if args.no_kernels else
               ([1] if args.quick else sorted({1, os.cpu_count() or 1})))
    if args.sweep:
        cfg["token_list"] = [args.tokens] + [t for t in args.sweep_tokens if t != args.tokens]
    groups = [(args.world_size, cfg)]
    if args.sweep:
        groups += [(w, dict(cfg, token_list=[args.tokens], overlap=False, profile=False,
                            kernel_threads=[])) for w in args.sweep_world if w != args.world_size]
    return groups


def workload_title(wl: dict) -> str:
    """A workload table's header, from that run's own figures (a sweep's group runs at its
    own world size and tokens, not the command line's)."""
    return (f"{wl['world_size']} ranks, {wl['tokens']} tokens/rank (algo GB/s: epkit dedup's "
            f"{wl['algo_bytes'] / 1e6:.1f} MB per rank / time):")


def _reporter(args, bar):
    """``on_message(kind, payload)`` for :func:`run_group`: progress to the bar, each finished
    part's table printed above it, headed by that run's own world size and tokens."""
    def on_message(kind, payload):
        if kind == "progress":
            bar.update(payload)
            return
        if kind == "workload":
            text = format_table(table_rows(payload), workload_title(payload))
        else:
            text = {"kernels": format_kernels, "overlap": format_overlap,
                    "profile": format_profile}[kind](payload)
        bar.write("\n" + text, file=sys.stdout)
        sys.stdout.flush()

    return on_message


def _results(args, info, runs) -> dict:
    """The JSON: machine, configuration, every row, the figures of merit (from the first
    group's default workload), overlap, profile, kernel rows and the targets."""
    main_run = runs[0]
    workloads = [wl for run in runs for wl in run["workloads"]]
    rows = [r for wl in workloads for r in table_rows(wl)]
    results = {"machine": info, "config": {k: v for k, v in vars(args).items()},
               "rows": rows, **ratios(table_rows(workloads[0]))}
    for key in ("overlap", "profile"):
        if key in main_run:
            results[key] = main_run[key]
    kr = workloads[0].get("kernels")
    if kr:
        results["kernels"] = kr
        for key, tr in (("pack_vs_memcpy", "dedup"), ("pack_vs_memcpy_pairs", "pairs")):
            name = {k2 for k in kr for k2 in k["rows"]} & {"pack", "pack_into"}
            name = "pack_into" if "pack_into" in name else "pack"  # (pack: without a workspace)
            packs = [k["rows"][name]["vs_memcpy"] for k in kr  # one thread first
                     if k["transport"] == tr and name in k["rows"]]
            if packs:
                results[key] = packs[0]
    results["targets"] = {k: {"op": op, "goal": g} for k, (op, g) in TARGETS.items()}
    return results


if __name__ == "__main__":
    sys.exit(main())
