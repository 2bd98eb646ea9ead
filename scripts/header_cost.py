"""What the call header costs (docs/reliability.md 1b): the 18-word all-gather every epkit call
opens with, against a whole dispatch + combine + backward step, on a local gloo group.

    .venv/bin/python scripts/header_cost.py [--ranks 4] [--tokens 2048] [--hidden 1024]

A step makes four headers (dispatch, combine and their backward passes). Prints the median of
the header alone, and of the step with the headers and without them (this script bypasses them
for the comparison; the library has no such switch), interleaved step by step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from epkit.verify.procs import run_ranks


def _rank(rank, world, store_path, results, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.ranks), rank=rank,
                            world_size=args.ranks)
    import epkit
    from epkit import agree

    group = dist.group.WORLD
    words = agree.header(agree.EXCHANGE, agree.NO_OPTIONS, (0, 0, 0))
    head = []
    for i in range(args.header_iters + 20):
        t0 = time.perf_counter()
        agree.agree(group, words, "header_cost")
        if i >= 20:
            head.append(time.perf_counter() - t0)
    g = torch.Generator().manual_seed(rank)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).requires_grad_(True)
    disp = epkit.Dispatcher(group, E)
    real = agree.agree

    def bypass(group, words, what):  # for this measurement only: the step without headers
        agree._state(group).seq += 1

    steps = {"with": [], "without": []}
    for i in range(2 * (args.steps + 2)):
        kind = "with" if i % 2 == 0 else "without"  # interleaved: drift hits both alike
        agree.agree = real if kind == "with" else bypass
        dist.barrier()
        t0 = time.perf_counter()
        d = disp.dispatch(x, idx, w)
        y = disp.combine(d.expert_x * 2, d)
        y.float().sum().backward()
        if i >= 4:
            steps[kind].append(time.perf_counter() - t0)
    agree.agree = real
    results.put((rank, "ok", (statistics.median(head), statistics.median(steps["with"]),
                              statistics.median(steps["without"]))))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--header-iters", type=int, default=500)
    args = ap.parse_args()
    got = run_ranks(_rank, args.ranks, (args,), deadline_s=1200, prefix="epkit-header-")
    head, step, bare = got[0][1]  # rank 0's timings
    print(f"header_cost: {args.ranks} gloo ranks, T={args.tokens} H={args.hidden} "
          f"E={args.experts} K={args.topk} bfloat16")
    print(f"  one call header (18-word all-gather): {head * 1e6:.0f} us (median of "
          f"{args.header_iters})")
    print(f"  dispatch + combine + backward step:   {step * 1e3:.1f} ms with the headers, "
          f"{bare * 1e3:.1f} ms without (medians of {args.steps}, interleaved)")
    print(f"  the four headers cost {(step - bare) * 1e3:.1f} ms = {(step / bare - 1) * 100:.1f} % "
          f"of the step")


if __name__ == "__main__":
    main()
