#!/usr/bin/env python3
"""Exit stress: run the README's first program, every two-rank block of the docs and a
plain-torch control many times under torchrun, and count the runs that abort at exit.

The abort it looks for: the work done, one rank dies at exit with SIGABRT (``terminate called
without an active exception``, torchrun's ``exitcode: -6``), so a CI job goes red. Each run is
``python -m torch.distributed.run --nproc-per-node 2 --standalone block.py`` in a fresh
folder, exactly as tests/docs runs a block. The control is plain torch with the same ending
(one all_reduce, ``dist.barrier()``, ``dist.destroy_process_group()``): what the abort rate
is without epkit.

Load: ``--parallel`` launches at once (each two ranks on this machine's cores) plus ``--load``
busy processes at the lowest priority, so that gloo's threads are descheduled at odd moments,
which is when the abort shows. Every run's outcome is appended to ``--results`` (JSON lines),
so a long measurement can be run in chunks and resumed; the table is made from that file.

    .venv/bin/python scripts/exit_stress.py                        # 200 README, 50 each block, 100 control
    .venv/bin/python scripts/exit_stress.py --only README --runs 20 # a quick look
    .venv/bin/python scripts/exit_stress.py --report                # the table of what ran so far

The exit status is 1 when any epkit run aborted, else 0. docs/usage.md ("Troubleshooting")
quotes the table of a full run.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.join(ROOT, "tests", "docs"))
from test_doc_snippets import BLOCKS, multi_rank  # noqa: E402  (the blocks tests/docs runs)

CONTROL = """import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(16)
dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
"""
# The same, with the group kept alive past destroy_process_group() as epkit kept it before issue
# 36 (torch._dynamo, imported after init_process_group, imports torch.distributed.nn.functional,
# whose default arguments then hold the default group): the mechanism, without epkit.
KEPT = CONTROL.replace('dist.init_process_group("gloo")\n',
                       'dist.init_process_group("gloo")\nimport torch._dynamo  # holds the group\n')
ABORT_SIGNS = ("terminate called", "exitcode  : -6", "exitcode: -6", "Signals.SIGABRT", "SIGABRT")
TIMEOUT = 300  # s a run; a run past it counts as a failure, not an abort


def programs() -> dict[str, str]:
    """name -> code: the controls, then README's first program, then every two-rank doc block."""
    out = {"control (plain torch)": CONTROL,
           "control, the group kept past destroy (torch._dynamo imported after init)": KEPT}
    out.update({f"{doc}:{line}": code for doc, line, code in BLOCKS if multi_rank(code)})
    return out


def code_id(code: str) -> str:
    """A program's identity in --results: its text's hash (a block keeps it when the lines
    above it move)."""
    return hashlib.sha1(code.encode()).hexdigest()[:12]


def run_once(name: str, code: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="epkit-exit-") as tmp:
        path = os.path.join(tmp, "block.py")
        with open(path, "w") as f:
            f.write(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", path]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
            rc, out = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", e.output or ""
            out = out if isinstance(out, str) else out.decode(errors="replace")
    aborted = rc != 0 and any(s in out for s in ABORT_SIGNS)
    return {"program": name, "code": code_id(code), "rc": rc, "aborted": aborted, "failed": rc != 0 and not aborted,
            "seconds": round(time.time() - t0, 2), "tail": out[-1500:] if rc != 0 else ""}


def load(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes at the lowest priority (they take only what the runs leave)."""
    return [subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
            for _ in range(n)]


def table(results: list[dict], progs: dict[str, str], names: list[str]) -> str:
    by = collections.defaultdict(list)
    for r in results:
        by[r["code"]].append(r)
    lines = ["| program | runs | aborted at exit | other failures |", "| --- | --- | --- | --- |"]
    for name in names:
        rs = by.get(code_id(progs[name]), [])
        if rs:
            lines.append(f"| {name} | {len(rs)} | {sum(r['aborted'] for r in rs)} | "
                         f"{sum(r['failed'] for r in rs)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="runs of each doc block (default 50)")
    ap.add_argument("--readme-runs", type=int, default=200,
                    help="runs of README's first program (default 200)")
    ap.add_argument("--control-runs", type=int, default=100,
                    help="runs of each plain-torch control (default 100)")
    ap.add_argument("--only", default="", help="run only the programs whose name holds this")
    ap.add_argument("--parallel", type=int, default=2, help="launches at once (default 2)")
    ap.add_argument("--load", type=int, default=1, help="busy processes beside them (default 1)")
    ap.add_argument("--results", default=os.path.join(tempfile.gettempdir(), "epkit-exit-stress.jsonl"),
                    help="JSON lines, one a run, appended to (default: in the temp folder)")
    ap.add_argument("--fresh", action="store_true", help="empty --results first")
    ap.add_argument("--report", action="store_true", help="print the table of --results, run nothing")
    args = ap.parse_args(argv)

    progs = programs()
    names = [n for n in progs if args.only in n]
    if args.fresh and os.path.exists(args.results):
        os.remove(args.results)
    done = []
    if os.path.exists(args.results):
        with open(args.results) as f:
            done = [json.loads(line) for line in f if line.strip()]
    if not args.report:
        counts = collections.Counter(r["code"] for r in done)
        todo = []
        for name in names:
            want = (args.readme_runs if name.startswith("README") else
                    args.control_runs if name.startswith("control") else args.runs)
            todo += [name] * max(0, want - counts[code_id(progs[name])])
        # interleaved, so a change of load over the measurement falls on every program alike
        order = []
        queues = {n: todo.count(n) for n in names}
        while any(queues.values()):
            for n in names:
                if queues[n]:
                    order.append(n)
                    queues[n] -= 1
        busy = load(args.load)
        pool = concurrent.futures.ThreadPoolExecutor(args.parallel)
        try:
            with open(args.results, "a") as f:
                for i, r in enumerate(pool.map(lambda n: run_once(n, progs[n]), order)):
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    done.append(r)
                    if r["aborted"] or r["failed"]:
                        print(f"{r['program']}: {'ABORTED' if r['aborted'] else 'FAILED'} "
                              f"(exit {r['rc']}):\n{r['tail']}", file=sys.stderr, flush=True)
                    if (i + 1) % 25 == 0:
                        print(f"{i + 1} of {len(order)} runs", file=sys.stderr, flush=True)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # an interrupt stops what is queued
            for p in busy:
                p.kill()
    import torch

    print(f"exit stress: torch {torch.__version__}, {os.cpu_count()} cores, "
          f"{args.parallel} launches at once beside {args.load} busy process(es); "
          "torchrun --nproc-per-node 2 --standalone each")
    print(table(done, progs, names))
    ours = {code_id(progs[n]) for n in names if not n.startswith("control")}
    epkit_aborts = sum(r["aborted"] for r in done if r["code"] in ours)
    return 1 if epkit_aborts else 0


if __name__ == "__main__":
    sys.exit(main())
