"""The call header's decision (production/agree.py) on synthetic gathered headers: which error
wins, which rank it names; and the pending path CUDA-graph capture uses, read by
raise_pending (docs/reliability.md 1b)."""

import pytest
import torch

from epkit import agree
from epkit.reference.errors import InputError, Reason

OPTS = [8, 1, -1, 1, 3, 0, -1]  # E, align, capacity, dedup, auto, no payload, no max_tokens


def headers(R, **edits):
    """``[R, HEADER]``: R identical dispatch headers at call 5, then ``edits[rank] = {word: v}``."""
    h = torch.tensor([agree.header(agree.DISPATCH, OPTS, (0, 0, 0))] * R)
    h[:, agree.W_SEQ] = 5
    for rank, words in edits.items():
        for w, v in words.items():
            h[int(rank[1:]), w] = v
    return h


def decide(h):
    """The host decision (rows) and the device one (tensor ops): they must agree."""
    on_host, on_device = agree.group_error(h.tolist()), agree.group_error_tensor(h).tolist()
    assert on_host == on_device, (on_host, on_device)
    return tuple(on_host)


def test_agreement_is_no_error():
    assert decide(headers(4)) == (0, 0, 0, 0)


def test_lowest_bad_rank_is_named():
    h = headers(4, r2={agree.W_CODE: int(Reason.ALIGN), agree.W_A: 0},
                r3={agree.W_CODE: int(Reason.CAPACITY), agree.W_A: -1})
    assert decide(h) == (int(Reason.ALIGN), 2, 0, 0)


def test_out_of_step_beats_a_local_error():
    h = headers(3, r1={agree.W_CODE: int(Reason.ALIGN)}, r2={agree.W_OP: agree.COMBINE})
    assert decide(h) == (int(Reason.CALL_MISMATCH), 2, agree.COMBINE, agree.DISPATCH)
    h = headers(3, r1={agree.W_SEQ: 9}, r2={agree.W_CODE: int(Reason.ALIGN)})
    assert decide(h) == (int(Reason.CALL_SEQUENCE), 1, 9, 5)
    h = headers(2, r1={agree.W_MAGIC: 0})  # a collective that is not an epkit call
    assert decide(h)[:2] == (int(Reason.CALL_MISMATCH), 1)


def test_local_errors_beat_option_mismatches_which_go_in_order():
    h = headers(3, r1={agree.W_E: 16}, r2={agree.W_CODE: int(Reason.X_DTYPE), agree.W_A: 3})
    assert decide(h) == (int(Reason.X_DTYPE), 2, 3, 0)
    h = headers(3, r1={agree.W_TRANSPORT: 0}, r2={agree.W_E: 16})
    assert decide(h) == (int(Reason.NUM_EXPERTS_MISMATCH), 2, 16, 8)  # E is checked first


def test_pending_errors_raise_later_and_resync():
    g = type("Group", (), {"group_name": "test-agree-pending"})()
    state = agree._state(g)
    bad = headers(2, r1={agree.W_SEQ: 7})
    state.pending.append((agree.group_error_tensor(bad), bad))
    with pytest.raises(InputError) as err:
        agree.raise_pending(g)
    assert err.value.code == Reason.CALL_SEQUENCE and err.value.rank == 1
    assert state.seq == 8 and not state.pending  # everyone's next call carries 8
    agree.raise_pending(g)  # nothing left: no error


def test_a_static_dispatchs_shape_is_checked_as_the_count_exchange_checks_it():
    """A static dispatch on the device path sizes its exchange from its own H, x dtype and K
    without reading the plan back, so the header carries them: the lowest rank first, H then
    dtype then K within a rank, the count exchange's reasons (reference/validate.py)."""
    shape = {agree.W_X_HIDDEN: 64, agree.W_X_DTYPE: 1, agree.W_TOPK: 2}

    def same(R):
        return {f"r{r}": dict(shape) for r in range(R)}

    assert decide(headers(4, **same(4))) == (0, 0, 0, 0)
    h = headers(4, **{**same(4), "r2": {**shape, agree.W_TOPK: 3},
                      "r3": {**shape, agree.W_X_HIDDEN: 32}})
    assert decide(h) == (int(Reason.TOPK_MISMATCH), 2, 3, 2)  # rank 2 before rank 3
    h = headers(3, **{**same(3), "r1": {**shape, agree.W_TOPK: 4, agree.W_X_DTYPE: 2}})
    assert decide(h) == (int(Reason.DTYPE_MISMATCH), 1, 2, 1)  # dtype before K
    h = headers(3, **{**same(3), "r1": {**shape, agree.W_X_HIDDEN: 8},
                      "r2": {**shape, agree.W_CODE: int(Reason.ALIGN)}})
    assert decide(h) == (int(Reason.ALIGN), 2, 0, 0)  # a local error comes first


def test_a_static_top_k_over_the_transport_limit_names_rank_0_after_the_shapes():
    """A static dispatch on the device path carries its K: once every rank's K agrees, a K over
    the transport's limit (dedup: 255, k in 8 bits) is rank 0's error; a K that differs is the
    mismatch of the rank that differs, as the reference's transport decides."""
    K = agree.W_TOPK
    over = {K: 300}
    h = headers(3, r0=over, r1=over, r2=over)
    assert decide(h) == (int(Reason.TOPK_TOO_LARGE), 0, 300, 255)
    h = headers(2, r0={K: 255}, r1={K: 256})
    assert decide(h) == (int(Reason.TOPK_MISMATCH), 1, 256, 255)
    h = headers(2, r0={K: 255}, r1={K: 255})
    assert decide(h) == (0, 0, 0, 0)
    pairs = {K: 300, agree.W_TRANSPORT: 0}  # pairs: any K
    assert decide(headers(2, r0=pairs, r1=pairs)) == (0, 0, 0, 0)
    h = headers(2, r0=over, r1={K: 300, agree.W_CODE: int(Reason.ALIGN)})
    assert decide(h)[:2] == (int(Reason.ALIGN), 1)  # a rank's own error first
