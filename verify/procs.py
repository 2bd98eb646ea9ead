"""Local rank processes that never outlive their parent: the plumbing `epkit.verify`'s pool
(and through it the tests' group), `epkit bench`, the peer-failure tests and the scripts share.
A leaf: it imports nothing of epkit, so the programs in ``epkit.tools`` build on it without the
harness depending on them.

Two ways to run ranks: the persistent pool (verify/pool.py: a group that lives across calls)
and :func:`run_ranks` (one fresh group that runs one function and answers once: a benchmark,
a soak, a group whose peer is killed on purpose).

Both launch ``R`` ranks with the ``spawn`` / ``forkserver`` start methods, so a rank must (1) not
re-run the parent's ``__main__`` (scripts without a ``__main__`` guard would break) and (2) die
when the process that started it dies, so a killed bench or test run leaves no rank behind
holding a port, a FileStore or a core.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

__all__ = ["NoMainImport", "die_with_parent", "run_ranks", "RanksFailed"]


class NoMainImport:
    """Hide ``__main__`` while children are launched: their code lives in importable modules,
    but spawn / forkserver children would re-run the parent's main script as ``__mp_main__``."""

    def __enter__(self):
        self.main = sys.modules.get("__main__")
        self.saved = {k: getattr(self.main, k) for k in ("__spec__", "__file__")
                      if hasattr(self.main, k)}
        if self.main is not None:
            self.main.__spec__ = None
            if hasattr(self.main, "__file__"):
                del self.main.__file__
        return self

    def __exit__(self, *exc):
        if self.main is not None:
            for k, v in self.saved.items():
                setattr(self.main, k, v)


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Make this process die with ``parent_pid``: the kernel's parent-death signal (Linux), an
    immediate exit if the parent is already gone, and a watchdog thread that polls the parent's
    pid (the parent-death signal follows the *thread* that forked us, the forkserver's, which
    may outlive the parent)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort: not Linux, or no libc
        pass
    if not _alive(parent_pid):
        os._exit(3)

    def watch():
        while True:
            time.sleep(poll_s)
            if not _alive(parent_pid):
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="epkit-parent-watchdog").start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class RanksFailed(RuntimeError):
    """:func:`run_ranks` got too few answers: the deadline passed, or a rank exited without
    answering. ``answers``: what had come by then, ``{rank: (kind, payload)}``."""

    def __init__(self, message: str, answers: dict):
        super().__init__(message)
        self.answers = answers


def _rank_main(target, parent_pid, rank, world, store, queue, args):
    die_with_parent(parent_pid)
    target(rank, world, store, queue, *args)


def run_ranks(target: Callable, world: int, args: tuple = (), *, deadline_s: float,
              answers: Optional[int] = None, on_message: Optional[Callable] = None,
              allow_exit: bool = False, stop_on_error: bool = True,
              prefix: str = "epkit-ranks-") -> dict:
    """Run ``target(rank, world, store, queue, *args)`` on ``world`` fresh local processes and
    collect their answers.

    ``store`` is a FileStore path in a private temporary folder (no port to race for); a rank
    answers by putting ``(rank, kind, payload)`` on ``queue``: ``kind`` ``"ok"`` or ``"error"``
    is its answer, any other kind is progress, handed to ``on_message(rank, kind, payload)``.
    Returns ``{rank: (kind, payload)}`` once ``answers`` ranks (default: all) have answered,
    or at the first ``"error"`` when ``stop_on_error`` (its peers may wait on it forever).
    Raises :class:`RanksFailed` when ``deadline_s`` passes first (progress does not extend it)
    or, unless ``allow_exit`` (a rank that exits on purpose), when a rank exits without
    answering. The ranks die with this process; whatever is still running on the way out is
    killed, the folder removed.
    """
    want = world if answers is None else answers
    ctx = mp.get_context("spawn")
    got: dict = {}
    procs: list = []
    tmp = queue = None
    try:
        tmp = tempfile.mkdtemp(prefix=prefix)
        queue = ctx.Queue()
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, daemon=True, name=f"{prefix}rank{r}",
                             args=(target, os.getpid(), r, world, store, queue, tuple(args)))
                 for r in range(world)]
        # A target in the main script itself (a script's rank function) needs the script
        # re-imported in the ranks, which its __main__ guard allows; any other target, not.
        with NoMainImport() if target.__module__ != "__main__" else contextlib.nullcontext():
            for p in procs:
                p.start()
        end = time.monotonic() + deadline_s

        def take(message) -> bool:
            """Record one message; True when it ends the run (an error, stop_on_error)."""
            rank, kind, payload = message
            if kind not in ("ok", "error"):
                if on_message is not None:
                    on_message(rank, kind, payload)
                return False
            got[rank] = (kind, payload)
            return kind == "error" and stop_on_error

        while len(got) < want:
            if time.monotonic() > end:  # checked every message: progress never extends it
                raise RanksFailed(f"{want - len(got)} of {world} ranks did not answer within "
                                  f"{deadline_s:.0f} s", got)
            try:
                if take(queue.get(timeout=max(0.05, min(1.0, end - time.monotonic())))):
                    break
                continue
            except queue_mod.Empty:
                pass
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            if gone and not allow_exit:
                # an answer put just before its rank exited may still be in the pipe
                stop = False
                try:
                    while True:
                        stop |= take(queue.get(timeout=0.2))
                except queue_mod.Empty:
                    pass
                if stop:
                    break
                gone = [r for r in gone if r not in got]
                if gone:
                    codes = [procs[r].exitcode for r in gone]
                    raise RanksFailed(f"rank(s) {gone} exited without answering (exit codes "
                                      f"{codes})", got)
        for p in procs:
            p.join(timeout=0.5 if "error" in (k for k, _ in got.values()) else 5)
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if queue is not None:
            queue.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
