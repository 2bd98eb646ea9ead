#!/usr/bin/env python3
"""Scale benchmark of the vectorized reference simulator (epkit.reference.fast).

Simulates one dispatch + combine of a whole expert-parallel group in one process and prints the
wall time. The default case is the reference's scale target: 64 ranks, 256 experts, top-8, 4096
tokens per rank, hidden 64, float32 (target: at most 5 s on a 2-core machine).

    .venv/bin/python scripts/bench_reference.py [--ranks 64 --experts 256 --topk 8
                                                 --tokens 4096 --hidden 64 --dtype float32]

Routing: every token picks ``topk`` distinct experts uniformly at random (seeded); the
expert is the identity (``expert_y = expert_x``); the combine is weighted. Input generation is
not timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from epkit.reference import fast
from epkit.reference.common import BFLOAT16


def make_case(ranks, experts, topk, tokens, hidden, dtype, seed=0):
    rng = np.random.default_rng(seed)
    xs, idx, ws = [], [], []
    for _ in range(ranks):
        xs.append(rng.standard_normal((tokens, hidden), np.float32).astype(dtype))
        idx.append(np.argpartition(rng.random((tokens, experts), np.float32), topk, axis=1)[:, :topk]
                   .astype(np.int64))
        ws.append(rng.random((tokens, topk), np.float32))
    return xs, idx, ws


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeat", type=int, default=1, help="report the best of this many runs")
    args = ap.parse_args(argv)
    dtype = np.float32 if args.dtype == "float32" else BFLOAT16
    xs, idx, ws = make_case(args.ranks, args.experts, args.topk, args.tokens, args.hidden, dtype)
    best = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        res = fast.dispatch(xs, idx, ws, num_experts=args.experts)
        t1 = time.perf_counter()
        outs = fast.combine([r.expert_x for r in res], res, weighted=True)
        t2 = time.perf_counter()
        if best is None or t2 - t0 < best[2]:
            best = (t1 - t0, t2 - t1, t2 - t0)
        del res, outs
    rows = args.ranks * args.tokens * args.topk
    print(f"reference (vectorized): R={args.ranks} E={args.experts} K={args.topk} "
          f"T={args.tokens}/rank H={args.hidden} {args.dtype}: {rows} rows")
    print(f"dispatch {best[0]:.2f} s  combine {best[1]:.2f} s  total {best[2]:.2f} s")


if __name__ == "__main__":
    main()
