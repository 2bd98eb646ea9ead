"""Processes for test_peer_failure.py: a fresh gloo group with a short timeout per scenario
(a group whose peer died is not reusable, so these never use the shared pool)."""

from __future__ import annotations

import datetime
import os
import time
import traceback


def run(rank, world, store_path, queue, timeout_s, scenario):
    """One rank of ``scenario`` (epkit.verify.procs.run_ranks): the last rank is the victim;
    a survivor answers ("ok" or "error", (exception type, message, seconds in the call))."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    # Every rank through the group's set-up before the victim leaves: a victim that exits
    # while a slow survivor still connects gloo's mesh makes init_process_group raise there,
    # before the epkit call under test (ci-fresh under load: one survivor never answered).
    dist.barrier()
    import epkit

    E = 2 * world
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, E - 1], [1, 2], [3, -1], [E - 2, 0]])
    w = torch.rand(4, 2)
    victim = rank == world - 1
    if victim:
        if scenario == "dies_before":
            os._exit(1)
        if scenario == "stalls":
            time.sleep(timeout_s * 6)
            os._exit(0)
    start = time.monotonic()
    try:
        d = epkit.dispatch(x, idx, w, num_experts=E)
        if victim and scenario == "dies_during":
            os._exit(1)  # after the dispatch, before the combine its peers are waiting in
        epkit.combine(d.expert_x, d)
        queue.put((rank, "ok", ("", "", time.monotonic() - start)))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", (type(exc).__name__,
                                   f"{exc}\n{traceback.format_exc(limit=2)}",
                                   time.monotonic() - start)))
    queue.close()
    queue.join_thread()  # flush before the hard exit (a torn-down group can hang atexit)
    os._exit(0)
