"""Rank functions of test_host_reads.py: dispatch -> combine -> backward on the device path
(``EPKIT_KERNELS=triton``: the interpreted Triton kernels stand in for the GPU's), the host
reads of would-be device memory counted per phase and per epkit operation."""

from __future__ import annotations

import torch

EXCHANGES = ("ragged", "padded", "equal", "auto", "lazy", "static")
PAYLOADS = (None, "mxfp8", "fp8_block128")
T, E, K = 4, 6, 3  # tiny: the interpreter is slow


def hidden(payload) -> int:
    """The smallest H the payload takes (its scale block)."""
    return 128 if payload == "fp8_block128" else 32


def inputs(rank: int, R: int, dtype, uniform: bool, H: int = 32, seed: int = 0):
    """``(x [T, H], topk_idx [T, K], topk_weights [T, K])`` of this rank. ``uniform``: every
    rank sends every rank the same rows (the equal exchange needs it): token t's slots name one
    expert on each rank; else random distinct experts, some token rows with 3 slots on a rank."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, H, generator=g).to(dtype)
    L = E // R
    if uniform:
        idx = torch.stack([torch.full((T,), r * L, dtype=torch.int64) + torch.arange(T) % L
                           for r in range(R)], 1)
        idx = torch.cat([idx, torch.full((T, K - R), -1, dtype=torch.int64)], 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        idx[0] = torch.arange(K)  # token 0: all of its slots on rank 0 (3 > per = 2)
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _seen(reads) -> list:
    return [tuple(r) for r in reads.take()]


def phases(group, rank, opts: dict, dtype=torch.bfloat16, uniform=False, check_static=False):
    """One dispatch -> combine -> backward under ``opts``; returns the reads of each phase as
    ``{phase: [(operation, kind, where)]}`` and the outputs (bits) for cross-checks between options."""
    import epkit
    from epkit.device import count_host_reads

    R = group.size()
    x, idx, w = inputs(rank, R, dtype, uniform, hidden(opts.get("payload")))
    x.requires_grad_(True)
    w.requires_grad_(True)
    lazy = opts.get("exchange") == "lazy"
    out = {}
    with count_host_reads() as reads:
        d = epkit.dispatch(x, idx, w, num_experts=E, group=group, **opts)
        if lazy:
            d = d.wait()
        out["dispatch"] = _seen(reads)
        rows = d.expert_x_hp if d.expert_x_hp is not None else d.expert_x
        y = (rows * 2).to(rows.dtype)
        c = epkit.combine(y, d)
        if lazy:
            c = c.wait()
        out["combine"] = _seen(reads)
        c.float().square().sum().backward()
        out["backward"] = _seen(reads)
        if check_static:
            from epkit.device import check_static as check

            check(d)
            out["check_static"] = _seen(reads)
    bits = {"combine": c.detach().float(), "grad_x": x.grad.float(), "grad_w": w.grad.float()}
    return out, bits


# A quantized payload takes its own path through dispatch once per kind of exchange: eager
# (ragged, padded, equal and auto share it), lazy and static; the rest is the same as None's.
PAYLOAD_EXCHANGES = ("ragged", "lazy", "static")


def matrix(group, rank, transport: str, dtype_name: str):
    """Every exchange of ``transport`` without a payload, and each quantized payload under
    every kind of exchange (hier: its exchanges, no payload): ``[(exchange, payload, reads,
    bits)]``."""
    dtype = getattr(torch, dtype_name)
    results = []
    hier = transport == "hier"
    for exchange in EXCHANGES:
        if hier and exchange in ("lazy", "static"):
            continue
        for payload in ((None,) if hier or exchange not in PAYLOAD_EXCHANGES else PAYLOADS):
            opts = dict(transport=transport, exchange=exchange, payload=payload)
            if exchange == "static":
                opts["max_tokens_per_rank"] = T
            reads, bits = phases(group, rank, opts, dtype, uniform=exchange == "equal",
                                 check_static=exchange == "static")
            results.append((exchange, payload, reads, bits))
    return results


def transports_agree(group, rank):
    """The bits of pairs, dedup and hier (auto exchange, no payload, one rank a node): the
    semantics makes them equal, so hier's device-path return path (sizes from its plan, no boolean
    index) is checked against code it does not share."""
    return [phases(group, rank, dict(transport=t), torch.bfloat16)[1]
            for t in ("pairs", "dedup", "hier")]


def nccl_only_headers(group, rank):
    """The reads on a group without a CPU backend, where the call header lives on the device:
    here the header's gather buffer left unmarked (as device memory) for one step."""
    from epkit import agree

    marked = agree.mark_host
    agree.mark_host = lambda t: t
    try:
        return phases(group, rank, dict(transport="dedup"), torch.bfloat16)[0]
    finally:
        agree.mark_host = marked


def capacity_cases(group, rank, transport: str):
    """Capacity drops (a capacity, a capacity factor) under the auto and static exchanges
    (hier: auto only)."""
    results = []
    for name, extra in (("capacity", dict(capacity=2)), ("factor", dict(capacity_factor=0.5)),
                        ("capacity static", dict(capacity=2, exchange="static",
                                                 max_tokens_per_rank=T))):
        if transport == "hier" and "exchange" in extra:
            continue
        reads, bits = phases(group, rank, dict(transport=transport, **extra), torch.bfloat16)
        results.append((name, reads, bits))
    return results


def planted_read(group, rank):
    """A read the counter must catch: ``.item()`` on a device-path tensor inside an epkit
    operation (combine_tokens' return path, patched for the call), and ``int()`` of a dispatch
    output in the caller; the plan's mirror read is not one."""
    import epkit
    from epkit import moves
    from epkit.device import count_host_reads

    x, idx, w = inputs(rank, group.size(), torch.float32, False)
    d = epkit.dispatch(x, idx, w, num_experts=E, group=group, transport="pairs")
    real = moves.reduce_back

    def planted(back, *args, **kwargs):
        back.rows.sum().item()  # the planted host read of device memory
        return real(back, *args, **kwargs)

    moves.reduce_back = planted
    import epkit.ops as ops

    ops.reduce_back = planted
    try:
        with count_host_reads() as reads:
            epkit.combine(d.expert_x, d)
            in_op = reads.take()
            int(d.tokens_per_expert.sum())
            in_caller = reads.take()
            int(d.handle.plan_host[0])  # the mirror: host memory, never a device read
            mirror = reads.take()
    finally:
        moves.reduce_back = real
        ops.reduce_back = real
    return ([(r.op, r.kind) for r in in_op], [(r.op, r.kind) for r in in_caller],
            len(mirror))


def paths(group, rank):
    """Which tensors the device path treats as device memory in this process."""
    import epkit
    from epkit.device import device_path

    x, idx, w = inputs(rank, group.size(), torch.float32, False)
    d = epkit.dispatch(x, idx, w, num_experts=E, group=group, transport="pairs")
    return (device_path(d.expert_x), device_path(d.handle.plan), device_path(d.handle.plan_host),
            device_path(d.handle.plan_host[3:5]))


def _table():
    """Print the measured reads per transport, exchange, payload and phase (the Python above
    the kernels, and apart the kernels' own): ``python tests/production/host_read_fns.py``."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ["EPKIT_KERNELS"] = "triton"
    # the workers look functions up by module name, and this file runs as __main__ here
    import host_read_fns as fns
    from group import GroupPool

    def fmt(reads, kernel):
        """``n (where: count, ...)``: by operation, or for the kernels by module."""
        got = [r for r in reads if r[2].startswith("triton/") == kernel]
        by: dict = {}
        for r in got:
            key = r[2].split(":")[0] if kernel else r[0]
            by[key] = by.get(key, 0) + 1
        return str(len(got)) + ("" if not got else
                                " (" + ", ".join(f"{k}: {n}" for k, n in sorted(by.items())) + ")")

    pool = GroupPool(world=2, timeout=300)
    try:
        print("| transport | exchange | payload | dispatch | combine | backward | kernels' own |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        rows = []
        for transport in ("pairs", "dedup", "hier"):
            for exchange, payload, reads, _ in pool.run(fns.matrix, 2, [transport] * 2,
                                                        ["bfloat16"] * 2)[0]:
                rows.append((transport, exchange, str(payload), reads))
        for transport in ("pairs", "dedup"):
            for name, reads, _ in pool.run(fns.capacity_cases, 2, [transport] * 2)[0]:
                rows.append((transport, name, "None", reads))
        rows.append(("dedup", "auto, NCCL-only header", "None",
                     pool.run(fns.nccl_only_headers, 2)[0]))
        for transport, exchange, payload, reads in rows:
            kernel = sum((reads[p] for p in ("dispatch", "combine", "backward")), [])
            print(f"| {transport} | {exchange} | {payload} | {fmt(reads['dispatch'], False)} | "
                  f"{fmt(reads['combine'], False)} | {fmt(reads['backward'], False)} | "
                  f"{fmt(kernel, True)} |")
    finally:
        pool.close()


def hier_bad_routing(group, rank):
    """hier on the device path, rank 1's routing out of range (an expert id past E, or below
    -1): the hier counts are made and gathered before the plan's read, so they must index
    nothing out of range there, and every rank raises the plan's InputError. Returns each
    case's message (None: no error)."""
    import epkit

    out = []
    for bad in (E + 5, -7):
        for capacity in (None, 2):
            x, idx, w = inputs(rank, group.size(), torch.float32, False)
            if rank == 1:
                idx[1, 0] = bad
            try:
                epkit.dispatch(x, idx, w, num_experts=E, group=group, transport="hier",
                               capacity=capacity)
                out.append(None)
            except epkit.InputError as exc:
                out.append(str(exc))
    return out


if __name__ == "__main__":
    _table()
