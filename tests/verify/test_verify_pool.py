"""The persistent pool: cases run on a real gloo group; broken workers are replaced."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from epkit.verify import Pool
from epkit.verify.cases import Case, ModeSpec
from epkit.verify.checks import check_case

from verify_testlib import MISBEHAVING, PLAIN

CASE = Case(world_size=2, num_experts=4, topk=2, hidden=8, tokens=(3, 2), seed=5)


def _ok(results):
    return all(r["error"] is None for r in results)


def test_cases_of_every_world_size_run_on_one_group(pool):
    for n in (3, 1, 2):
        case = Case(world_size=n, num_experts=2 * n, topk=2, hidden=4, tokens=(2,) * n, seed=n)
        results = pool.run(case, PLAIN, ModeSpec())
        assert [r["rank"] for r in results] == list(range(n))
        assert not check_case(case, ModeSpec(), results).failed


def test_uniform_not_implemented_keeps_the_group(pool):
    before = pool.restarts
    results = pool.run(CASE, f"{MISBEHAVING}:not_implemented", ModeSpec())
    assert all(r["error"]["unsupported"] and r["error"]["stage"] == "factory" for r in results)
    results = pool.run(CASE, f"{MISBEHAVING}:combine_not_implemented", ModeSpec())
    assert all(r["error"]["stage"] == "combine" for r in results)
    v = check_case(CASE, ModeSpec(), results)
    assert v.status["dispatch"] == "passed" and v.status["combine"] == "refused"
    assert pool.restarts == before


@pytest.fixture()
def small_pool():
    p = Pool(2, timeout=3.0)
    yield p
    p.close()


@pytest.mark.parametrize("factory,kind", [("hang", "Timeout"), ("die", "WorkerDied"),
                                          ("raise_on_one_rank", "RuntimeError")])
def test_a_broken_worker_is_replaced(small_pool, factory, kind):
    assert _ok(small_pool.run(CASE, PLAIN))
    t0 = time.monotonic()
    results = small_pool.run(CASE, f"{MISBEHAVING}:{factory}")
    took = time.monotonic() - t0
    errors = [r["error"] and (r["error"]["type"], r["error"]["message"]) for r in results]
    assert took < 30, (took, errors)  # 3 s gloo timeout plus grace; generous for a busy box
    assert results[0]["error"]["type"] == kind, errors
    assert results[1]["error"] is not None, errors  # the peer gave up too
    assert small_pool.restarts == 1
    assert _ok(small_pool.run(CASE, PLAIN))  # a fresh group


def test_workers_die_with_their_parent(tmp_path):
    """A script without a __main__ guard starts a pool and is then killed: no worker lingers."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from epkit.verify import Pool
        from epkit.verify.cases import Case
        pool = Pool(2, timeout=10).start()
        case = Case(world_size=2, num_experts=2, topk=1, hidden=2, tokens=(1, 1))
        assert all(r["error"] is None for r in pool.run(case, {PLAIN!r}))
        print(pool._dir, " ".join(str(p.pid) for p in pool._procs), flush=True)
        os.kill(os.getpid(), 9)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store_dir, *pids = proc.stdout.split()
    shutil.rmtree(store_dir, ignore_errors=True)  # the killed parent could not clean up
    pids = [int(p) for p in pids]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"workers {alive} outlived their parent"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting to be reaped is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_hanging_impl_fails_once_per_mode_without_shrinking(small_pool):
    from epkit.verify.runner import Suite

    t0 = time.monotonic()
    res = Suite(small_pool, impl=f"{MISBEHAVING}:hang", examples=20, seed=1,
                shrink_seconds=60).run()
    assert res.failed and time.monotonic() - t0 < 45
    (verdict,) = res.failures
    assert "timeout" in verdict.report()


def test_an_error_on_one_rank_does_not_end_the_mode(small_pool):
    """Only a hang (a case that ran into the timeout) stops a mode; a rank that raises makes
    its peers give up quickly, the group is rebuilt, and every example still runs."""
    from epkit.verify.runner import Suite

    res = Suite(small_pool, impl=f"{MISBEHAVING}:raise_on_one_rank", examples=4, seed=1,
                shrink_seconds=0, corners=False).run()
    t = res.tallies["default"]["dispatch"]
    assert t.requested == 4 and t.failed == 4, res.table()
    assert "rank 0 gave up" in res.failures[0].report()
