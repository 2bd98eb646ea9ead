"""The rank side of ``epkit bench``: one process of a local gloo group.

Every rank builds its own inputs (seeded by rank), then times the contenders round by round,
interleaved so that drift in the machine's load hits all of them alike:

    epkit dedup       epkit.dispatch(transport="dedup") -> identity expert -> epkit.combine,
                      forward and backward
    epkit pairs       the same with transport="pairs"
    megatron-style    what Megatron / torchtitan-style code runs: argsort permute,
                      all_to_all_single, chunk sort, one float32 index_add_ combine (not
                      bit-exact; epkit.baselines.megatron_style)
    plain-torch       the plain-torch dispatcher of epkit.baselines.plain_torch: the spec's exact
                      two-level combine order, one indexed pass per top-k position and rank
    plain-torch pad   the same path with every all-to-all padded to the group-wide largest chunk
                      (how a backend without split sizes is served)
    floor             bare all_to_all_single calls replaying exactly the exchanges (split sizes
                      and row widths) that one epkit dedup step makes, forward and backward

A timed iteration is ``barrier; t0; step; t1``; per iteration the slowest rank's time counts
(max over ranks), and a row's figure is the median over the timed iterations. The bytes of a
row are what its step hands to ``all_to_all_single`` on the send side (padding and the
diagonal local chunk included), recorded once during warm-up by wrapping the collective.

Memory per step: around every timed step each rank resets its peak resident set (writing 5
to ``/proc/self/clear_refs``) and reads ``VmRSS`` before and ``VmHWM`` after: the step's peak
growth, max over ranks per iteration, median over iterations (``peak_rss_growth_bytes``).
Next to it ``held_bytes``: what the step must hold, the distinct storages of its inputs,
outputs, gradients and the tensors autograd saved for backward (``saved_tensors_hooks``),
counted once during warm-up; the floor holds its send and receive buffers.

Overlap (forward only, no autograd): dispatch then independent compute, against the lazy
exchange (``exchange="lazy"``: issue, the same compute, ``wait()``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import statistics
import time
import traceback

import torch
import torch.distributed as dist

# Rank 0 reports to the parent as it goes (set by :func:`worker`): ``_emit("progress", n)``
# after every n rounds or kernel replays, ``_emit(part, result)`` as each part finishes, so
# ``epkit bench`` moves its progress bar and prints each table at once. Other ranks: no-op.
_emit = lambda kind, payload: None  # noqa: E731


def progress_units(cfg: dict) -> int:
    """How many ``progress`` units one group reports with ``cfg`` (the bar's total)."""
    rounds = cfg["warmup"] + cfg["iters"]
    n = rounds * len(cfg["token_list"])
    if cfg.get("kernel_threads") and cfg["tokens"] in cfg["token_list"]:
        n += 2 * len(cfg["kernel_threads"])
    return n + (rounds if cfg.get("overlap") else 0) + (1 if cfg.get("profile") else 0)


# ---- recording what each step hands to all_to_all_single ----------------------------------

class _Recorder:
    """Wraps ``torch.distributed.all_to_all_single`` while active; every call is noted as
    ``(send_rows, recv_rows, row_bytes, in_splits, out_splits)``."""

    def __init__(self, world: int, timeline: list = None):
        self.world = world
        self.calls: list[tuple] = []
        self.held = 0  # bytes the recorded step holds (set by interleaved)
        self.timeline = timeline  # with a list: ("exchange", call) appended in order too

    @contextlib.contextmanager
    def active(self):
        real = dist.all_to_all_single

        def wrapped(output, input, output_split_sizes=None, input_split_sizes=None, *a, **kw):
            row = math.prod(input.shape[1:]) * input.element_size()
            ins = [int(v) for v in input_split_sizes] if input_split_sizes else None
            outs = [int(v) for v in output_split_sizes] if output_split_sizes else None
            self.calls.append((int(input.shape[0]), int(output.shape[0]), int(row), ins, outs))
            if self.timeline is not None:
                self.timeline.append(("exchange", self.calls[-1]))
            return real(output, input, output_split_sizes, input_split_sizes, *a, **kw)

        dist.all_to_all_single = wrapped
        try:
            yield self
        finally:
            dist.all_to_all_single = real

    def bytes_sent(self) -> int:
        """Bytes handed to the collective on the send side (diagonal chunk included)."""
        return sum(n * row for n, _, row, _, _ in self.calls)

    def bytes_to_peers(self, rank: int) -> int:
        """The same without the chunk a rank sends itself (a local copy, no traffic)."""
        total = 0
        for n, _, row, splits, _ in self.calls:
            own = splits[rank] if splits else n // self.world
            total += (n - own) * row
        return total


def floor_step(calls, group):
    """Bare all_to_all_single calls replaying ``calls`` (a recorder's list), buffers made once."""
    bufs = []
    for n_in, n_out, row, in_s, out_s in calls:
        bufs.append((torch.zeros((n_out, row), dtype=torch.uint8),
                     torch.zeros((n_in, row), dtype=torch.uint8), out_s, in_s))

    def step(held=None):
        for recv, send, out_s, in_s in bufs:
            dist.all_to_all_single(recv, send, out_s, in_s, group=group)
        if held is not None:
            held += [t for b in bufs for t in b[:2]]

    return step


def floor_kernels_step(timeline, group):
    """The floor with epkit's local work: the bare exchanges of one recorded epkit dedup step
    and every C++ kernel call it made (their real arguments), replayed in their order and
    nothing else (no Python bookkeeping, no call headers, no count exchange, no index ops):
    what this design's bytes and kernels cost on this machine, the bound epkit's step is
    measured against (``overhead_bound``)."""
    plan = []  # ("exchange", (recv, send, out_splits, in_splits)) or ("kernel", (op, args, kwargs))
    for kind, item in timeline:
        if kind == "exchange":
            n_in, n_out, row, in_s, out_s = item
            plan.append((kind, (torch.zeros((n_out, row), dtype=torch.uint8),
                                torch.zeros((n_in, row), dtype=torch.uint8), out_s, in_s)))
        else:
            _, op, args, kwargs, *_ = item
            plan.append((kind, (op, args, kwargs)))

    def step(held=None):
        for kind, item in plan:
            if kind == "exchange":
                recv, send, out_s, in_s = item
                dist.all_to_all_single(recv, send, out_s, in_s, group=group)
            else:
                op, args, kwargs = item
                op(*args, **kwargs)
        if held is not None:
            held += [t for kind, item in plan if kind == "exchange" for t in item[:2]]

    return step


# ---- the contenders -------------------------------------------------------------------------

def make_inputs(rank: int, T: int, H: int, K: int, E: int, dtype, seed: int):
    """Tokens, top-k routing (distinct experts, uniform) and weights of one rank."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    x = torch.randn((T, H), generator=g).to(dtype)
    idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
    w = torch.rand((T, K), generator=g)
    w = w / w.sum(dim=1, keepdim=True)
    grad = torch.randn((T, H), generator=g).to(dtype)
    return x, idx, w, grad


def _train_step(dispatch, combine, x, idx, w, grad):
    """Forward and backward of dispatch -> identity expert -> combine."""
    def step(held=None):  # held: a list the step appends its inputs, outputs, gradients to
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        d = dispatch(xg, idx, wg)
        out = combine(d.expert_x, d)
        out.backward(grad)
        if held is not None:
            held += [x, idx, w, grad, d.expert_x, out, xg.grad, wg.grad]
        return xg.grad, wg.grad
    return step


def epkit_step(transport, group, E, x, idx, w, grad):
    """epkit as a training loop runs it: one Dispatcher for every step, so its workspace
    (epkit/workspace.py) is allocated in the warm-up and reused by the timed steps."""
    import epkit

    disp = epkit.Dispatcher(group, E, transport=transport)
    step = _train_step(disp.dispatch, disp.combine, x, idx, w, grad)
    step.dispatcher = disp  # what it keeps between steps: run_workload reports it
    return step


def plain_step(padded, group, E, x, idx, w, grad):
    """The plain-torch baseline; ``padded``: the same path over its padded exchange (every
    chunk padded to the group-wide largest split, known from its count gather)."""
    from epkit.baselines.plain_torch import PlainTorchDispatcher

    pt = PlainTorchDispatcher(group, exchange="padded" if padded else "ragged")
    return _train_step(lambda a, b, c: pt.dispatch(a, b, c, num_experts=E),
                       lambda y, d: pt.combine(y, d), x, idx, w, grad)


def megatron_step(group, E, x, idx, w, grad):
    """What Megatron-Core / torchtitan-style code runs: argsort permute, ``all_to_all_single``,
    chunk sort to expert-major, and one float32 ``index_add_`` combine (not bit-exact; the
    permute + all-to-all dispatcher of baselines/megatron_style.py)."""
    from epkit.baselines.megatron_style import A2ADispatcher

    a2a = A2ADispatcher(group, E)

    class _Rows:  # expert_x and the handle, as the step expects them
        def __init__(self, rows, handle):
            self.expert_x, self.handle = rows, handle

    def dispatch(a, b, c):
        rows, _, handle = a2a.dispatch(a, b, c)
        return _Rows(rows, handle)

    return _train_step(dispatch, lambda y, d: a2a.combine(y, d.handle), x, idx, w, grad)


# ---- memory per step -------------------------------------------------------------------------

def _status_kb(*keys: str) -> list[int]:
    with open("/proc/self/status") as f:
        vals = dict(line.split(":", 1) for line in f if line.split(":", 1)[0] in keys)
    return [int(vals[k].split()[0]) for k in keys]


class PeakRss:
    """One step's peak resident-set growth in bytes: the kernel's high-water mark is reset
    (``5`` to ``/proc/self/clear_refs``) and VmRSS read before, VmHWM after. ``ok`` is False
    where the files are missing or not writable; then every growth is None."""

    def __init__(self):
        try:
            self._reset()
            _status_kb("VmRSS", "VmHWM")
            self.ok = True
        except (OSError, KeyError, ValueError):
            self.ok = False
        self.base = 0

    @staticmethod
    def _reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def start(self) -> None:
        if self.ok:
            self._reset()
            self.base = _status_kb("VmRSS")[0]

    def growth(self):
        return 1024 * (_status_kb("VmHWM")[0] - self.base) if self.ok else None


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


@contextlib.contextmanager
def holding(held: list):
    """While active, every tensor autograd saves for backward is appended to ``held``."""
    def pack(t):
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield held


# ---- timing ----------------------------------------------------------------------------------

def _gather_max(times: list[float], group) -> list[float]:
    """Per iteration, the slowest rank's time."""
    t = torch.tensor(times, dtype=torch.float64)
    from epkit.collectives import all_gather

    out = torch.zeros((dist.get_world_size(group) * t.numel(),), dtype=torch.float64)
    all_gather(out, t, group)
    return out.view(-1, t.numel()).max(dim=0).values.tolist()


def _reduce_max(v: int, group) -> int:
    t = torch.tensor([v], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def interleaved(steps: dict, warmup: int, iters: int, group, record: set = frozenset()):
    """Round by round, every step once a round; returns ``(times, recorders, memory)``: per
    step the per-iteration max-over-ranks seconds; the byte recorders of the steps in
    ``record`` (made during the first warm-up round, which also collects what each of them
    holds: ``recorder.held``); and per step the per-iteration max-over-ranks peak resident-set
    growth in bytes (None where :class:`PeakRss` is unavailable)."""
    assert warmup >= 1, "the first round records bytes: at least one warm-up round"
    R = dist.get_world_size(group)
    recorders = {name: _Recorder(R) for name in steps if name in record}
    local = {name: [] for name in steps}
    grown = {name: [] for name in steps}
    rss = PeakRss()
    for i in range(warmup + iters):
        for name, step in steps.items():
            dist.barrier(group)
            if i == 0 and name in recorders:
                held = []
                with recorders[name].active(), holding(held):
                    step(held)
                recorders[name].held = held_bytes(held)
                del held
                continue
            rss.start()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            if i >= warmup:
                local[name].append(t1 - t0)
                grown[name].append(rss.growth())
        _emit("progress", 1)
    times = {name: _gather_max(v, group) for name, v in local.items()}
    memory = {name: _gather_max(v, group) if rss.ok else None for name, v in grown.items()}
    return times, recorders, memory


def summarize(times: list[float]) -> dict:
    ms = [1e3 * t for t in times]
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "p10_ms": q[0],
            "p90_ms": q[-1], "iters": len(ms)}


def run_workload(cfg: dict, T: int, group) -> dict:
    """Time the five contenders at ``T`` tokens per rank; rank 0's return value is the table."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    dtype = getattr(torch, cfg["dtype"])
    H, K, E = cfg["hidden"], cfg["topk"], cfg["experts"]
    x, idx, w, grad = make_inputs(rank, T, H, K, E, dtype, cfg["seed"])
    steps = {
        "epkit dedup": epkit_step("dedup", group, E, x, idx, w, grad),
        "epkit pairs": epkit_step("pairs", group, E, x, idx, w, grad),
        "megatron-style": megatron_step(group, E, x, idx, w, grad),
        "plain-torch": plain_step(False, group, E, x, idx, w, grad),
        "plain-torch padded": plain_step(True, group, E, x, idx, w, grad),
    }
    steps = {k: v for k, v in steps.items() if k in cfg["methods"]}
    # The floor replays epkit dedup's exchanges (and, for "floor + kernels", its kernel calls
    # in their order): record them first (one untimed step).
    from .bench_kernels import KernelRecorder

    timeline: list = []
    rec, krec = _Recorder(R, timeline), KernelRecorder(timeline)
    with rec.active(), krec.active():
        epkit_step("dedup", group, E, x, idx, w, grad)()
    if "floor" in cfg["methods"]:
        steps["floor"] = floor_step(rec.calls, group)
    if "floor + kernels" in cfg["methods"]:
        steps["floor + kernels"] = floor_kernels_step(timeline, group)
    times, recorders, memory = interleaved(steps, cfg["warmup"], cfg["iters"], group,
                                           record=set(steps))
    rows = {}
    kept = kept_bytes(steps, group)
    for name in steps:
        r = recorders[name]
        rows[name] = dict(summarize(times[name]), **kept.get(name, {}),
                          bytes=_reduce_max(r.bytes_sent(), group),
                          bytes_to_peers=_reduce_max(r.bytes_to_peers(rank), group),
                          exchanges=len(r.calls), times_ms=[1e3 * t for t in times[name]],
                          **memory_fields(memory[name], _reduce_max(r.held, group)))
    algo = _reduce_max(rec.bytes_sent(), group)
    out = {"tokens": T, "world_size": R, "algo_bytes": algo, "rows": rows}
    _emit("workload", dict(out))
    if cfg.get("kernel_threads") and T == cfg["tokens"]:
        out["kernels"] = run_kernels(cfg, group, x, idx, w, grad)
        _emit("kernels", out["kernels"])
    return out


def kept_bytes(steps: dict, group) -> dict:
    """What the epkit rows keep between steps (max over ranks), so a step that grows by 0
    says why: ``workspace_bytes`` (its Dispatcher's, epkit/workspace.py) and ``kept_bytes``
    (that plus the freed large CPU blocks epkit keeps for reuse, csrc/cpu/alloc.cpp; the
    blocks are per process, shared by both epkit rows)."""
    import epkit.ops  # noqa: F401  (the extension)

    out = {}
    cached = _reduce_max(int(torch.ops.epkit.cached_bytes()), group)
    for name, step in steps.items():
        disp = getattr(step, "dispatcher", None)
        if disp is not None:
            ws = _reduce_max(disp.workspace_bytes, group)
            out[name] = {"workspace_bytes": ws, "kept_bytes": ws + cached}
    return out


def memory_fields(grown, held: int) -> dict:
    """A row's memory figures: ``grown`` the per-iteration peak growths (or None), ``held``
    the bytes the step must hold (max over ranks)."""
    peak = statistics.median(grown) if grown else None
    return {"peak_rss_growth_bytes": peak, "peak_rss_growth_max_bytes": max(grown) if grown
            else None, "held_bytes": held,
            "rss_growth_vs_held": peak / held if peak is not None and held else None}


def run_kernels(cfg: dict, group, x, idx, w, grad) -> list:
    """Record one epkit step per transport on every rank; rank 0 replays its kernel calls
    alone (:mod:`epkit.tools.bench_kernels`) while the others wait at a barrier."""
    from .bench_kernels import KernelRecorder, replay

    out = []
    for transport in ("dedup", "pairs"):
        rec = KernelRecorder()
        with rec.active():
            epkit_step(transport, group, cfg["experts"], x, idx, w, grad)()
        dist.barrier(group)
        if dist.get_rank(group) == 0:
            for threads in cfg["kernel_threads"]:
                out.append(dict(replay(rec.calls, cfg["kernel_reps"], threads),
                                transport=transport))
                _emit("progress", 1)
        dist.barrier(group)
    return out


# ---- overlap: the lazy exchange ----------------------------------------------------------------

def run_overlap(cfg: dict, group) -> dict:
    """Forward dispatch with independent compute, sequential against lazy (issue, compute, wait)."""
    import epkit

    rank = dist.get_rank(group)
    dtype = getattr(torch, cfg["dtype"])
    H, K, E, T = cfg["hidden"], cfg["topk"], cfg["experts"], cfg["tokens"]
    x, idx, w, _ = make_inputs(rank, T, H, K, E, dtype, cfg["seed"])

    def dispatch():
        return epkit.dispatch(x, idx, w, num_experts=E, group=group)

    # Independent compute (a dense layer on the same tokens, as a shared expert would be),
    # sized on rank 0 to take about as long as the dispatch, the same on every rank.
    a = torch.randn((T, H))
    b = torch.randn((H, 128))
    c = torch.empty((T, 128))
    with torch.no_grad():
        for _ in range(2):
            dispatch()
        t0 = time.perf_counter()
        for _ in range(3):
            dispatch()
        t_disp = (time.perf_counter() - t0) / 3
        t0 = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b, out=c)
        t_mm = (time.perf_counter() - t0) / 3
    reps = torch.tensor([max(1, round(t_disp / max(t_mm, 1e-6)))], dtype=torch.int64)
    dist.broadcast(reps, 0, group=group)
    reps = int(reps)

    def compute():
        for _ in range(reps):
            torch.mm(a, b, out=c)

    def sequential():
        d = dispatch()
        compute()
        return d

    def lazy():
        p = epkit.dispatch(x, idx, w, num_experts=E, group=group, exchange="lazy")
        compute()
        return p.wait()

    available, reason = True, ""
    try:
        with torch.no_grad():
            lazy()
    except (NotImplementedError, ValueError) as exc:
        available, reason = False, f"{type(exc).__name__}: {exc}"
    # Every rank agrees (a mismatch would hang the next collective).
    flag = torch.tensor([int(available)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    available = bool(int(flag))
    steps = {"dispatch": dispatch, "compute": compute, "dispatch then compute": sequential}
    if available:
        steps["lazy: issue, compute, wait"] = lazy
    with torch.no_grad():
        times, _, _ = interleaved(steps, cfg["warmup"], cfg["iters"], group)
    rows = {name: summarize(v) for name, v in times.items()}
    out = {"available": available, "reason": reason, "compute_reps": reps, "rows": rows}
    if available:
        seq = rows["dispatch then compute"]["median_ms"]
        lz = rows["lazy: issue, compute, wait"]["median_ms"]
        hideable = min(rows["dispatch"]["median_ms"], rows["compute"]["median_ms"])
        out["speedup"] = seq / lz
        out["hidden_fraction"] = (seq - lz) / hideable if hideable > 0 else 0.0
    return out


# ---- where epkit's step spends its time -------------------------------------------------------

def run_profile(cfg: dict, group, steps: int = 3, top: int = 14) -> list[dict]:
    """Self CPU time per op of epkit dedup steps on this rank (torch.profiler), per step.

    The collective-bearing ops (``epkit::dispatch_tokens`` ... and their backward nodes) hold
    in their self time the wait for the exchange they issue; the C++ kernels
    (``epkit::pack`` ...) and ``aten::`` ops are local work."""
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank(group)
    dtype = getattr(torch, cfg["dtype"])
    x, idx, w, grad = make_inputs(rank, cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"],
                                  dtype, cfg["seed"])
    step = epkit_step("dedup", group, cfg["experts"], x, idx, w, grad)
    step()
    dist.barrier(group)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - t0) / steps
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    out = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "calls_per_step": e.count / steps} for e in rows[:top]]
    return [{"op": "(wall time of a profiled step)", "self_ms_per_step": 1e3 * wall,
             "calls_per_step": 1.0}] + out


# ---- the process ------------------------------------------------------------------------------

def worker(rank: int, world: int, store: str, queue, cfg: dict) -> None:
    """Entry point of one rank (spawned by :func:`epkit.tools.bench.run_group`)."""
    global _emit
    if rank == 0:
        _emit = lambda kind, payload: queue.put((rank, kind, payload))  # noqa: E731
    try:
        torch.set_num_threads(cfg["threads"])
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=cfg["timeout"]))
        import epkit.ops  # noqa: F401  (loads the extension before any timing)

        group = dist.group.WORLD
        result = {"world_size": world, "workloads": []}
        for T in cfg["token_list"]:
            result["workloads"].append(run_workload(cfg, T, group))
        if cfg.get("overlap"):
            result["overlap"] = run_overlap(cfg, group)
            _emit("overlap", result["overlap"])
        if cfg.get("profile"):
            result["profile"] = run_profile(cfg, group)
            _emit("progress", 1)
            _emit("profile", result["profile"])
        queue.put((rank, "ok", result if rank == 0 else None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which ends the group
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
