"""A dead or stalled peer is an error on the others within the process group's timeout plus a
small margin, never a hang; the error names the epkit operation."""

import pytest

import peer_fns
from epkit.verify.procs import RanksFailed, run_ranks

TIMEOUT = 4.0   # the process group's timeout in these tests (seconds)
MARGIN = 10.0   # what we allow on top of it, process start-up excluded


@pytest.mark.parametrize("scenario,op", [
    ("stalls", "epkit.dispatch"),        # never enters the call: the count exchange times out
    ("dies_before", "epkit.dispatch"),   # exits before the call
    ("dies_during", "epkit.combine"),    # exits between dispatch and combine
])
def test_peer_failure_is_an_error_not_a_hang(scenario, op):
    world = 3
    try:  # the survivors' answers (the victim gives none); generous: includes torch start-up
        answers = run_ranks(peer_fns.run, world, (TIMEOUT, scenario), deadline_s=120,
                            answers=world - 1, allow_exit=True, stop_on_error=False,
                            prefix="epkit-peer-")
    except RanksFailed as exc:
        pytest.fail(f"survivors hung: {exc}; answers so far {exc.answers}")
    got = {rank: payload for rank, (_, payload) in answers.items()}
    assert world - 1 not in got, "the victim answered"
    print(scenario, {r: (k, round(s, 2)) for r, (k, _, s) in got.items()})
    for rank, (kind, msg, seconds) in got.items():
        assert kind == "PeerError", (rank, kind, msg)
        assert op in msg, (rank, msg)
        assert seconds <= TIMEOUT + MARGIN, (rank, seconds)
