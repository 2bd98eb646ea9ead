"""``epkit verify`` / ``python -m epkit.verify``: prove an implementation against the reference.

Examples::

    python -m epkit.verify                                  # epkit, every mode, 4 gloo ranks
    python -m epkit.verify --world-size 3 --examples 20 --modes 'dedup/*,pairs/ragged'
    python -m epkit.verify --impl epkit.verify.adapters:plain_torch
    python -m epkit.verify --impl ./my_dispatcher.py:make --json report.json
    python -m epkit.verify --impl ./my_dispatcher.py:make --contract bounded \\
        --supports capacity=no --supports align=1 --junit-xml verify.xml
    torchrun --nproc-per-node 8 -m epkit.verify --backend nccl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["main", "build_parser"]


def build_parser(prog: str = "epkit verify") -> argparse.ArgumentParser:
    from .runner import DEFAULT_IMPL

    p = argparse.ArgumentParser(
        prog=prog,
        description="Property-based conformance run: an expert-parallel dispatch/combine "
                    "implementation against epkit's NumPy reference, on a real process group.",
    )
    p.add_argument("--world-size", type=int, default=4,
                   help="ranks of the local gloo group (cases use 1..N of them); under "
                        "torchrun the job's world size is used (default 4)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo: local worker processes (default); nccl: run under torchrun, "
                        "one process per GPU")
    p.add_argument("--examples", type=int, default=20, help="hypothesis examples per mode")
    p.add_argument("--seed", type=int, default=None,
                   help="hypothesis seed (default: random, printed so the run can be repeated)")
    p.add_argument("--impl", default=DEFAULT_IMPL,
                   help="module:factory or path/file.py:factory; factory(group) returns the "
                        f"adapter (default {DEFAULT_IMPL})")
    p.add_argument("--modes", action="append", default=None, metavar="PATTERNS",
                   help="comma-separated fnmatch patterns over mode names, e.g. "
                        "'dedup/*,*/ragged' (default: every mode)")
    p.add_argument("--list-modes", action="store_true", help="print the modes and exit")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a case may take before its group is torn down (default 30)")
    p.add_argument("--max-tokens", type=int, default=24, help="largest tokens per rank drawn")
    p.add_argument("--shrink-seconds", type=float, default=20.0,
                   help="time spent shrinking a failing case (default 20)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--contract", choices=("exact", "reordered", "bounded"), default="exact",
                   help="exact: canonical layout, bit for bit (default); reordered: any row "
                        "order inside an expert and any padding, values bit for bit; bounded: "
                        "reordered, sums within the stated error bound")
    p.add_argument("--accumulate", choices=("float32", "bfloat16"), default=None,
                   help="the implementation's accumulation dtype, for the bound (default: "
                        "declared, else float32)")
    p.add_argument("--supports", action="append", default=[], metavar="KEY=VALUE",
                   help="declare a capability (repeatable): capacity=yes|no, align=1|1,2,4|any, "
                        "unused_slots=yes|no, mixed_dtypes=yes|no, weighted=yes|no, "
                        "unweighted=yes|no, index_dtypes=int32,int64, max_topk=N, "
                        "zero_token_ranks=yes|no, padding=zeros|ignored")
    p.add_argument("--junit-xml", metavar="PATH",
                   help="also write JUnit XML (one test case per mode and property)")
    p.add_argument("--kernels", choices=("cpp", "triton"), default=None,
                   help="epkit's local kernels in the workers: cpp (the C++ CPU kernels, the "
                        "default) or triton (the GPU kernels; on a machine without a GPU they "
                        "run in Triton's interpreter, so keep --examples small); sets "
                        "EPKIT_KERNELS for the worker processes")
    return p


def _rerun_args(args, mode: str, seed: int, world_size: int) -> str:
    """The command line that replays one mode of this run exactly (same seed, same draws)."""
    import shlex

    parts = ["--impl", args.impl, "--modes", mode, "--seed", str(seed),
             "--world-size", str(world_size), "--examples", str(args.examples)]
    if args.max_tokens != build_parser().get_default("max_tokens"):
        parts += ["--max-tokens", str(args.max_tokens)]
    if args.contract != "exact":
        parts += ["--contract", args.contract]
    if args.accumulate:
        parts += ["--accumulate", args.accumulate]
    for item in args.supports:
        parts += ["--supports", item]
    if args.kernels:
        parts += ["--kernels", args.kernels]
    return " ".join(shlex.quote(p) for p in parts)


def main(argv=None) -> int:
    """Parse, choose the modes, make the group (a local pool, or this torchrun job), run the
    suite with a progress bar, print and write the results. Exit status: 0 all passed, 1 a
    property failed, 2 bad usage."""
    args = build_parser().parse_args(argv)
    if args.kernels:
        # Read by epkit at import, in every worker process the pool spawns from here.
        import os

        os.environ["EPKIT_KERNELS"] = args.kernels
    from .capabilities import parse_supports
    from .runner import modes_of, select_modes

    try:
        parse_supports(args.supports)
    except ValueError as exc:
        print(f"epkit verify: {exc}", file=sys.stderr)
        return 2
    modes = select_modes(modes_of(args.impl), args.modes)
    if args.list_modes:
        for m in modes:
            print(m.name)
        return 0
    if not modes:
        print(f"epkit verify: no mode of {args.impl} matches {args.modes}", file=sys.stderr)
        return 2
    runner, rc = _runner(args)
    return rc if runner is None else _run_suite(args, modes, runner)


def _runner(args):
    """``(group, exit status)``: the group the cases run on, a local Pool or this torchrun
    job; ``(None, 0)`` on a torchrun rank other than 0, once it has served rank 0's cases;
    ``(None, 2)`` for a backend that cannot run here."""
    from .pool import Pool, TorchrunGroup, under_torchrun

    if under_torchrun():
        runner = TorchrunGroup(args.backend, timeout=args.timeout)
        if runner.rank != 0:
            runner.serve()
            runner.close()
            return None, 0
        return runner, 0
    if args.backend == "nccl":
        print("epkit verify: --backend nccl needs one process per GPU; launch with\n"
              "  torchrun --nproc-per-node N -m epkit.verify --backend nccl", file=sys.stderr)
        return None, 2
    return Pool(args.world_size, timeout=args.timeout), 0


def _run_suite(args, modes, runner) -> int:
    from .runner import Suite

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(modes) * args.examples, unit="case", file=sys.stderr,
                   mininterval=0.5, dynamic_ncols=True, leave=False, delay=0.5)

    def on_failure(verdict):
        text = (verdict.report() + "\n  or rerun the mode: python -m epkit.verify "
                + _rerun_args(args, verdict.mode.name, suite.seed, runner.world_size))
        if bar is not None:
            bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    suite = Suite(runner, impl=args.impl, modes=modes, examples=args.examples, seed=args.seed,
                  max_tokens=args.max_tokens, shrink_seconds=args.shrink_seconds,
                  progress=bar.update if bar is not None else None, on_failure=on_failure,
                  contract=args.contract, accumulate=args.accumulate, supports=args.supports)
    declared = sorted({c.describe() for c in suite.capabilities.values()})
    print(f"epkit verify: impl {args.impl}, {len(modes)} modes x {args.examples} examples, "
          f"world size {runner.world_size} ({args.backend}), seed {suite.seed}, contract "
          f"{args.contract}" + (f" (accumulate {args.accumulate})" if args.accumulate else "")
          + f"; capabilities: {' | '.join(declared)}", flush=True)
    t0 = time.monotonic()
    try:
        result = suite.run()
    finally:
        if bar is not None:
            bar.close()
        runner.close()
    print()
    print(result.table())
    print(f"{time.monotonic() - t0:.1f}s, seed {suite.seed}; repeat with: --seed {suite.seed}")
    _write_reports(args, result)
    print(result.summary(), flush=True)
    return 0 if result.ok else 1


def _write_reports(args, result) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    if args.junit_xml:
        with open(args.junit_xml, "w") as f:
            f.write(result.junit_xml())
