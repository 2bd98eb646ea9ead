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

# A case's time limit with --kernels triton: the interpreter runs the widest corner cases (K 255,
# hundreds of tokens) in tens of seconds on a loaded 2-core machine, against 30 s for all cases.
TRITON_TIMEOUT = 300.0


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit status 2 (``--help`` shows the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser(prog: str = "epkit verify") -> argparse.ArgumentParser:
    from .runner import DEFAULT_IMPL

    p = _Parser(
        prog=prog,
        description="Property-based conformance run: an expert-parallel dispatch/combine "
                    "implementation against epkit's NumPy reference, on a real process group.",
    )
    p.add_argument("--world-size", type=_count(1), default=4,
                   help="ranks of the local gloo group (cases use 1..N of them); under "
                        "torchrun the job's world size is used (default 4)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo: local worker processes (default); nccl: run under torchrun, "
                        "one process per GPU")
    p.add_argument("--examples", type=_count(0), default=20,
                   help="random examples per mode, after the corner cases (default 20)")
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
    p.add_argument("--timeout", type=_positive, default=None,
                   help="seconds a case may take before its group is torn down (default 30; "
                        f"{TRITON_TIMEOUT:.0f} with --kernels triton, whose interpreter is slow)")
    p.add_argument("--max-tokens", type=_count(1), default=24,
                   help="largest tokens per rank of an ordinary draw (one draw in eight has up "
                        "to 320, H <= 8; default 24)")
    p.add_argument("--max-hidden", type=_count(1), default=72,
                   help="largest hidden size of an ordinary draw (default 72; the corner cases "
                        "reach 4096 and 7168 whatever it is)")
    p.add_argument("--shrink-seconds", type=_count(0, float), default=20.0,
                   help="time spent shrinking a failing case (default 20)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (a bar where stderr is a terminal, else a line per mode)")
    p.add_argument("--contract", choices=("exact", "reordered", "bounded"), default="exact",
                   help="exact: canonical layout, bit for bit (default); reordered: any row "
                        "order inside an expert and any padding, values bit for bit; bounded: "
                        "reordered, sums within the stated error bound")
    p.add_argument("--accumulate", type=_accumulate, default=None,
                   metavar="float32|native|DTYPE:ACC,...",
                   help="the dtype the implementation sums in, per dtype of the data it sums, "
                        "for the bound: float32 (every sum), native (bfloat16 data in "
                        "bfloat16, float32 in float32; bfloat16 means the same), or per dtype "
                        "such as bfloat16:bfloat16,float32:float32 (default: declared, else "
                        "float32)")
    p.add_argument("--check-errors", action=argparse.BooleanOptionalAction, default=None,
                   help="also draw invalid inputs (duplicate or out-of-range ids, non-finite "
                        "weights, ranks that disagree on K, H or dtype, E not a multiple of "
                        "the group size, wrong shapes): every rank must raise ValueError from "
                        "dispatch where the reference raises (default: as declared; on for "
                        "epkit's own modes)")
    p.add_argument("--supports", action="append", default=[], metavar="KEY=VALUE",
                   help="declare a capability (repeatable): capacity=yes|no, align=1|1,2,4|any, "
                        "unused_slots=yes|no, mixed_dtypes=yes|no, weighted=yes|no, "
                        "unweighted=yes|no, index_dtypes=int32,int64, max_topk=N, "
                        "zero_token_ranks=yes|no, padding=zeros|ignored, accumulate=..., "
                        "check_errors=yes|no")
    p.add_argument("--junit-xml", metavar="PATH",
                   help="also write JUnit XML (one test case per mode and property)")
    p.add_argument("--kernels", choices=("cpp", "triton"), default=None,
                   help="epkit's local kernels in the workers: cpp (the C++ CPU kernels, the "
                        "default) or triton (the GPU kernels; on a machine without a GPU they "
                        "run in Triton's interpreter, about 20 to 60 s a mode at world size 3 "
                        "with --examples 1, most of it the corner cases, which every run "
                        "draws); sets EPKIT_KERNELS for the worker processes")
    return p


def _count(lo: int, kind=int):
    """An argparse type: a number of ``kind`` >= ``lo`` (argparse turns the error into one
    usage line and exit status 2)."""

    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected a number >= {lo}, got {text!r}")
        return v

    return parse


def _positive(text):
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return v


def _accumulate(text):
    from .accumulate import describe_accumulate, parse_accumulate

    try:
        return describe_accumulate(parse_accumulate(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rerun_args(args, mode: str, seed: int, world_size: int) -> str:
    """The command line that replays one mode of this run exactly (same seed, same draws)."""
    import shlex

    parts = ["--impl", args.impl, "--modes", mode, "--seed", str(seed),
             "--world-size", str(world_size), "--examples", str(args.examples)]
    if args.max_tokens != build_parser().get_default("max_tokens"):
        parts += ["--max-tokens", str(args.max_tokens)]
    if args.max_hidden != build_parser().get_default("max_hidden"):
        parts += ["--max-hidden", str(args.max_hidden)]
    if args.contract != "exact":
        parts += ["--contract", args.contract]
    if args.accumulate:
        parts += ["--accumulate", args.accumulate]
    if args.check_errors is not None:
        parts += ["--check-errors" if args.check_errors else "--no-check-errors"]
    for item in args.supports:
        parts += ["--supports", item]
    if args.kernels:
        parts += ["--kernels", args.kernels]
    return " ".join(shlex.quote(p) for p in parts)


def main(argv=None) -> int:
    """Parse, choose the modes, make the group (a local pool, or this torchrun job), run the
    suite with progress (a bar on a terminal, a line per mode elsewhere), print and write the results. Exit status: 0 all passed, 1 a
    property failed, 2 bad usage."""
    args = build_parser().parse_args(argv)
    if args.timeout is None:
        args.timeout = TRITON_TIMEOUT if args.kernels == "triton" else 30.0
    if args.kernels:
        # Read by epkit at import, in every worker process the pool spawns from here.
        import os

        os.environ["EPKIT_KERNELS"] = args.kernels
    from .adapters import ImplNotFound
    from .capabilities import parse_supports
    from .runner import modes_of, select_modes

    try:
        parse_supports(args.supports)
        modes = select_modes(modes_of(args.impl), args.modes)
    except (ValueError, ImplNotFound) as exc:
        print(f"epkit verify: {exc}", file=sys.stderr)
        return 2
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
    if not args.no_progress and sys.stderr.isatty():  # a CI log gets plain lines, no \r
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
                  max_tokens=args.max_tokens, max_hidden=args.max_hidden,
                  shrink_seconds=args.shrink_seconds,
                  progress=bar.update if bar is not None else None, on_failure=on_failure,
                  contract=args.contract, accumulate=args.accumulate, supports=args.supports,
                  check_errors=args.check_errors,
                  on_mode=_mode_lines(len(modes)) if bar is None and not args.no_progress
                  else None,
                  # Triton's interpreter takes tens of seconds over 2**17 rows: once a run
                  count_overflow="once" if args.kernels == "triton" else "every")
    if bar is not None:  # the total counts every mode's corner cases too, not only its draws
        bar.total = sum(args.examples + len(suite.corner_cases(m)) for m in modes)
    declared = sorted({c.describe() for c in suite.capabilities.values()})
    accumulate = sorted({suite.accumulate_of(c) for c in suite.capabilities.values()})
    errors = sorted({suite.checks_errors(c) for c in suite.capabilities.values()})
    print(f"epkit verify: impl {args.impl}, {len(modes)} modes x (corner cases + "
          f"{args.examples} examples), world size {runner.world_size} ({args.backend}), seed "
          f"{suite.seed}, contract {args.contract}, accumulate {' | '.join(accumulate)}, "
          f"invalid inputs {' | '.join('checked' if e else 'not checked' for e in errors)}"
          f"; capabilities: {' | '.join(declared)}", flush=True)
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
    from .kernels import kernels_served

    result.kernels = kernels_served(args.backend, args.kernels)
    print(f"epkit's kernels: {result.kernels}")
    _write_reports(args, result)
    print(result.summary(), flush=True)
    return 0 if result.ok else 1


def _mode_lines(total: int):
    """``on_mode`` where stderr is no terminal (a CI log): one plain line per finished mode
    instead of a bar's carriage returns."""
    t0, done = time.monotonic(), [0]

    def on_mode(mode, result):
        done[0] += 1
        print(f"epkit verify: mode {mode.name} {'passed' if result.ok else 'FAILED'} "
              f"({done[0]}/{total}, {time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)

    return on_mode


def _write_reports(args, result) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    if args.junit_xml:
        with open(args.junit_xml, "w") as f:
            f.write(result.junit_xml())
