"""A dead or stalled peer is an error on the others within the process group's timeout plus a
small margin, never a hang; the error names the epkit operation."""

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile

import pytest

import peer_fns

TIMEOUT = 4.0   # the process group's timeout in these tests (seconds)
MARGIN = 10.0   # what we allow on top of it, process start-up excluded


@pytest.mark.parametrize("scenario,op", [
    ("stalls", "epkit.dispatch"),        # never enters the call: the count exchange times out
    ("dies_before", "epkit.dispatch"),   # exits before the call
    ("dies_during", "epkit.combine"),    # exits between dispatch and combine
])
def test_peer_failure_is_an_error_not_a_hang(scenario, op):
    world = 3
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="epkit-peer-"), "store")
    procs = [ctx.Process(target=peer_fns.run, args=(r, world, store, TIMEOUT, scenario, q),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < world - 1:
            rank, kind, msg, seconds = q.get(timeout=120)  # generous: includes torch start-up
            got[rank] = (kind, msg, seconds)
    except queue_mod.Empty:
        pytest.fail(f"survivors hung: answers so far {got}")
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    print(scenario, {r: (k, round(s, 2)) for r, (k, _, s) in got.items()})
    for rank, (kind, msg, seconds) in got.items():
        assert kind == "PeerError", (rank, kind, msg)
        assert op in msg, (rank, msg)
        assert seconds <= TIMEOUT + MARGIN, (rank, seconds)
