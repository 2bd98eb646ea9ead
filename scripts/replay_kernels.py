#!/usr/bin/env python3
"""epkit's local kernels alone, at ``epkit bench``'s workload, without the rest of the bench.

Records one real epkit step per transport (forward + backward) on rank 0 of a local gloo group,
exactly as ``epkit bench`` does (:mod:`epkit.tools.bench_kernels`), then replays every kernel call in
this process (best of ``--reps``) against memcpy and prints ``epkit bench``'s kernel table. A
kernel-only figure in a few seconds, for one kernel change against another:

    .venv/bin/python scripts/replay_kernels.py [--alloc reuse] [--reps 15] [--world-size 4
        --tokens 2048 --hidden 1024 --topk 8 --experts 64 --dtype bfloat16]

``--alloc`` is ``epkit bench``'s (the environment is set and the script restarts itself, since
glibc and torch read it when a process starts).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile


def record(rank: int, world: int, store: str, cfg: dict, out: str) -> None:
    """One rank of the recording group; rank 0 saves its kernel calls per transport."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from epkit.tools.bench_group import epkit_step, make_inputs
    from epkit.tools.bench_kernels import KernelRecorder

    x, idx, w, grad = make_inputs(rank, cfg["tokens"], cfg["hidden"], cfg["topk"],
                                  cfg["experts"], getattr(torch, cfg["dtype"]), 0)
    for transport in ("dedup", "pairs"):
        step = epkit_step(transport, dist.group.WORLD, cfg["experts"], x, idx, w, grad)
        step()  # warm: the recorded step is not the process's first
        rec = KernelRecorder()
        with rec.active():
            step()
        if rank == 0:
            torch.save([(n, a, k, b, o) for n, _, a, k, b, o in rec.calls],
                       os.path.join(out, f"{transport}.pt"))
        dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("world-size", 4), ("tokens", 2048), ("hidden", 1024), ("topk", 8),
                          ("experts", 64), ("reps", 15)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--alloc", choices=["default", "reuse", "thp"], default="default")
    args = ap.parse_args()
    from epkit.tools.bench import ALLOC_ENV, format_kernels

    env = ALLOC_ENV[args.alloc]
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **env})
    import torch
    import torch.multiprocessing as mp

    import epkit.ops  # noqa: F401  (builds the extension once, before the group starts)
    from epkit.tools.bench_kernels import replay

    cfg = {k: getattr(args, k) for k in ("tokens", "hidden", "topk", "experts", "dtype")}
    with tempfile.TemporaryDirectory(prefix="epkit-replay-") as tmp:
        mp.spawn(record, args=(args.world_size, os.path.join(tmp, "store"), cfg, tmp),
                 nprocs=args.world_size)
        print(f"alloc {args.alloc}, {args.world_size} ranks, {cfg}")
        for transport in ("dedup", "pairs"):
            calls = [(n, getattr(torch.ops.epkit, n), a, k, b, o) for n, a, k, b, o in
                     torch.load(os.path.join(tmp, f"{transport}.pt"), weights_only=False)]
            print(format_kernels([dict(replay(calls, args.reps, 1), transport=transport)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
