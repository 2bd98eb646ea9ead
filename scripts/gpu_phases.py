"""The launch-bound regime on a GPU: each phase of a small training step, timed, next to what it
launches. Run under torchrun, one process per GPU (scripts/gpu_check.sh's phase step does)::

    torchrun --standalone --nproc-per-node 8 scripts/gpu_phases.py --tokens 128

At T = 128 tokens a rank (a decode step, a small micro-batch) the bytes are few and the time is
the launches, collectives and host waits: docs/design.md's "Launch budget" counts them
(``epkit bench --launches``); this measures what they cost. For each transport and exchange:
the median over ``--iters`` steps of dispatch, combine and the backward of both (CUDA events
around each phase, the slowest rank's), and the step's kernel launches, collectives and host
waits counted on rank 0 (``bench_launches.count_step``). Goal (docs/benchmarks.md, "GPU"):
dispatch + combine under 100 us at T = 128 a rank on 8 ranks of one node.

Without CUDA it runs over gloo on CPU (a dry run of the script itself, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

GOAL_US = 100.0  # dispatch + combine at T = 128 a rank, 8 ranks of one node
MODES = ("dedup/auto", "dedup/static", "pairs/auto", "pairs/static")


def _now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def time_step(disp, x, idx, w, cuda: bool) -> dict:
    """Seconds of each phase of one step on this rank (the device synchronized around each)."""
    t0 = _now(cuda)
    d = disp.dispatch(x, idx, w)
    t1 = _now(cuda)
    out = disp.combine(d.expert_x, d)
    t2 = _now(cuda)
    torch.autograd.grad(out, [x, w], torch.ones_like(out))
    t3 = _now(cuda)
    return {"dispatch": t1 - t0, "combine": t2 - t1, "backward": t3 - t2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    from epkit.tools import bench_launches as bl

    rank, world = dist.get_rank(), dist.get_world_size()
    E = args.experts - args.experts % world or world
    x, idx, w = bl.inputs(rank, args.tokens, args.hidden, E, args.topk)
    if cuda:
        x = x.detach().cuda().requires_grad_()
        idx, w = idx.cuda(), w.detach().cuda().requires_grad_()
    rows = []
    for mode in MODES:
        disp = bl.dispatcher(mode, dist.group.WORLD, E, args.tokens)
        for _ in range(args.warmup):
            time_step(disp, x, idx, w, cuda)
        times = [time_step(disp, x, idx, w, cuda) for _ in range(args.iters)]
        med = {p: statistics.median(t[p] for t in times) for p in bl.PHASES}
        worst = torch.tensor([med[p] for p in bl.PHASES], dtype=torch.float64)
        worst = worst.cuda() if cuda else worst
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's medians
        counts = bl.count_step(disp, x, idx, w)
        rows.append(dict(mode=mode, us={p: 1e6 * float(v) for p, v in zip(bl.PHASES, worst)},
                         kernels={p: counts[p]["kernels"] for p in bl.PHASES},
                         collectives=sum(counts[p]["collectives"] for p in bl.PHASES),
                         host_waits=[counts[p]["host_waits"] for p in bl.PHASES]))
    if rank == 0:
        print(f"gpu_phases: {world} ranks ({'nccl' if cuda else 'gloo, a dry run'}), "
              f"T={args.tokens} H={args.hidden} E={E} K={args.topk}, median of {args.iters}")
        print(f"{'mode':<14} {'dispatch us':>11} {'combine us':>10} {'backward us':>11} "
              f"{'d+c us':>8}  kernels d/c/b  collectives  host waits  goal d+c < {GOAL_US:.0f} us")
        for r in rows:
            dc = r["us"]["dispatch"] + r["us"]["combine"]
            k = "/".join(str(r["kernels"][p]) for p in bl.PHASES)
            print(f"{r['mode']:<14} {r['us']['dispatch']:>11.1f} {r['us']['combine']:>10.1f} "
                  f"{r['us']['backward']:>11.1f} {dc:>8.1f}  {k:<13} {r['collectives']:<12} "
                  f"{'/'.join(map(str, r['host_waits'])):<11} "
                  f"{'met' if dc < GOAL_US else 'MISSED'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=world, cuda=cuda, args=vars(args), rows=rows), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
