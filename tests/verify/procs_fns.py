"""Rank functions for test_procs.py (importable by spawned ranks)."""

import os
import time


def answer(rank, world, store, queue, what):
    """Each rank answers "ok" with (rank, world, what), after one progress message."""
    queue.put((rank, "progress", rank))
    queue.put((rank, "ok", (rank, world, what)))


def last_rank_exits(rank, world, store, queue):
    if rank == world - 1:
        os._exit(3)
    queue.put((rank, "ok", rank))


def last_rank_hangs(rank, world, store, queue):
    if rank == world - 1:
        time.sleep(60)
    queue.put((rank, "ok", rank))


def first_rank_fails(rank, world, store, queue):
    if rank == 0:
        queue.put((rank, "error", "boom"))
        return
    time.sleep(60)  # waits on rank 0 forever, as a peer in a collective would


def chatters(rank, world, store, queue):
    """Progress forever, never an answer: the deadline must still end the run."""
    while True:
        queue.put((rank, "progress", rank))
        time.sleep(0.05)
