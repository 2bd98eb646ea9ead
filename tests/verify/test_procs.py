"""epkit.verify.procs.run_ranks, the one launcher of fresh local groups (bench, the peer-failure
tests, the scripts): answers, progress, and every way a group can fail to answer."""

import time

import pytest

import procs_fns
from epkit.verify.procs import RanksFailed, run_ranks


def test_every_rank_answers_and_progress_is_handed_on():
    seen = []
    got = run_ranks(procs_fns.answer, 3, ("x",), deadline_s=60,
                    on_message=lambda rank, kind, payload: seen.append((rank, kind, payload)))
    assert got == {r: ("ok", (r, 3, "x")) for r in range(3)}
    assert sorted(seen) == [(r, "progress", r) for r in range(3)]


def test_a_rank_that_exits_without_answering_is_named():
    with pytest.raises(RanksFailed, match=r"rank\(s\) \[2\] exited without answering") as exc:
        run_ranks(procs_fns.last_rank_exits, 3, deadline_s=60)
    assert set(exc.value.answers) <= {0, 1}
    # on purpose (allow_exit): the others' answers
    got = run_ranks(procs_fns.last_rank_exits, 3, deadline_s=60, answers=2, allow_exit=True)
    assert got == {0: ("ok", 0), 1: ("ok", 1)}


def test_a_hanging_rank_is_a_deadline_not_a_hang():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="1 of 2 ranks did not answer within 8 s"):
        run_ranks(procs_fns.last_rank_hangs, 2, deadline_s=8)
    assert time.monotonic() - start < 30  # the hanging rank was killed, not waited for


def test_an_error_answer_ends_the_run():
    start = time.monotonic()
    got = run_ranks(procs_fns.first_rank_fails, 2, deadline_s=50)
    assert got == {0: ("error", "boom")}
    assert time.monotonic() - start < 30


def test_progress_does_not_extend_the_deadline():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="2 of 2 ranks did not answer within 6 s"):
        run_ranks(procs_fns.chatters, 2, deadline_s=6, on_message=lambda *m: None)
    assert time.monotonic() - start < 30
