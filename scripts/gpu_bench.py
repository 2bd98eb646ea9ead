"""The GPU kernel benchmark of scripts/gpu_check.sh: epkit's CUDA kernels on one device.

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

    python scripts/gpu_bench.py [--tokens 16384 --hidden 7168 --topk 8 --experts 256 --ranks 8]
                                [--transports dedup,pairs] [--reps 20] [--json out.json]
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


def measure(T, H, K, E, R, transport, reps, seed=0):
    import torch

    from epkit import ops
    from epkit.api import _dtype_code
    from epkit.collectives import CODES

    C = ops.C
    dev = torch.device("cuda")
    tr = ops.TRANSPORTS[transport]
    gen = torch.Generator(device=dev).manual_seed(seed)
    dtype = torch.bfloat16
    xs = [torch.randn(T, H, generator=gen, device=dev).to(dtype) for _ in range(R)]
    idxs = [_routing(T, K, E, gen, dev) for _ in range(R)]
    ws = [torch.rand(T, K, generator=gen, device=dev) for _ in range(R)]
    words = torch.stack([C.prepare(x, i, w, E, R, [0, 0, 0, _dtype_code(dtype), -1], 0)
                         for x, i, w in zip(xs, idxs, ws)])
    plans = [C.plan(words, r, E, 1, -1, tr, CODES["ragged"], -1) for r in range(R)]
    hps = [p.cpu() for p in plans]
    sl = ops.plan_slices(R, E)
    # rank 0's receive buffer: what every rank's pack addresses to rank 0
    chunks = []
    for r in range(R):
        send, _ = C.pack(xs[r], idxs[r], ws[r], plans[r], tr, R, int(hps[r][ops.SEND_BYTES]))
        chunks.append(send[: int(hps[r][sl["send_bytes"]][0])].clone())
        del send
    recv = torch.cat(chunks)
    del chunks
    x, idx, w, plan, hp = xs[0], idxs[0], ws[0], plans[0], hps[0]
    del xs[1:], idxs[1:], ws[1:]
    SB, N, M = (int(hp[k]) for k in (ops.SEND_BYTES, ops.RECV_ROWS, ops.EXPERT_ROWS))
    send, send_map = C.pack(x, idx, w, plan, tr, R, SB)
    expert_x, row_src, row_weight, recv_map = C.unpack(recv, plan, tr, H, dtype, K, N, M)
    rows = C.gather_rows(expert_x, recv_map, row_weight, tr, True)
    S = int(hp[ops.SEND_ROWS])
    back = torch.randn(S, H, generator=gen, device=dev).to(rows.dtype)  # the rows coming home
    isz = x.element_size()
    route = idx.numel() * (idx.element_size() + 4)
    kernels = {
        "pack": (lambda: C.pack(x, idx, w, plan, tr, R, SB),
                 x.numel() * isz + route + send.numel() + send_map.numel() * 8),
        "unpack": (lambda: C.unpack(recv, plan, tr, H, dtype, K, N, M),
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
    p.add_argument("--target", type=float, default=0.70, help="pack/combine vs copy (issue 9)")
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
