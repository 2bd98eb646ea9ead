"""The GPU kernel benchmark of scripts/gpu_check.sh: epkit's GPU (Triton) kernels on one device.

A group of R ranks (default 8, one H200 node) with T tokens each (default 16384), hidden H
(7168), bfloat16, top-K (8) of E (256) experts, uniform random routing, is made on the device;
rank 0's kernels are then timed on their own (CUDA events, median of --reps calls):

    pack           dispatch, source side: x + routing -> send rows (payload | meta)
    unpack         dispatch, expert side: received rows -> expert-major expert_x, row_src, ...
    gather_rows    combine, expert side (dedup: the float32 partial per token and rank)
    reduce_tokens  combine, source side: returned rows -> out [T, H] in the fixed order
    combine        gather_rows + reduce_tokens

Achieved bandwidth = (bytes read + bytes written) / time, each array counted once (index
scratch not counted), against the device's copy bandwidth measured in the same run:
``dst.copy_(src)`` of a buffer as large as the pack's output, counted as read + write.

Before anything is timed, the kernels' outputs are checked bit for bit against the CPU kernels
on the same shape with --check-tokens tokens per rank (default 1024; 0: the timed size itself,
slow on the host): every rank's pack, rank 0's unpack, gather_rows and reduce_tokens. A
mismatch is reported and the exit code is 2; nothing is timed then.

    python scripts/gpu_bench.py [--tokens 16384 --hidden 7168 --topk 8 --experts 256 --ranks 8]
                                [--transports dedup,pairs] [--reps 20] [--check-tokens 1024]
                                [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _time(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def _routing(T, K, E, gen, device):
    import torch

    scores = torch.rand(T, E, generator=gen, device=device)
    return scores.topk(K, dim=1).indices.to(torch.int32)


def _group(T, H, K, E, R, device, seed):
    """Every rank's inputs on `device`: x [T, H] bfloat16, top-K routing, weights; and the count
    words of the ragged exchange."""
    import torch

    from epkit import ops
    from epkit.collectives import dtype_code

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16
    xs = [torch.randn(T, H, generator=gen, device=device).to(dtype) for _ in range(R)]
    idxs = [_routing(T, K, E, gen, device) for _ in range(R)]
    ws = [torch.rand(T, K, generator=gen, device=device) for _ in range(R)]
    words = torch.stack([ops.C.prepare(x, i, w, E, R, [0, 0, 0, dtype_code(dtype), -1], 0)
                         for x, i, w in zip(xs, idxs, ws)])
    return xs, idxs, ws, words, gen


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8)


def check(T, H, K, E, R, transport, seed=1, device="cuda") -> list[str]:
    """The kernels of measure() at T tokens per rank against the CPU kernels, bit for bit
    (the CPU kernels are the specification). Returns the names of the outputs that differ.
    (device="cpu" compares the CPU kernels with themselves: a plumbing test without a GPU.)"""
    import torch

    from epkit import ops
    from epkit import plan as W
    from epkit.collectives import CODES

    C = ops.C
    dev = torch.device(device)
    tr = W.TRANSPORTS[transport]
    dtype = torch.bfloat16
    xs, idxs, ws, words, _ = _group(T, H, K, E, R, dev, seed)
    bad = []

    def same(name, a, b):
        if not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.cpu()),
                                                                          _bits(b.cpu()))):
            bad.append(name)

    plans = [C.plan(words, r, E, 1, -1, tr, CODES["ragged"], -1) for r in range(R)]
    hps = [C.plan(words.cpu(), r, E, 1, -1, tr, CODES["ragged"], -1) for r in range(R)]
    for r in range(R):
        same(f"plan[{r}]", plans[r], hps[r])
    sl = W.plan_slices(R, E)
    chunks = []
    for r in range(R):
        SB = int(hps[r][W.SEND_BYTES])
        g = C.pack(xs[r], idxs[r], ws[r], plans[r], tr, R, SB, hps[r])
        c = C.pack(xs[r].cpu(), idxs[r].cpu(), ws[r].cpu(), hps[r], tr, R, SB)
        same(f"pack[{r}].send", g[0], c[0])
        same(f"pack[{r}].send_map", g[1], c[1])
        chunks.append(c[0][: int(hps[r][sl["send_bytes"]][0])])
    recv = torch.cat(chunks)
    hp = hps[0]
    N, M, S = (int(hp[k]) for k in (W.RECV_ROWS, W.EXPERT_ROWS, W.SEND_ROWS))
    ug = C.unpack(recv.to(dev), plans[0], tr, H, dtype, K, N, M, hp)
    uc = C.unpack(recv, hp, tr, H, dtype, K, N, M)
    for name, a, b in zip(("expert_x", "row_src", "row_weight", "recv_map"), ug, uc):
        same(f"unpack.{name}", a, b)
    y = (uc[0].float() * 2.0).to(dtype)
    same("gather_rows", C.gather_rows(y.to(dev), ug[3], ug[2], tr, True),
         C.gather_rows(y, uc[3], uc[2], tr, True))
    rows_dtype = torch.float32 if transport == "dedup" else dtype
    back = torch.randn(S, H, generator=torch.Generator().manual_seed(seed)).to(rows_dtype)
    send_map = C.pack(xs[0].cpu(), idxs[0].cpu(), ws[0].cpu(), hp, tr, R,
                      int(hp[W.SEND_BYTES]))[1]
    same("reduce_tokens",
         C.reduce_tokens(back.to(dev), send_map.to(dev), idxs[0], ws[0], E, R, tr, True, dtype),
         C.reduce_tokens(back, send_map, idxs[0].cpu(), ws[0].cpu(), E, R, tr, True, dtype))
    from epkit.device import unpack_status

    if unpack_status(dev):
        bad.append("unpack status word (a mismatch was flagged)")
    return bad


def measure(T, H, K, E, R, transport, reps, seed=0):
    import torch

    from epkit import ops
    from epkit import plan as W
    from epkit.collectives import CODES

    C = ops.C
    dev = torch.device("cuda")
    tr = W.TRANSPORTS[transport]
    dtype = torch.bfloat16
    xs, idxs, ws, words, gen = _group(T, H, K, E, R, dev, seed)
    plans = [C.plan(words, r, E, 1, -1, tr, CODES["ragged"], -1) for r in range(R)]
    hps = [p.cpu() for p in plans]
    sl = W.plan_slices(R, E)
    # rank 0's receive buffer: what every rank's pack addresses to rank 0
    chunks = []
    for r in range(R):
        send, _ = C.pack(xs[r], idxs[r], ws[r], plans[r], tr, R, int(hps[r][W.SEND_BYTES]),
                         hps[r])
        chunks.append(send[: int(hps[r][sl["send_bytes"]][0])].clone())
        del send
    recv = torch.cat(chunks)
    del chunks
    x, idx, w, plan, hp = xs[0], idxs[0], ws[0], plans[0], hps[0]
    del xs[1:], idxs[1:], ws[1:]
    SB, N, M = (int(hp[k]) for k in (W.SEND_BYTES, W.RECV_ROWS, W.EXPERT_ROWS))
    send, send_map = C.pack(x, idx, w, plan, tr, R, SB, hp)
    expert_x, row_src, row_weight, recv_map = C.unpack(recv, plan, tr, H, dtype, K, N, M, hp)
    rows = C.gather_rows(expert_x, recv_map, row_weight, tr, True)
    S = int(hp[W.SEND_ROWS])
    back = torch.randn(S, H, generator=gen, device=dev).to(rows.dtype)  # the rows coming home
    isz = x.element_size()
    route = idx.numel() * (idx.element_size() + 4)
    kernels = {
        "pack": (lambda: C.pack(x, idx, w, plan, tr, R, SB, hp),  # hp: the host words
                 x.numel() * isz + route + send.numel() + send_map.numel() * 8),
        "unpack": (lambda: C.unpack(recv, plan, tr, H, dtype, K, N, M, hp),
                   recv.numel() + M * (H * isz + 3 * 8 + 4) + recv_map.numel() * 8),
        "gather_rows": (lambda: C.gather_rows(expert_x, recv_map, row_weight, tr, True),
                        expert_x.numel() * isz + recv_map.numel() * 8 + M * 4
                        + rows.numel() * rows.element_size()),
        "reduce_tokens": (lambda: C.reduce_tokens(back, send_map, idx, w, E, R, tr, True, dtype),
                          back.numel() * back.element_size() + send_map.numel() * 8 + route
                          + T * H * isz),
    }
    src = torch.randint(0, 255, (send.numel(),), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_copy = _time(lambda: dst.copy_(src), reps)
    copy_gbps = 2 * src.numel() / t_copy / 1e9
    out = {"transport": transport, "tokens": T, "hidden": H, "topk": K, "experts": E, "ranks": R,
           "send_bytes": SB, "recv_rows": N, "expert_rows": M, "copy_gbps": copy_gbps,
           "rows": {}}
    for name, (fn, nbytes) in kernels.items():
        t = _time(fn, reps)
        out["rows"][name] = {"median_ms": 1e3 * t, "bytes": int(nbytes), "gbps": nbytes / t / 1e9,
                             "vs_copy": nbytes / t / 1e9 / copy_gbps}
    g, r_ = out["rows"]["gather_rows"], out["rows"]["reduce_tokens"]
    t = (g["median_ms"] + r_["median_ms"]) / 1e3
    nbytes = g["bytes"] + r_["bytes"]
    out["rows"]["combine"] = {"median_ms": 1e3 * t, "bytes": nbytes, "gbps": nbytes / t / 1e9,
                              "vs_copy": nbytes / t / 1e9 / copy_gbps}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--transports", default="dedup,pairs")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--check-tokens", type=int, default=1024,
                   help="tokens per rank of the CPU check before timing (0: --tokens)")
    p.add_argument("--target", type=float, default=0.70, help="pack/combine vs copy")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 3
    results = []
    print(f"{torch.cuda.get_device_name()}: T={a.tokens} H={a.hidden} bf16 top-{a.topk} of "
          f"{a.experts} experts, {a.ranks} ranks simulated (rank 0 timed), median of {a.reps}")
    ok = True
    ct = a.check_tokens or a.tokens
    for transport in a.transports.split(","):
        bad = check(ct, a.hidden, a.topk, a.experts, a.ranks, transport)
        print(f"check {transport} at T={ct} against the CPU kernels: "
              f"{'bit for bit' if not bad else 'DIFFERS: ' + ', '.join(bad)}")
        if bad:
            print("gpu_bench: outputs differ from the CPU kernels; nothing timed", file=sys.stderr)
            return 2
        torch.cuda.empty_cache()
    for transport in a.transports.split(","):
        r = measure(a.tokens, a.hidden, a.topk, a.experts, a.ranks, transport, a.reps)
        results.append(r)
        print(f"\n{transport}: device copy {r['copy_gbps']:.0f} GB/s (read + write)")
        print(f"  {'kernel':<14} {'ms':>8} {'GB':>7} {'GB/s':>7} {'vs copy':>8}")
        for name, row in r["rows"].items():
            print(f"  {name:<14} {row['median_ms']:8.3f} {row['bytes'] / 1e9:7.3f} "
                  f"{row['gbps']:7.0f} {row['vs_copy']:8.0%}")
            if name in ("pack", "combine") and row["vs_copy"] < a.target:
                ok = False
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "target": a.target,
                       "results": results}, f, indent=1)
    print(f"\npack and combine >= {a.target:.0%} of copy: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
