"""The local-kernel part of ``epkit bench``: epkit's C++ kernels in one process, no group.

A whole group's routing is made in this process (``R`` ranks of ``T`` tokens each) so that
the plan, the send buffer and the receive buffer of rank 0 are exactly what a real run would
give it; then each kernel is timed on its own (median of ``reps`` calls) through
``torch.ops.epkit.*``:

    pack           dispatch, source side: x + routing -> send rows (payload | meta)
    unpack         dispatch, expert side: received rows -> expert-major expert_x, row_src, ...
    gather_rows    combine, expert side: expert_y -> one row per received row (dedup: the
                   float32 partial sum P_d(t) of the token's slots on this rank)
    reduce_tokens  combine, source side: returned rows -> out [T, H] in the fixed order
    scatter_rows   combine backward, source side: grad_out rows -> send rows
    combine_backward_dest
                   combine backward, expert side: grad_y = cast(c * g) and the weight
                   gradient <g, y> of every expert-major row

Achieved bandwidth = (bytes read + bytes written) / time, each array counted once, compared
with ``memcpy``: ``dst.copy_(src)`` of a buffer as large as the pack's output into a
preallocated destination, counted as read + write, measured in the same run and the same
thread count. ``memcpy, fresh dst`` allocates the destination each call as the kernels do
(``at::empty``): a large fresh buffer is mapped anew and its first touch page-faults.
"""

from __future__ import annotations

import statistics
import time

import torch


def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _plan(C, words, rank: int, E: int, transport: int):
    """``epkit::plan`` with align 1, no capacity, and -1 (off) for any later option."""
    args = [words, rank, E, 1, -1, transport]
    n = len(C.plan.default._schema.arguments)
    return C.plan(*args, *([-1] * (n - len(args))))


def build(T: int, H: int, K: int, E: int, R: int, dtype, transport: str, seed: int = 0):
    """Rank 0's kernel inputs for a group of ``R`` ranks with uniform top-``K`` routing."""
    from epkit import ops
    from epkit.api import _dtype_code
    from epkit.bench_group import make_inputs

    C = ops.C
    tr = ops.TRANSPORTS[transport]
    ranks = [make_inputs(r, T, H, K, E, dtype, seed) for r in range(R)]
    # pre_error: no error, x's dtype code, no static bound (-1)
    words = torch.stack([C.prepare(x, i, w, E, R, [0, 0, 0, _dtype_code(dtype), -1], 0)
                         for x, i, w, _ in ranks])
    plans = [_plan(C, words, r, E, tr) for r in range(R)]
    sl = ops.plan_slices(R, E)
    # What every rank sends to rank 0, in source order: rank 0's receive buffer.
    chunks = []
    for r, (x, i, w, _) in enumerate(ranks):
        send, _ = C.pack(x, i, w, plans[r], tr, R, int(plans[r][ops.SEND_ROWS]))
        counts = plans[r][sl["send_counts"]].tolist()
        chunks.append(send[: counts[0]])
    x, i, w, _ = ranks[0]
    return dict(C=C, tr=tr, x=x, idx=i, w=w, plan=plans[0], recv=torch.cat(chunks), R=R, E=E,
                S=int(plans[0][ops.SEND_ROWS]), M=int(plans[0][ops.EXPERT_ROWS]))


def measure(T: int, H: int, K: int, E: int, R: int, dtype, transport: str, threads: int,
            reps: int, seed: int = 0) -> dict:
    """Every kernel's median time and achieved GB/s, and memcpy's, at ``threads`` threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = build(T, H, K, E, R, dtype, transport, seed)
        C, tr = b["C"], b["tr"]
        x, idx, w, plan = b["x"], b["idx"], b["w"], b["plan"]
        isz = x.element_size()
        send, send_map = C.pack(x, idx, w, plan, tr, R, b["S"])
        expert_x, row_src, row_weight, recv_map = C.unpack(b["recv"], plan, tr, H, dtype, K, b["M"])
        rows = C.gather_rows(expert_x, recv_map, row_weight, tr, True)
        back = torch.randn((b["S"], H)).to(rows.dtype)   # the rows coming home: same shape
        S, N, M = b["S"], b["recv"].shape[0], b["M"]
        grad_out = torch.randn((T, H)).to(dtype)
        grad_recv = torch.randn((N, H)).to(dtype)        # grad_out rows as the experts get them
        route = idx.numel() * (idx.element_size() + 4)
        kernels = {
            "pack": (lambda: C.pack(x, idx, w, plan, tr, R, S),
                     x.numel() * isz + route + send.numel()),
            "unpack": (lambda: C.unpack(b["recv"], plan, tr, H, dtype, K, M),
                       b["recv"].numel() + M * (H * isz + 3 * 8 + 4) + recv_map.numel() * 8),
            "gather_rows": (lambda: C.gather_rows(expert_x, recv_map, row_weight, tr, True),
                            expert_x.numel() * isz + recv_map.numel() * 8 + M * 4
                            + rows.numel() * rows.element_size()),
            "reduce_tokens": (lambda: C.reduce_tokens(back, send_map, idx, w, E, R, tr, True, dtype),
                              back.numel() * back.element_size() + send_map.numel() * 8 + route
                              + T * H * isz),
            "scatter_rows": (lambda: C.scatter_rows(grad_out, send_map, S),
                             grad_out.numel() * isz + send_map.numel() * 8 + S * H * isz),
            "combine_backward_dest": (
                lambda: C.combine_backward_dest(grad_recv, recv_map, row_weight, expert_x, True),
                grad_recv.numel() * isz + recv_map.numel() * 8 + M * 4
                + 2 * expert_x.numel() * isz + M * 4),
        }
        out = {"transport": transport, "threads": threads, "send_bytes": send.numel(),
               "rows": {}}
        src = torch.randint(0, 255, (send.numel(),), dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_copy = _median_time(lambda: dst.copy_(src), reps)
        t_fresh = _median_time(lambda: torch.empty_like(src).copy_(src), reps)
        memcpy = 2 * src.numel() / t_copy / 1e9
        out["memcpy_gbps"] = memcpy
        out["memcpy_fresh_gbps"] = 2 * src.numel() / t_fresh / 1e9
        for name, (fn, nbytes) in kernels.items():
            t = _median_time(fn, reps)
            gbps = nbytes / t / 1e9
            out["rows"][name] = {"median_ms": 1e3 * t, "bytes": int(nbytes), "gbps": gbps,
                                 "vs_memcpy": gbps / memcpy}
        return out
    finally:
        torch.set_num_threads(saved)
