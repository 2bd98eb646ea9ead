#!/usr/bin/env python3
"""Soak: thousands of dispatch + combine + backward rounds of random shapes on a gloo group.

Spawns ``--world-size`` ranks (a local gloo group over a FileStore) that run ``--iters``
rounds, each with its own random configuration drawn identically on every rank from
``(--seed, iteration)``: tokens per rank (0..--max-tokens, different per rank), hidden size,
experts, top-k, x / expert_y dtypes, align, capacity, transport, exchange variant (ragged,
padded, auto, lazy, static) and, now and then, the MXFP8 payload. About one round in 40 puts a
bad index on one rank and expects the same ``epkit.InputError`` naming it on every rank (error
paths must not leak either). Every ``--check-every`` rounds the results (expert_x, row_src,
combine output, grad_x) are compared bit for bit with ``epkit.reference.fast``.

After ``--warmup`` rounds each rank records its resident memory (RSS, /proc/self/statm) and
its live tensors (gc-tracked ``torch.Tensor`` objects, after ``gc.collect()``); it samples
both every ``--sample-every`` rounds and at the end. The soak passes when, on every rank,
the final RSS is less than ``--max-rss-growth`` percent (5) above the post-warm-up figure
and the live tensor count has not grown. One summary line per rank and a verdict line are
printed; the exit status is 0 on a pass, 1 otherwise.

    .venv/bin/python scripts/soak.py                      # 5,000 rounds, 2 ranks
    .venv/bin/python scripts/soak.py --iters 300 --warmup 100   # a quick look

Not part of the test suite (docs/reliability.md records the figures of a full run).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "production"))  # cases.expected: the reference's answer

EXCHANGES = ("ragged", "padded", "auto", "lazy", "static")
HIDDEN = (1, 3, 8, 32, 64, 128, 256)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    import torch

    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which warns on deprecated proxies
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def draw(seed: int, it: int, R: int, max_tokens: int) -> dict:
    """The round's configuration and every rank's inputs (identical on every rank)."""
    import ml_dtypes

    rng = np.random.default_rng([seed, it])
    L = int(rng.integers(1, 5))
    E = R * L
    K = int(rng.integers(1, min(E, 4) + 1))
    H = int(rng.choice(HIDDEN))
    exchange = str(rng.choice(EXCHANGES))
    mx = H % 32 == 0 and exchange != "lazy" and rng.random() < 0.15
    cfg = dict(
        E=E, K=K, H=H, exchange=exchange, payload="mxfp8" if mx else None,
        transport=str(rng.choice(["dedup", "pairs"])),
        x_bf16=bool(rng.random() < 0.5), y_bf16=bool(rng.random() < 0.5),
        align=int(rng.integers(1, 5)),
        capacity=None if rng.random() < 0.6 else int(rng.integers(0, 2 * max_tokens)),
        weighted=bool(rng.random() < 0.7),
        bad_rank=int(rng.integers(0, R)) if rng.random() < 1 / 40 else None,
    )
    Ts = [int(rng.integers(0, max_tokens + 1)) for _ in range(R)]
    cfg["max_tokens_per_rank"] = max(Ts) + int(rng.integers(0, 3))
    xs, idxs, ws, gouts = [], [], [], []
    for T in Ts:
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        idx[rng.random((T, K)) < 0.2] = -1
        x = rng.standard_normal((T, H)).astype(np.float32)
        g = rng.standard_normal((T, H)).astype(np.float32)
        if cfg["x_bf16"]:  # values exact in bfloat16, so torch and NumPy agree on x
            x = x.astype(ml_dtypes.bfloat16)
            g = g.astype(ml_dtypes.bfloat16)
        xs.append(x)
        idxs.append(idx if rng.random() < 0.5 else idx.astype(np.int32))
        ws.append(rng.random((T, K)).astype(np.float32))
        gouts.append(g)
    if cfg["bad_rank"] is not None and Ts[cfg["bad_rank"]] > 0:
        idxs[cfg["bad_rank"]] = idxs[cfg["bad_rank"]].copy()
        idxs[cfg["bad_rank"]][0, 0] = E  # out of range
    elif cfg["bad_rank"] is not None:
        cfg["bad_rank"] = None
    return cfg, xs, idxs, ws, gouts


def to_torch(a):
    import ml_dtypes
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def one_round(group, rank, cfg, xs, idxs, ws, gouts):
    """dispatch -> y = where(padding, NaN, 2 * expert_x) -> combine -> backward; returns what
    the reference check needs (NumPy), or the InputError's rank."""
    import torch

    import epkit

    x = to_torch(xs[rank]).requires_grad_(True)
    w = to_torch(ws[rank]).requires_grad_(True)
    try:
        d = epkit.dispatch(x, to_torch(idxs[rank]), w, num_experts=cfg["E"], group=group,
                           align=cfg["align"], capacity=cfg["capacity"],
                           transport=cfg["transport"], exchange=cfg["exchange"],
                           payload=cfg["payload"], max_tokens_per_rank=cfg["max_tokens_per_rank"])
    except epkit.InputError as exc:
        return ("error", exc.rank)
    if cfg["exchange"] == "lazy":
        d = d.wait()
    ex = d.expert_x_hp if d.expert_x_hp is not None else d.expert_x.float()
    pad = (d.row_src[:, 0] < 0).unsqueeze(1)
    y = torch.where(pad, torch.tensor(float("nan")), ex * 2.0)
    y = y.to(torch.bfloat16 if cfg["y_bf16"] else torch.float32)
    out = epkit.combine(y, d, weighted=cfg["weighted"])
    if cfg["exchange"] == "lazy":
        out = out.wait()
    out.backward(to_torch(gouts[rank]).to(out.dtype))
    M = int(d.expert_offsets[-1])
    if d.expert_scale is not None:
        ex_bits = d.expert_x[:M].view(torch.uint8).numpy().copy()
    else:
        ex_bits = d.expert_x[:M].detach().view(
            torch.int16 if d.expert_x.dtype == torch.bfloat16 else torch.int32).numpy().copy()
    bits = lambda t: t.detach().view(  # noqa: E731
        torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy().copy()
    return ("ok", dict(expert_x=ex_bits, row_src=d.row_src[:M].numpy().copy(),
                       out=bits(out), grad_x=bits(x.grad)))


def reference_check(rank, cfg, xs, idxs, ws, gouts, got):
    """This rank's answer from epkit.reference.fast, bit for bit, through the production
    tests' own expectation (tests/production/cases.py: y = where(padding, NaN, 2 * expert_x)).
    MXFP8 rounds: expert_x (E4M3 bytes) and row_src only (their expert_y is the dequantized
    rows, which cases.expected does not model)."""
    import ml_dtypes

    from epkit.reference import fast as ref

    def bits(a):
        return a.view(np.uint8 if a.dtype.itemsize == 1 else
                      np.int16 if a.dtype == ml_dtypes.bfloat16 else np.int32)

    if cfg["payload"]:
        r = ref.dispatch(xs, idxs, ws, num_experts=cfg["E"], align=cfg["align"],
                         capacity=cfg["capacity"], payload="mxfp8")[rank]
        want = dict(expert_x=r.expert_x, row_src=r.row_src)
    else:
        from cases import expected

        opts = dict(E=cfg["E"], align=cfg["align"], capacity=cfg["capacity"],
                    y_dtype="bfloat16" if cfg["y_bf16"] else "float32", weighted=cfg["weighted"])
        want = expected(xs, idxs, ws, gouts, opts, ref=ref)[rank]
    return [name for name in ("expert_x", "row_src", "out", "grad_x")
            if name in want and not np.array_equal(
                want[name] if name == "row_src" else bits(want[name]), got[name])]


def worker(rank, world, store_path, queue, args):
    try:
        import torch
        import torch.distributed as dist
        from tqdm import tqdm

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        group = dist.group.WORLD
        samples, errors, checks, bad, hoard = [], 0, 0, [], []
        base = None
        t0 = time.time()
        bar = tqdm(range(args.iters), disable=rank != 0, mininterval=2.0, desc="soak",
                   unit="round", file=sys.stderr)
        for it in bar:
            cfg, xs, idxs, ws, gouts = draw(args.seed, it, world, args.max_tokens)
            kind, got = one_round(group, rank, cfg, xs, idxs, ws, gouts)
            if kind == "error":
                if got != cfg["bad_rank"]:
                    bad.append(f"round {it}: InputError names rank {got}, bad rank {cfg['bad_rank']}")
                errors += 1
            elif cfg["bad_rank"] is not None:
                bad.append(f"round {it}: bad input on rank {cfg['bad_rank']} raised nothing")
            elif args.check_every and it % args.check_every == 0:
                checks += 1
                for p in reference_check(rank, cfg, xs, idxs, ws, gouts, got):
                    bad.append(f"round {it}: {p} differs from the reference ({cfg})")
            if args.self_test_leak:
                hoard.append((got, torch.zeros(256, 64)))
            del got, xs, idxs, ws, gouts
            done = it + 1
            if done == args.warmup or (done > args.warmup and (
                    done % args.sample_every == 0 or done == args.iters)):
                sample = (done, rss_bytes(), live_tensors())
                samples.append(sample)
                if done == args.warmup:
                    base = sample
                if rank == 0:
                    bar.set_postfix(rss=f"{sample[1] / 2**20:.1f}MiB", tensors=sample[2])
        bar.close()
        dist.destroy_process_group()
        queue.put((rank, "ok", dict(samples=samples, base=base, errors=errors, checks=checks,
                                    bad=bad[:20], n_bad=len(bad), seconds=time.time() - t0)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", dict(crash=traceback.format_exc())))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=10,
                    help="compare with the reference every N rounds (0: never)")
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--max-rss-growth", type=float, default=5.0, help="percent")
    ap.add_argument("--self-test-leak", action="store_true",
                    help="keep every round's results alive (a deliberate leak): the soak must FAIL")
    ap.add_argument("--timeout", type=float, default=0, help="seconds for the whole soak "
                    "(0: 2 s per round + 120 s)")
    args = ap.parse_args(argv)
    if not 0 < args.warmup < args.iters:
        ap.error("need 0 < --warmup < --iters")

    from epkit.verify.procs import RanksFailed, run_ranks

    t0 = time.time()
    limit = args.timeout or 2.0 * args.iters + 120
    try:
        answers = run_ranks(worker, args.world_size, (args,), deadline_s=limit,
                            stop_on_error=False, prefix="epkit-soak-")
    except RanksFailed as exc:
        print(f"soak: FAIL: {exc}")
        return 1
    results = {rank: res for rank, (_, res) in answers.items()}
    wall = time.time() - t0

    ok = True
    for rank in sorted(results):
        res = results[rank]
        if "crash" in res:
            print(f"soak: rank {rank} crashed:\n{res['crash']}")
            ok = False
            continue
        (_, rss0, ten0), (_, rss1, ten1) = res["base"], res["samples"][-1]
        peak = max(s[1] for s in res["samples"])
        growth = 100.0 * (rss1 - rss0) / rss0
        trail = " ".join(f"{n}:{r / 2**20:.1f}/{t}" for n, r, t in res["samples"])
        print(f"soak: rank {rank}: RSS after warm-up {rss0 / 2**20:.1f} MiB -> final "
              f"{rss1 / 2**20:.1f} MiB ({growth:+.2f} %, peak {peak / 2**20:.1f} MiB); "
              f"live tensors {ten0} -> {ten1}; {res['errors']} InputError rounds, "
              f"{res['checks']} reference checks, {res['n_bad']} problems; "
              f"{res['seconds']:.0f} s")
        print(f"soak: rank {rank} samples (round:RSS MiB/tensors): {trail}")
        for b in res["bad"]:
            print(f"soak: rank {rank}: {b}")
        ok &= growth < args.max_rss_growth and ten1 <= ten0 and res["n_bad"] == 0
    print(f"soak: {'PASS' if ok else 'FAIL'}: {args.iters} rounds x {args.world_size} ranks "
          f"(warm-up {args.warmup}, seed {args.seed}) in {wall:.0f} s; RSS growth limit "
          f"{args.max_rss_growth} %, live tensors must not grow")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
