"""A persistent gloo group for production tests: ``R`` workers join once, then run functions.

``GroupPool.run(fn, world_size, *per_rank_args)`` runs ``fn(group, rank, *args_for_rank)`` on
ranks ``0..world_size-1`` (a subgroup made at start-up) and returns their results in rank order.
``fn`` must live in a module importable from this folder. A worker that raises out of step
with its peers, or hangs past the timeout, takes the group down with it and a fresh one is
started for the next call, so one failing test never poisons the next.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(rank, world, store_path, conn, timeout):
    sys.path.insert(0, HERE)
    import datetime
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    groups = {n: dist.new_group(list(range(n))) for n in range(1, world)}
    groups[world] = dist.group.WORLD
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        mod, name, n, args = msg
        if rank >= n:
            conn.send(("ok", None))
            continue
        try:
            fn = getattr(importlib.import_module(mod), name)
            conn.send(("ok", fn(groups[n], rank, *args[rank])))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001
                exc = RuntimeError(repr(exc))
            conn.send(("err", (exc, traceback.format_exc())))


class GroupPool:
    def __init__(self, world: int = 4, timeout: float = 60.0):
        self.world, self.timeout = world, timeout
        self.procs, self.conns = [], []

    def start(self):
        ctx = mp.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="epkit-test-group-")
        store = os.path.join(self.tmp, "store")
        for r in range(self.world):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world, store, b, self.timeout), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(a)
        for c in self.conns:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError("test group did not start")

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self.procs, self.conns = [], []

    def run(self, fn, world_size: int, *per_rank_args):
        """Per-rank results of ``fn``; re-raises the lowest rank's exception (all ranks' in
        ``exc.rank_errors``)."""
        if not self.procs:
            self.start()
        args = [tuple(a[r] for a in per_rank_args) for r in range(world_size)]
        args += [()] * (self.world - world_size)
        for c in self.conns:
            c.send((fn.__module__, fn.__name__, world_size, args))
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(self.timeout + 30):
                self.close()
                raise TimeoutError(f"rank {r} did not answer within {self.timeout + 30} s")
            out.append(c.recv())
        out = out[:world_size]
        errs = [(r, v) for r, (k, v) in enumerate(out) if k == "err"]
        if errs:
            if len(errs) != world_size:  # out of step: peers may be stuck in a collective
                self.close()
            exc, tb = errs[0][1]
            exc.rank_errors = [e for _, (e, _) in errs]
            exc.add_note(f"(rank {errs[0][0]} traceback)\n{tb}")
            raise exc
        return [v for _, v in out]
