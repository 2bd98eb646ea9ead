"""A persistent gloo group for production tests: ``R`` workers join once, then run functions.

``GroupPool.run(fn, world_size, *per_rank_args)`` runs ``fn(group, rank, *args_for_rank)`` on
ranks ``0..world_size-1`` (a subgroup made at start-up) and returns their results in rank order.
``fn`` must live in a module the workers can import (they are spawned, with this process's
``sys.path`` and environment as they are when the group starts). The group is
:class:`epkit.verify.pool.Workers`, the one verify runs its cases on: a worker that dies, raises
out of step with its peers, or hangs past the timeout takes the group down with it and a fresh
one is started for the next call, so one failing test never poisons the next.
"""

from __future__ import annotations

import os

from epkit.verify.pool import Workers


class GroupPool(Workers):
    def __init__(self, world: int = 4, timeout: float = 60.0):
        # Spawned, not forked from a server: a test may set EPKIT_KERNELS (or sys.path) for
        # its own group just before starting it. No grace: a rank's peers get the whole wait
        # to fail too, so every rank's error is reported.
        super().__init__(world, timeout=timeout, start_method="spawn", answer_s=timeout + 30,
                         grace=None, ready_s=120.0, name="epkit-test-group")

    @property
    def world(self) -> int:
        return self.world_size

    def run(self, fn, world_size: int, *per_rank_args):
        """Per-rank results of ``fn``; re-raises the lowest rank's exception (all ranks' in
        ``exc.rank_errors``); a rank that died or hung is a RuntimeError or a TimeoutError."""
        args = [tuple(a[r] for a in per_rank_args) for r in range(world_size)]
        replies = self.call(fn, world_size, args)
        errs = [(r, v) for r, (k, v) in enumerate(replies) if k == "err"]
        if errs:
            if len(errs) != world_size and self.started:  # peers may be stuck in a collective
                self.restart()
            exc, tb = errs[0][1]
            exc.rank_errors = [e for _, (e, _) in errs]
            exc.add_note(f"(rank {errs[0][0]} traceback)\n{tb}")
            raise exc
        for r, (kind, value) in enumerate(replies):
            if kind == "died":
                raise RuntimeError(f"test group: rank {r} died (exit code {value})")
            if kind == "timeout":
                raise TimeoutError(f"test group: rank {r} did not answer within "
                                   f"{self.answer_s:.0f} s")
        return [v for _, v in replies]


def started_with_kernels(kernels: str, world: int, timeout: float) -> GroupPool:
    """A started pool whose workers run ``EPKIT_KERNELS=kernels`` (read when epkit loads its
    kernels, so it must be in their environment before they import epkit); this process's
    environment is left as it was."""
    before = os.environ.get("EPKIT_KERNELS")
    os.environ["EPKIT_KERNELS"] = kernels
    pool = GroupPool(world=world, timeout=timeout)
    try:
        pool.start()
    finally:
        if before is None:
            os.environ.pop("EPKIT_KERNELS")
        else:
            os.environ["EPKIT_KERNELS"] = before
    return pool
