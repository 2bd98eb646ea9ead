"""Bad input on one rank: every rank raises the same InputError naming that rank, before any
token moves, and the group stays usable."""

import numpy as np
import pytest

import rank_fns
from epkit import reference as ref
from epkit.reference.errors import Reason

R, E, H, K, T = 3, 6, 4, 2, 3


def good():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(R)]
    idxs = [np.array([[0, 5], [1, -1], [2, 3]]) for _ in range(R)]
    ws = [np.ones((T, K), np.float32) for _ in range(R)]
    return xs, idxs, ws


def corrupt(kind):
    xs, idxs, ws = good()
    m = 1  # the middle rank only
    if kind == "out_of_range":
        idxs[m] = idxs[m].copy(); idxs[m][1, 1] = E
    elif kind == "below_minus_one":
        idxs[m] = idxs[m].copy(); idxs[m][0, 0] = -2
    elif kind == "duplicate":
        idxs[m] = idxs[m].copy(); idxs[m][2] = [3, 3]
    elif kind == "float_index":
        idxs[m] = idxs[m].astype(np.float32)
    elif kind == "nan_weight":
        ws[m] = ws[m].copy(); ws[m][2, 0] = np.nan
    elif kind == "inf_weight":
        ws[m] = ws[m].copy(); ws[m][0, 1] = np.inf
    elif kind == "hidden_mismatch":
        xs[m] = np.zeros((T, H + 1), np.float32)
    elif kind == "dtype_mismatch":
        xs[m] = xs[m].astype(rank_fns.BF16)
    elif kind == "topk_mismatch":
        idxs[m] = idxs[m][:, :1].copy(); ws[m] = ws[m][:, :1].copy()
    elif kind == "shape_mismatch":
        idxs[m] = idxs[m][:2].copy(); ws[m] = ws[m][:2].copy()
    elif kind == "weights_shape":
        ws[m] = np.ones((T, K + 1), np.float32)
    return xs, idxs, ws


KINDS = ["out_of_range", "below_minus_one", "duplicate", "float_index", "nan_weight",
         "inf_weight", "hidden_mismatch", "dtype_mismatch", "topk_mismatch", "shape_mismatch",
         "weights_shape"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_on_middle_rank(group_pool, kind):
    xs, idxs, ws = corrupt(kind)
    with pytest.raises(ref.InputError) as want:
        ref.dispatch(xs, idxs, ws, num_experts=E)
    assert want.value.rank == 1
    got = group_pool.run(rank_fns.raises_input_error, R, xs, idxs, ws, [dict(num_experts=E)] * R)
    for r, (err, kept) in enumerate(got):
        assert err is not None, f"rank {r} did not raise"
        assert err == (1, int(want.value.code), str(want.value)), (r, err, str(want.value))
    # The next valid call on the same group succeeded: 3 used slots per rank arrived.
    assert sum(kept for _, kept in got) == 3 * R


@pytest.mark.parametrize("opts,code", [
    (dict(num_experts=5), Reason.EXPERTS_NOT_DIVISIBLE),
    (dict(num_experts=E, align=0), Reason.ALIGN),
    (dict(num_experts=E, capacity=-1), Reason.CAPACITY),
    (dict(num_experts=E, transport="dedupe"), Reason.OPTION),  # the same typo on every rank
    (dict(num_experts=E, exchange="raggedy"), Reason.OPTION),
    (dict(num_experts=E, payload="fp4"), Reason.OPTION),
    (dict(num_experts=E, align=1 << 40), Reason.ALIGN),
    (dict(num_experts=E, align=1.5), Reason.ALIGN),            # not an integer: reported as -1
    (dict(num_experts=E, capacity="3"), Reason.CAPACITY),
    (dict(num_experts=E, capacity=2, capacity_factor=1.0), Reason.CAPACITY_AND_FACTOR),
    (dict(num_experts=E, capacity_factor=float("nan")), Reason.CAPACITY_FACTOR),
    (dict(num_experts=E, capacity_factor=0.0), Reason.CAPACITY_FACTOR),
    (dict(num_experts=E, exchange="static"), Reason.STATIC_MAX),
    (dict(num_experts=E, ranks_per_node=2), Reason.RANKS_PER_NODE),   # 2 does not divide 3
])
def test_bad_options(group_pool, opts, code):
    """Every rank raises the option error, with the reference's message word for word: the
    option checks are one body (reference/validate.py option_triple) that production asks."""
    xs, idxs, ws = good()
    with pytest.raises(ref.InputError) as want:
        ref.validate.check_options(R, **{**dict(align=1, capacity=None, transport="dedup",
                                                exchange="auto"), **opts})
    assert want.value.code == code
    got = group_pool.run(rank_fns.raises_input_error, R, xs, idxs, ws, [opts] * R)
    assert all(err == (0, int(code), str(want.value)) for err, _ in got), (got, str(want.value))


def test_none_transport_and_exchange_are_the_defaults(group_pool):
    """transport=None, exchange=None: dedup and auto, as the reference fills them in."""
    xs, idxs, ws = good()
    got = group_pool.run(rank_fns.raises_input_error, R, xs, idxs, ws,
                         [dict(num_experts=E, transport=None, exchange=None)] * R)
    assert all(err is None for err, _ in got), got


def test_equal_exchange_on_a_non_uniform_plan(group_pool):
    xs, idxs, ws = good()
    with pytest.raises(ref.InputError) as want:
        ref.dispatch(xs, idxs, ws, num_experts=E, transport="dedup", exchange="equal")
    got = group_pool.run(rank_fns.raises_input_error, R, xs, idxs, ws,
                         [dict(num_experts=E, exchange="equal")] * R)
    for err, _ in got:
        assert err == (want.value.rank, int(want.value.code), str(want.value)), (err, str(want.value))


@pytest.mark.parametrize("kind", ["rows", "hidden", "dtype", "mixed"])
def test_bad_expert_y_on_middle_rank(group_pool, kind):
    """combine: bad expert_y on rank 1 only -> the same InputError on every rank, no hang,
    and the next valid combine works."""
    xs, idxs, ws = good()
    kinds = [None, kind, None]
    res = ref.dispatch(xs, idxs, ws, num_experts=E)
    ys = [r.expert_x.copy() for r in res]
    if kind == "rows":
        ys[1] = np.concatenate([ys[1], ys[1][:1]])
    elif kind == "hidden":
        ys[1] = np.zeros((ys[1].shape[0], H + 1), np.float32)
    elif kind == "dtype":
        ys[1] = ys[1].astype(np.float16)
    elif kind == "mixed":
        ys[1] = ys[1].astype(rank_fns.BF16)
    with pytest.raises(ref.InputError) as want:
        ref.combine(ys, res)
    got = group_pool.run(rank_fns.combine_with_bad_expert_y, R, xs, idxs, ws, kinds)
    for r, (err, shape) in enumerate(got):
        assert err == (want.value.rank, int(want.value.code), str(want.value)), (r, err, str(want.value))
        assert shape == xs[r].shape


@pytest.mark.parametrize("Ks, exchange", [([2, 300], "auto"), ([255, 256], "auto"),
                                          ([300, 300], "auto"), ([300, 300], "static"),
                                          ([255, 256], "static")])
def test_topk_beyond_the_dedup_limit(group_pool, Ks, exchange):
    """K > 255 under dedup: the collective InputError the reference's dedup gives, not a
    timeout. On one rank only it is that rank's K differing from rank 0's (the ranks' agreement
    comes before the transport's limit, as in the canonical spec, so epkit verify's violation
    that widens one rank's K past 255 gets the message it expects); on every rank it is rank 0's
    TOPK_TOO_LARGE."""
    Ebig, T = 512, 2
    rng = np.random.default_rng(5)
    xs = [np.ones((T, 4), np.float32) for _ in Ks]
    idxs = [np.stack([rng.permutation(Ebig)[:K] for _ in range(T)]) for K in Ks]
    ws = [np.ones((T, K), np.float32) for K in Ks]
    opts = dict(num_experts=Ebig, exchange=exchange,
                max_tokens_per_rank=T if exchange == "static" else None)
    with pytest.raises(ref.InputError) as want:
        ref.dispatch(xs, idxs, ws, transport="dedup", **opts)
    assert want.value.code in (Reason.TOPK_MISMATCH, Reason.TOPK_TOO_LARGE)
    got = group_pool.run(rank_fns.raises_input_error, 2, xs, idxs, ws, [opts] * 2)
    for err, _ in got:
        assert err == (want.value.rank, int(want.value.code), str(want.value)), err


def test_a_rank_outside_the_group_is_told_so(group_pool):
    """new_group() gives the ranks outside a group a marker, not a group: such a rank is told it
    is not a member (before: it fell back to the world group and blamed a peer)."""
    (msg,) = group_pool.run(rank_fns.non_member_error, 1)
    assert msg is not None and "rank 0 is not a member of the group passed to epkit" in msg
