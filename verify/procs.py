"""Local rank processes that never outlive their parent: the plumbing `epkit.verify`'s pool
(and through it the tests' group) and `epkit bench` share. A leaf: it imports nothing of epkit,
so the programs in ``epkit.tools`` build on it without the harness depending on them.

Both launch ``R`` ranks with the ``spawn`` / ``forkserver`` start methods, so a rank must (1) not
re-run the parent's ``__main__`` (scripts without a ``__main__`` guard would break) and (2) die
when the process that started it dies, so a killed bench or test run leaves no rank behind
holding a port, a FileStore or a core.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["NoMainImport", "die_with_parent"]


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
