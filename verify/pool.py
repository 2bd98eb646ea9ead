"""Run cases on a real process group.

:class:`Workers`: ``R`` local worker processes join ONE gloo group once (a FileStore in a
private temporary directory, so no port is ever raced for) and then run call after call sent to
them over pipes: ``call(fn, n, args)`` runs ``fn(group, rank, *args[rank])`` on ranks ``0..n-1``
with a subgroup made at start-up. A worker that dies or does not answer in time is killed with
the rest of its group, and a fresh group is started before the next call. Workers die with the
parent: they exit on EOF of their pipe, watch the parent's pid, and are daemonic. The production
tests' group (tests/production/group.py) is a thin use of it.

:class:`Pool` (the default for verify): :class:`Workers` running cases. A case of world size
``n <= R`` runs on ranks ``0..n-1``; a rank that raises out of step with its peers also rebuilds
the group (cheap: workers are forked from a forkserver that has torch imported already).

:class:`TorchrunGroup`: every process of a ``torchrun`` job is a rank (``--backend nccl`` on
GPUs); rank 0 draws cases and broadcasts them over a gloo side group, every rank runs its part,
and rank 0 gathers the results.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import tempfile
import time
import traceback
import weakref

from .cases import Case, ModeSpec
from .procs import NoMainImport, die_with_parent

__all__ = ["Pool", "TorchrunGroup", "Workers", "under_torchrun"]

_POOLS: "weakref.WeakSet[Workers]" = weakref.WeakSet()


def _error(stage, kind, message) -> dict:
    return {"stage": stage, "type": kind, "unsupported": False, "input_error": False,
            "message": message, "traceback": ""}


class _Executor:
    """Per-rank state shared by both drivers: adapters cached per (impl, mode, group size, and
    what the mode's factory takes from the case: max_tokens when static, ranks_per_node with
    nodes)."""

    def __init__(self, rank: int, device):
        self.rank, self.device = rank, device
        self.adapters: dict = {}

    def execute(self, case: Case, impl: str, mode: ModeSpec, group) -> dict:
        from .worker import make_adapter, run_rank

        key = (impl, mode, case.world_size, case.max_tokens if mode.static else None,
               case.ranks_per_node if mode.nodes else None)
        adapter = self.adapters.get(key)
        if adapter is None:
            try:
                adapter = make_adapter(impl, mode, case, group)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                err = _error("factory", type(exc).__name__, str(exc))
                err["unsupported"] = isinstance(exc, NotImplementedError)
                err["traceback"] = traceback.format_exc(limit=-8)
                return {"rank": self.rank, "error": err, "seconds": 0.0}
            self.adapters[key] = adapter
        return run_rank(case, mode, adapter, self.rank, self.device)


_EXECUTOR: _Executor | None = None  # a worker process's own, made at its first case


def _execute(group, rank, case, impl, mode) -> dict:
    """:meth:`Pool.run`'s function on each worker rank."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _Executor(rank, "cpu")
    return _EXECUTOR.execute(case, impl, mode, group)


def _portable(exc: BaseException, tb: str) -> tuple:
    """``(exception, traceback text)`` that pickles: the exception itself where it does."""
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001
        exc = RuntimeError(repr(exc))
    return exc, tb


def _worker_main(rank, world, store, conn, timeout, parent_pid, threads):
    die_with_parent(parent_pid)
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    td = datetime.timedelta(seconds=timeout)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                            world_size=world, timeout=td)
    groups = {world: dist.group.WORLD}
    for n in range(1, world):
        groups[n] = dist.new_group(list(range(n)), timeout=td)
    conn.send(("ready", rank))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, module, name, n, args = msg
            try:
                reply = ("ok", getattr(importlib.import_module(module), name)(groups[n], rank,
                                                                              *args))
            except BaseException as exc:  # noqa: BLE001 - sent to the parent
                reply = ("err", _portable(exc, traceback.format_exc()))
            try:
                conn.send(reply)
            except (EOFError, OSError):
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. an answer that does not pickle
                conn.send(("err", (RuntimeError(f"the rank's result could not be sent: {exc}"),
                                   traceback.format_exc())))
    except (EOFError, OSError):  # the parent is gone
        os._exit(0)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class Workers:
    """``world_size`` local worker ranks on one gloo group, reused across calls.

    ``call(fn, n, args)`` runs ``fn(group, rank, *args[rank])`` on ranks ``0..n-1`` (``fn`` at
    module level in a module the workers can import) and returns one reply per rank:
    ``("ok", value)``, ``("err", (exception, traceback text))``, ``("died", exit code)`` or
    ``("timeout", None)``. A rank that died or gave no answer within ``answer_s`` (default
    ``1.2 * timeout + 1``) rebuilds the group; so does :meth:`restart`. After the first rank
    fails (``failed(reply)``, by default any reply but ``"ok"``), its peers get ``grace``
    seconds more (``None``: until ``answer_s``). ``timeout`` is the group's collective
    timeout; the workers get ``max(timeout, ready_s)`` to join. ``start_method="spawn"`` starts every worker from scratch, seeing the parent's
    environment and ``sys.path`` as they are at :meth:`start`; the default ``forkserver`` is
    faster. Usable as a context manager; :attr:`restarts` counts how often the group was
    rebuilt.
    """

    def __init__(self, world_size: int = 4, *, timeout: float = 30.0, threads: int = 1,
                 start_method: str = "forkserver", answer_s: float | None = None,
                 grace: float | None = 2.0, ready_s: float = 60.0,
                 preload=("torch", "torch.distributed"), name: str = "epkit-workers"):
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.threads = threads
        self.start_method = start_method
        self.answer_s = self.timeout * 1.2 + 1.0 if answer_s is None else float(answer_s)
        self.grace = grace
        self.ready_s = ready_s
        self.preload = list(preload)
        self.name = name
        self.restarts = 0
        self._procs: list = []
        self._conns: list = []
        self._dir: str | None = None
        self._generation = 0
        _POOLS.add(self)

    # -- life cycle -----------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self):
        if self._procs:
            return self
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(self.preload)
        self._dir = tempfile.mkdtemp(prefix=self.name + "-")
        self._generation += 1
        store = os.path.join(self._dir, f"store{self._generation}")
        procs, conns = [], []
        with NoMainImport():
            self._launch(ctx, store, procs, conns)
        self._procs, self._conns = procs, conns
        self._await_ready()
        return self

    def _launch(self, ctx, store, procs, conns):
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store, child, self.timeout, os.getpid(),
                      self.threads),
                daemon=True,
                name=f"{self.name}-rank{rank}",
            )
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)

    def _await_ready(self):
        procs, conns = self._procs, self._conns
        deadline = time.monotonic() + max(self.timeout, self.ready_s)
        for rank, c in enumerate(conns):
            remaining = deadline - time.monotonic()
            ok = False
            try:
                ok = c.poll(max(remaining, 0)) and c.recv()[0] == "ready"
            except (EOFError, OSError):
                ok = False
            if not ok:
                codes = [p.exitcode for p in procs]
                self._kill()
                raise RuntimeError(f"{self.name}: worker rank {rank} did not join the gloo "
                                   f"group (exit codes {codes})")

    def _kill(self):
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        self._procs, self._conns = [], []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self):
        """Kill every worker and start a fresh group (lazily, at the next call)."""
        self._kill()
        self.restarts += 1

    def close(self):
        for c in self._conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(2.0)
        self._kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- running functions ----------------------------------------------------------------
    def call(self, fn, n: int, args, failed=None) -> list[tuple]:
        """Run ``fn(group, rank, *args[rank])`` on ranks ``0..n-1``; one reply per rank (see
        the class)."""
        if n > self.world_size:
            raise ValueError(f"the call needs {n} ranks, the group has {self.world_size}")
        failed = failed or (lambda reply: reply[0] != "ok")
        self.start()
        replies: list = [None] * n
        pending = {}
        dead_at = None  # when a rank died or failed: its peers then get the grace only
        for r in range(n):
            try:
                self._conns[r].send(("call", fn.__module__, fn.__name__, n, tuple(args[r])))
                pending[self._conns[r]] = r
            except (OSError, ValueError):  # the pipe is closed: the rank is gone
                dead_at = time.monotonic()
        sentinels = {self._procs[r].sentinel: r for r in range(n)}
        deadline = time.monotonic() + self.answer_s
        while pending:
            now = time.monotonic()
            limit = deadline if dead_at is None or self.grace is None else min(
                deadline, dead_at + self.grace)
            if now >= limit:
                break
            for obj in mpc.wait(list(pending) + list(sentinels), timeout=limit - now):
                if obj in pending:
                    r = pending.pop(obj)
                    try:
                        replies[r] = obj.recv()
                        if failed(replies[r]):
                            dead_at = dead_at or time.monotonic()
                    except (EOFError, OSError):
                        dead_at = dead_at or time.monotonic()
                elif obj in sentinels:
                    sentinels.pop(obj)
                    dead_at = dead_at or time.monotonic()
        broken = False
        for r in range(n):
            if replies[r] is None:
                broken = True
                p = self._procs[r]
                p.join(0.5)  # a rank whose pipe hit EOF may still be on its way out
                replies[r] = ("timeout", None) if p.is_alive() else ("died", p.exitcode)
        if broken:
            self.restart()
        return replies


class Pool(Workers):
    """``world_size`` local worker ranks on one gloo group, reused across cases.

    ``run(case, impl, mode)`` returns one result dict per rank of ``case`` (see
    :func:`epkit.verify.worker.run_rank`). Usable as a context manager and as a pytest session
    fixture; :attr:`restarts` counts how often the group was rebuilt.
    """

    def __init__(self, world_size: int = 4, *, timeout: float = 30.0, threads: int = 1,
                 start_method: str = "forkserver"):
        super().__init__(world_size, timeout=timeout, threads=threads,
                         start_method=start_method, name="epkit-verify",
                         preload=["torch", "torch.distributed", "epkit.verify.worker"])

    def run(self, case: Case, impl: str, mode: ModeSpec = ModeSpec()) -> list[dict]:
        n = case.world_size
        if n > self.world_size:
            raise ValueError(f"case needs {n} ranks, the pool has {self.world_size}")
        from .worker import first_error

        replies = self.call(_execute, n, [(case, impl, mode)] * n,
                            failed=lambda reply: reply[0] != "ok" or first_error(reply[1]))
        results = [self._result(r, kind, value) for r, (kind, value) in enumerate(replies)]
        if self.started and not _in_step(results):
            self.restart()
        return results

    def _result(self, rank: int, kind: str, value) -> dict:
        """A rank's reply as :func:`~epkit.verify.worker.run_rank`'s result dict."""
        if kind == "ok":
            return value
        if kind == "err":
            exc, tb = value
            err = _error(None, type(exc).__name__, str(exc))
            err["traceback"] = tb
        elif kind == "died":
            err = _error(None, "WorkerDied", f"worker rank {rank} died (exit code {value})")
        else:
            err = _error(None, "Timeout",
                         f"rank {rank} gave no answer within {self.timeout:.0f}s (timeout)")
        return {"rank": rank, "error": err, "seconds": None}


def _in_step(results: list[dict]) -> bool:
    """True when the group can be trusted with the next case: no rank failed, or every rank
    refused the case the same way before its collectives could diverge (NotImplementedError,
    or an input error, at the same stage). Anything else rebuilds the group: a rank that
    timed out of a collective its peer never entered leaves the group out of step."""
    from .worker import first_error

    errs = [first_error(r) for r in results]
    if all(e is None for e in errs):
        return True
    if any(e is None for e in errs):
        return False
    if len({(e["stage"], e["type"]) for e in errs}) != 1:
        return False
    return all(e["unsupported"] for e in errs) or all(e["input_error"] for e in errs)


def _close_all():
    for p in list(_POOLS):
        try:
            p.close()
        except Exception:  # noqa: BLE001
            pass


atexit.register(_close_all)


# ------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


class TorchrunGroup:
    """The processes of a ``torchrun`` job as the group: rank 0 drives, the others serve."""

    def __init__(self, backend: str = "nccl", timeout: float = 60.0):
        import torch
        import torch.distributed as dist

        td = datetime.timedelta(seconds=timeout)
        device = "cpu"
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=td)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.restarts = 0
        # Ranks other than 0 wait here while rank 0 checks, shrinks and draws: give them long.
        self.control = dist.new_group(backend="gloo", timeout=max(td, datetime.timedelta(
            seconds=600)))
        self.groups = {self.world_size: dist.group.WORLD}
        for n in range(1, self.world_size):
            self.groups[n] = dist.new_group(list(range(n)), timeout=td)
        self._ex = _Executor(self.rank, device)

    def _round(self, msg):
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.control)
        msg = box[0]
        if msg[0] == "stop":
            return None, True
        _, case, impl, mode = msg
        result = None
        if self.rank < case.world_size:
            result = self._ex.execute(case, impl, mode, self.groups[case.world_size])
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=self.control)
        return (gathered[: case.world_size] if gathered else None), False

    def run(self, case: Case, impl: str, mode: ModeSpec = ModeSpec()) -> list[dict]:
        assert self.rank == 0, "only rank 0 drives"
        if case.world_size > self.world_size:
            raise ValueError(f"case needs {case.world_size} ranks, the job has {self.world_size}")
        return self._round(("run", case, impl, mode))[0]

    def serve(self):
        """Ranks other than 0: run what rank 0 broadcasts until it says stop."""
        while True:
            _, stop = self._round(None)
            if stop:
                return

    def close(self):
        import torch.distributed as dist

        if self.rank == 0:
            self._round(("stop",))
        try:
            dist.barrier()  # no rank tears down while another is still in the last collective
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass

    def start(self):
        return self
