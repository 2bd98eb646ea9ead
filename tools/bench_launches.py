"""``epkit bench --launches``: what one training step issues on the device path, per phase.

For each transport and exchange, a local gloo group runs one training step (dispatch, combine,
the backward of both) on the device path (``EPKIT_KERNELS=triton``: the GPU kernels, in Triton's
interpreter without a GPU, so the same ops are issued as on CUDA) and counts, per phase:

- kernels: aten ops that launch a device kernel plus Triton launches
  (:func:`epkit.device.count_launches`);
- collectives: ``torch.distributed`` calls;
- host waits: host reads of device memory and host-to-device copies
  (:func:`epkit.device.count_host_reads`).

None of these depend on a GPU: they are what the code issues, and they are the launch-bound
cost of a small step (3 to 5 us a launch). docs/design.md, "Launch budget", gives the budgets
this table is held to (:data:`BUDGET`), and tests/bench/test_launches.py asserts them.
"""

from __future__ import annotations

import os
import sys
import time

PHASES = ("dispatch", "combine", "backward")
# mode -> Dispatcher options (hier: two ranks a node, where the group has two nodes)
MODES = {
    "dedup/auto": dict(transport="dedup", exchange="auto"),
    "dedup/static": dict(transport="dedup", exchange="static"),
    "pairs/auto": dict(transport="pairs", exchange="auto"),
    "pairs/static": dict(transport="pairs", exchange="static"),
    "hier/auto": dict(transport="hier", exchange="auto"),
    "dedup/auto/mxfp8": dict(transport="dedup", exchange="auto", payload="mxfp8"),
    "pairs/static/fp8_block128": dict(transport="pairs", exchange="static",
                                      payload="fp8_block128"),
}
# The budgets of docs/design.md ("Launch budget"): kernels per phase (a quantized payload adds
# up to 2 a phase), collectives per step (hier: its two stages), host waits per phase.
BUDGET = {"dispatch": 10, "combine": 5, "backward": 12}
PAYLOAD_EXTRA = 2
COLLECTIVES = {"one-stage": 7, "hier": 12}
HOST_WAITS = {"eager": (1, 0, 0), "static": (0, 0, 0)}


def budget(mode: str) -> dict:
    """The budget of ``mode``: ``{phase: kernels, "collectives": n, "host_waits": (d, c, b)}``."""
    quantized = len(mode.split("/")) > 2
    out = {p: BUDGET[p] + (PAYLOAD_EXTRA if quantized else 0) for p in PHASES}
    out["collectives"] = COLLECTIVES["hier" if mode.startswith("hier") else "one-stage"]
    out["host_waits"] = HOST_WAITS["static" if "/static" in mode else "eager"]
    return out


def count_step(disp, x, topk_idx, topk_weights) -> dict:
    """One training step of ``disp`` (a Dispatcher) on the inputs, counted phase by phase:
    ``{phase: {"aten", "triton", "kernels", "collectives", "host_waits", "by_name"}}``. The
    expert is ``expert_x * 2`` (a quantized payload's ``expert_x_hp``) and the loss ``out.sum()``, outside the counted regions."""
    import torch

    from epkit.hostreads import count_host_reads
    from epkit.launches import count_launches

    out = {}
    with count_host_reads() as reads:
        with count_launches() as n:
            d = disp.dispatch(x, topk_idx, topk_weights)
        out["dispatch"] = (n, reads.take())
        hp = getattr(d, "expert_x_hp", None)  # a quantized payload's dequantized rows
        y = d.expert_x if hp is None else hp
        with count_launches() as n:
            o = disp.combine(y, d)
        out["combine"] = (n, reads.take())
        grad_out = torch.ones_like(o)
        with count_launches() as n:
            torch.autograd.grad(o, [x, topk_weights], grad_out)
        out["backward"] = (n, reads.take())
    return {p: dict(aten=n.aten, triton=n.triton, kernels=n.kernels, collectives=n.collectives,
                    host_waits=len(r), waits=[f"{w.kind} at {w.where}" for w in r],
                    by_name=dict(n.by_name))
            for p, (n, r) in out.items()}


def inputs(rank: int, T: int, H: int, E: int, K: int, dtype: str = "bfloat16"):
    """This rank's ``(x, topk_idx, topk_weights)``, leaves that need grad, from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, H, generator=g).to(getattr(torch, dtype)).requires_grad_()
    w, idx = torch.rand(T, E, generator=g).softmax(1).topk(K)
    return x, idx, w.requires_grad_()


def dispatcher(mode: str, group, E: int, T: int):
    """The Dispatcher of ``mode`` over ``group`` (static: ``T`` tokens a rank at most)."""
    import torch.distributed as dist

    import epkit

    opts = dict(MODES[mode])
    if opts["exchange"] == "static":
        opts["max_tokens_per_rank"] = T
    if opts["transport"] == "hier":
        R = dist.get_world_size(group)
        opts["ranks_per_node"] = 2 if R % 2 == 0 and R > 2 else 1
    return epkit.Dispatcher(group, num_experts=E, **opts)


def rank_main(rank, world, store, queue, modes, sizes):
    """A rank: every mode at every size, one counted step each (after one warm-up step a mode,
    at the first size); rank 0 answers ``{size: {mode: counts}}``."""
    import torch.distributed as dist

    # torch.profiler's start and stop lines (two a counted phase) go to stderr; a rank answers
    # its errors on the queue, so its stderr is quiet
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        out = {}
        for i, (T, H, E, K) in enumerate(sizes):
            key = f"T={T} H={H} E={E} K={K}"
            out[key] = {}
            x, idx, w = inputs(rank, T, H, E, K)
            for mode in modes:
                disp = dispatcher(mode, dist.group.WORLD, E, T)
                if i == 0:  # warm-up, once a mode: first-use imports and caches
                    count_step(disp, x, idx, w)
                out[key][mode] = count_step(disp, x, idx, w)
                queue.put((rank, "progress", f"{key} {mode}"))
        queue.put((rank, "ok", out if rank == 0 else None))
    except Exception as exc:  # noqa: BLE001 - answered, so the parent names it
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def measure(world: int, modes=tuple(MODES), sizes=((64, 128, 8, 2),), deadline_s=900.0,
            on_progress=None) -> dict:
    """``{size: {mode: {phase: counts}}}`` of rank 0 of a fresh local group of ``world`` ranks
    on the device path (``EPKIT_KERNELS=triton``)."""
    from epkit.verify.procs import run_ranks

    report = None if on_progress is None else (lambda r, kind, payload: on_progress(payload))
    # the ranks inherit EPKIT_KERNELS=triton (the device path); this process keeps its own
    before = os.environ.get("EPKIT_KERNELS")
    os.environ["EPKIT_KERNELS"] = "triton"
    try:
        got = run_ranks(rank_main, world, (tuple(modes), tuple(sizes)), deadline_s=deadline_s,
                        on_message=report, prefix="epkit-launches-")
    finally:
        if before is None:
            os.environ.pop("EPKIT_KERNELS", None)
        else:
            os.environ["EPKIT_KERNELS"] = before
    errors = [f"rank {r}: {p}" for r, (kind, p) in sorted(got.items()) if kind == "error"]
    if errors:
        raise RuntimeError(f"epkit bench --launches: world size {world}: {errors[0]}")
    return got[0][1]


def over_budget(mode: str, counts: dict) -> dict:
    """What of ``counts`` (one mode's phases) exceeds ``mode``'s budget: ``{what: detail}``,
    ``what`` a phase, ``"collectives"`` or ``"host waits"``."""
    b = budget(mode)
    out = {p: f"{counts[p]['kernels']} kernels > {b[p]}" for p in PHASES
           if counts[p]["kernels"] > b[p]}
    coll = sum(counts[p]["collectives"] for p in PHASES)
    if coll > b["collectives"]:
        out["collectives"] = f"{coll} a step > {b['collectives']}"
    waits = tuple(counts[p]["host_waits"] for p in PHASES)
    if any(w > a for w, a in zip(waits, b["host_waits"])):
        out["host waits"] = (f"{'/'.join(map(str, waits))} > "
                             f"{'/'.join(map(str, b['host_waits']))}")
    return out


def format_table(result: dict) -> str:
    """The table, one row per mode and size: kernels (aten + Triton) per phase, collectives
    per step, host waits per phase, and the budget each misses."""
    head = ("mode", "dispatch", "combine", "backward", "collectives", "host waits", "over budget")
    rows = []
    for size, modes in result.items():
        for mode, c in modes.items():
            cells = [f"{c[p]['kernels']} ({c[p]['aten']}+{c[p]['triton']})" for p in PHASES]
            miss = over_budget(mode, c)
            rows.append((mode if len(result) == 1 else f"{mode} {size}", *cells,
                         str(sum(c[p]["collectives"] for p in PHASES)),
                         "/".join(str(c[p]["host_waits"]) for p in PHASES),
                         ", ".join(miss) if miss else "-"))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]
    return "\n".join(out)


def legend(world: int, sizes) -> str:
    size = ", ".join(f"T={T} H={H} E={E} K={K}" for T, H, E, K in sizes)
    return (f"kernels: aten ops that launch + Triton launches ((aten+triton)), per phase of one "
            f"step (backward: both passes); collectives per step; host waits (reads and "
            f"host-to-device copies) dispatch/combine/backward; world size {world}, {size}, "
            f"bfloat16. Budgets (docs/design.md): dispatch {BUDGET['dispatch']}, combine "
            f"{BUDGET['combine']}, backward {BUDGET['backward']} kernels (+{PAYLOAD_EXTRA} a "
            f"phase quantized); {COLLECTIVES['one-stage']} collectives a step "
            f"({COLLECTIVES['hier']} hier); host waits 1/0/0 (static 0/0/0)")


def main(args) -> int:
    """``epkit bench --launches`` (its ``--world-size``, ``--json``, ``--no-progress``)."""
    import json

    world = args.world_size
    sizes = ((64, 128, 8 if 8 % world == 0 else 2 * world, 2),)
    started = time.monotonic()
    print(f"epkit bench --launches: world size {world} (gloo), the device path "
          "(EPKIT_KERNELS=triton; Triton interpreted without a GPU), one counted step per mode "
          "after one warm-up", flush=True)
    progress = None if args.no_progress else (
        lambda what: print(f"  counted {what}", file=sys.stderr, flush=True))
    result = measure(world, sizes=sizes, on_progress=progress)
    print(format_table(result))
    print(legend(world, sizes))
    print(f"{time.monotonic() - started:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world_size=world, sizes=sizes, result=result,
                           budget={m: budget(m) for m in MODES}), f, indent=1)
        print(f"wrote {args.json}")
    return 0
