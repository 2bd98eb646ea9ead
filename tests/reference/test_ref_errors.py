"""Every InputError class: the reason, the rank it names, the exact message; both tiers."""

import pickle

import os

import numpy as np
import pytest

from epkit import reference as ref
from epkit.reference.dtypes import BFLOAT16
from epkit.reference.errors import Reason

R, E, K, H, T = 3, 6, 2, 32, 4
TIERS = [ref, ref.fast]


def group():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(R)]
    idx = [np.array([[0, 3], [5, -1], [-1, -1], [2, 1]]) for _ in range(R)]
    ws = [np.full((T, K), 0.5, np.float32) for _ in range(R)]
    return xs, idx, ws


def mutate(what, rank=2):
    xs, idx, ws = group()
    what(xs, idx, ws, rank)
    return xs, idx, ws


def _set(lst, r, v):
    lst[r] = v


# (name, mutation on rank r, dispatch options, code, message)
CASES = [
    ("x dtype", lambda x, i, w, r: _set(x, r, x[r].astype(np.float16)), {},
     Reason.X_DTYPE, "x must be float32 or bfloat16, got float16"),
    ("index dtype", lambda x, i, w, r: _set(i, r, i[r].astype(np.float32)), {},
     Reason.INDEX_DTYPE, "topk_idx must have an integer dtype, got float32 (swapped? "
     "torch.topk returns (values, indices): topk_weights, topk_idx = scores.topk(K))"),
    ("bool index", lambda x, i, w, r: _set(i, r, i[r] > 0), {},
     Reason.INDEX_DTYPE, "topk_idx must have an integer dtype, got bool"),
    ("weights dtype", lambda x, i, w, r: _set(w, r, w[r].astype(np.float64)), {},
     Reason.WEIGHTS_DTYPE, "topk_weights must be float32, bfloat16 or float16, got float64"),
    ("x 3-D", lambda x, i, w, r: _set(x, r, x[r][:, :, None]), {},
     Reason.X_NOT_2D, "x must be 2-D [T, H], got 3 dimensions"),
    ("idx 1-D", lambda x, i, w, r: _set(i, r, i[r][:, 0]), {},
     Reason.IDX_NOT_2D, "topk_idx must be 2-D [T, K], got 1 dimensions"),
    ("idx rows", lambda x, i, w, r: _set(i, r, i[r][:3]), {},
     Reason.IDX_SHAPE, "topk_idx has 3 rows but x has 4"),
    ("weights 1-D", lambda x, i, w, r: _set(w, r, w[r][:, 0]), {},
     Reason.WEIGHTS_NOT_2D, "topk_weights must be 2-D [T, K], got 1 dimensions"),
    ("weights shape", lambda x, i, w, r: _set(w, r, w[r][:, :1]), {},
     Reason.WEIGHTS_SHAPE, "topk_weights has shape [4, 1], which differs from topk_idx"),
    ("index too big", lambda x, i, w, r: i[r].__setitem__((1, 1), 6), {},
     Reason.INDEX_OUT_OF_RANGE, "topk_idx holds expert 6, outside [-1, 6)"),
    ("index below -1", lambda x, i, w, r: i[r].__setitem__((2, 0), -2), {},
     Reason.INDEX_OUT_OF_RANGE, "topk_idx holds expert -2, outside [-1, 6)"),
    ("duplicate", lambda x, i, w, r: i[r].__setitem__((3, 1), 2), {},
     Reason.DUPLICATE_EXPERT, "topk_idx row 3 names expert 2 twice"),
    ("nan weight", lambda x, i, w, r: w[r].__setitem__((2, 1), np.nan), {},
     Reason.NONFINITE_WEIGHT, "topk_weights row 2 holds a non-finite value"),
    ("inf weight", lambda x, i, w, r: w[r].__setitem__((1, 0), -np.inf), {"capacity": 0},
     Reason.NONFINITE_WEIGHT, "topk_weights row 1 holds a non-finite value"),
    ("mxfp8 nan", lambda x, i, w, r: x[r].__setitem__((3, 5), np.nan), {"payload": "mxfp8"},
     Reason.NONFINITE_PAYLOAD, "x row 3 holds a non-finite value (payload mxfp8 needs finite x)"),
    ("mxfp8 hidden", lambda x, i, w, r: _set(x, r, x[r][:, :16]), {"payload": "mxfp8"},
     Reason.HIDDEN_NOT_MULT32,
     "payload mxfp8 needs hidden % 32 == 0: hidden size 16 is not a multiple of 32"),
    # fp8_block128: ranks below r widened to H = 128 (valid), rank r keeps H = 32.
    ("fp8_block128 nan", lambda x, i, w, r: [_set(x, q, np.tile(x[q], (1, 4))) for q in range(R)]
     + [x[r].__setitem__((1, 100), -np.inf)], {"payload": "fp8_block128"},
     Reason.NONFINITE_PAYLOAD, "x row 1 holds a non-finite value (payload fp8_block128 needs finite x)"),
    ("fp8_block128 hidden", lambda x, i, w, r: [_set(x, q, np.tile(x[q], (1, 4))) for q in range(r)],
     {"payload": "fp8_block128"}, Reason.HIDDEN_NOT_MULT32,
     "payload fp8_block128 needs hidden % 128 == 0: hidden size 32 is not a multiple of 128"),
    ("static overflow", lambda x, i, w, r: [_set(a, q, a[q][:3]) for a in (x, i, w) for q in range(r)],
     {"exchange": "static", "max_tokens_per_rank": 3},
     Reason.STATIC_OVERFLOW, "4 tokens exceed max_tokens_per_rank=3"),
    ("hidden mismatch", lambda x, i, w, r: _set(x, r, x[r][:, :16]), {},
     Reason.HIDDEN_MISMATCH, "hidden size 16 differs from rank 0's 32"),
    ("dtype mismatch", lambda x, i, w, r: _set(x, r, x[r].astype(BFLOAT16)), {},
     Reason.DTYPE_MISMATCH, "x dtype bfloat16 differs from rank 0's float32"),
    ("topk mismatch", lambda x, i, w, r: (_set(i, r, i[r][:, :1]), _set(w, r, w[r][:, :1])), {},
     Reason.TOPK_MISMATCH, "top-k 1 differs from rank 0's 2"),
]

# options: the same on every rank, so named for rank 0
OPTION_CASES = [
    ({"align": 0}, Reason.ALIGN, "align must be in [1, 1048576], got 0"),
    ({"capacity": -1}, Reason.CAPACITY, "capacity must be in [0, 2**62], got -1"),
    ({"num_experts": 0}, Reason.NUM_EXPERTS, "num_experts must be in [1, 2147483647], got 0"),
    ({"num_experts": 4}, Reason.EXPERTS_NOT_DIVISIBLE, "num_experts 4 is not a multiple of the group size 3"),
    ({"transport": "carrier-pigeon"}, Reason.OPTION, "unknown transport: choose from 'pairs', 'dedup', 'hier'"),
    ({"exchange": "smoke-signals"}, Reason.OPTION, "unknown exchange: choose from 'ragged', 'padded', 'equal', 'auto', 'lazy', 'static'"),
    ({"payload": "fp4"}, Reason.OPTION, "unknown payload: choose from 'None', 'mxfp8', 'fp8_block128'"),
    ({"exchange": "static"}, Reason.STATIC_MAX, "exchange='static' needs max_tokens_per_rank in [0, 2147483647], got -1"),
    ({"exchange": "equal"}, Reason.EQUAL_NONUNIFORM,
     "exchange='equal' needs a uniform plan (every count the same)"),
]


@pytest.mark.parametrize("tier", TIERS, ids=["clear", "fast"])
@pytest.mark.parametrize("name,mut,opts,code,msg", CASES, ids=[c[0] for c in CASES])
def test_input_errors(tier, name, mut, opts, code, msg):
    xs, idx, ws = mutate(mut)
    with pytest.raises(ref.InputError) as err:
        tier.dispatch(xs, idx, ws, num_experts=E, **opts)
    e = err.value
    assert isinstance(e, ValueError)
    assert (e.code, e.rank, e.reason) == (code, 2, msg)
    assert str(e) == f"epkit: rank 2: {msg}"
    assert pickle.loads(pickle.dumps(e)).args == e.args


@pytest.mark.parametrize("tier", TIERS, ids=["clear", "fast"])
@pytest.mark.parametrize("opts,code,msg", OPTION_CASES, ids=[c[1].name for c in OPTION_CASES])
def test_option_errors(tier, opts, code, msg):
    xs, idx, ws = group()                  # rank 0 sends 2, 2 and 1 tokens: not uniform
    kw = dict(num_experts=E, transport="dedup")
    kw.update(opts)
    with pytest.raises(ref.InputError) as err:
        tier.dispatch(xs, idx, ws, **kw)
    assert (err.value.code, err.value.reason) == (code, msg)
    assert err.value.rank == 0


def test_lowest_bad_rank_is_named():
    xs, idx, ws = group()
    ws[2][0, 0] = np.nan
    idx[1][0, 0] = 9
    with pytest.raises(ref.InputError) as err:
        ref.dispatch(xs, idx, ws, num_experts=E)
    assert (err.value.rank, err.value.code) == (1, Reason.INDEX_OUT_OF_RANGE)
    # a rank's own error comes before any disagreement between ranks
    xs, idx, ws = group()
    xs[1] = xs[1][:, :16]
    ws[2][0, 0] = np.inf
    with pytest.raises(ref.InputError) as err:
        ref.dispatch(xs, idx, ws, num_experts=E)
    assert (err.value.rank, err.value.code) == (2, Reason.NONFINITE_WEIGHT)


@pytest.mark.parametrize("tier", TIERS, ids=["clear", "fast"])
def test_combine_and_backward_errors(tier):
    xs, idx, ws = group()
    res = tier.dispatch(xs, idx, ws, num_experts=E)
    ys = [r.expert_x.copy() for r in res]

    def expect(fn, code, rank, msg):
        with pytest.raises(ref.InputError) as err:
            fn()
        assert (err.value.code, err.value.rank, err.value.reason) == (code, rank, msg)

    M1 = res[1].num_rows
    bad = list(ys)
    bad[1] = ys[1][:-1]
    expect(lambda: tier.combine(bad, res), Reason.EXPERT_Y_ROWS, 1,
           f"expert_y has {M1 - 1} rows but the dispatch produced {M1}")
    bad = list(ys)
    bad[2] = ys[2][:, :8]
    expect(lambda: tier.combine(bad, res), Reason.EXPERT_Y_HIDDEN, 2,
           "expert_y has hidden size 8 but the dispatch has 32")
    bad = list(ys)
    bad[2] = ys[2].astype(np.float64)
    expect(lambda: tier.combine(bad, res), Reason.EXPERT_Y_DTYPE, 2,
           "expert_y must be float32 or bfloat16, got float64")
    bad = list(ys)
    bad[1] = ys[1].astype(BFLOAT16)
    expect(lambda: tier.combine(bad, res), Reason.ROWS_DTYPE_MISMATCH, 1,
           "expert_y / gradient dtype bfloat16 differs from rank 0's float32")
    bad = list(ys)
    bad[0] = ys[0][:, 0]
    expect(lambda: tier.combine(bad, res), Reason.EXPERT_Y_HIDDEN, 0,
           "expert_y has hidden size -1 but the dispatch has 32")
    bad = list(ys)
    bad[1] = ys[1][:-1]
    expect(lambda: tier.dispatch_backward(bad, res), Reason.GRAD_ROWS, 1,
           f"gradient has {M1 - 1} rows but the operation produced {M1}")
    go = [x.copy() for x in xs]
    go[2] = go[2][:, :4]
    expect(lambda: tier.combine_backward(go, ys, res), Reason.GRAD_HIDDEN, 2,
           "gradient has hidden size 4 but the operation has 32")
    go = [x.astype(np.int32) for x in xs]
    expect(lambda: tier.combine_backward(go, ys, res), Reason.GRAD_DTYPE, 0,
           "gradient must be float32 or bfloat16, got int32")


@pytest.mark.parametrize("tier", TIERS, ids=["clear", "fast"])
def test_layout_and_bytes_errors(tier):
    _, idx, _ = group()
    idx[2] = idx[2].copy()
    idx[2][0, 1] = 0
    with pytest.raises(ref.InputError) as err:
        tier.layout(idx, E)
    assert (err.value.rank, err.value.reason) == (2, "topk_idx row 0 names expert 0 twice")
    with pytest.raises(ref.InputError) as err:
        tier.dispatch_bytes(idx, num_experts=E, hidden=H)
    assert err.value.code == Reason.DUPLICATE_EXPERT
    _, idx, _ = group()
    with pytest.raises(ref.InputError) as err:
        tier.combine_bytes(idx, num_experts=E, hidden=H, exchange="static", max_tokens_per_rank=2)
    assert (err.value.rank, err.value.code) == (0, Reason.STATIC_OVERFLOW)
    with pytest.raises(ref.InputError) as err:
        tier.dispatch_bytes(idx, num_experts=E, hidden=H, dtype="float16")
    assert err.value.code == Reason.X_DTYPE


def test_topk_beyond_the_dedup_wire_limit():
    big = [np.arange(256).reshape(1, 256)]
    with pytest.raises(ref.InputError) as err:
        ref.dispatch([np.ones((1, 2), np.float32)], big, [np.ones((1, 256), np.float32)],
                     num_experts=256, transport="dedup", exchange="ragged")
    assert err.value.code == Reason.TOPK_TOO_LARGE and err.value.rank == 0
    ref.dispatch([np.ones((1, 2), np.float32)], big, [np.ones((1, 256), np.float32)],
                 num_experts=256, transport="pairs", exchange="ragged")  # pairs has no limit


@pytest.mark.parametrize("rpn", [0, -1, 2, 4])
def test_ranks_per_node_must_divide_the_group(rpn):
    """ranks_per_node (the clear reference's option; 3 ranks here) must be a divisor of R."""
    xs, idx, ws = group()
    with pytest.raises(ref.InputError) as err:
        ref.dispatch(xs, idx, ws, num_experts=E, ranks_per_node=rpn)
    assert (err.value.code, err.value.rank) == (Reason.RANKS_PER_NODE, 0)
    assert err.value.reason == f"ranks_per_node must be >= 1 and divide the group size 3, got {rpn}"
    ref.dispatch(xs, idx, ws, num_experts=E, ranks_per_node=3, transport="hier")


PRODUCTION_TESTS = os.path.join(os.path.dirname(__file__), os.pardir, "production",
                                "test_collective_safety.py")


def test_every_reason_is_tested():
    """The reference's reasons are tested here; the production-only ones (from 33 on: the call
    header's) in tests/production/test_collective_safety.py."""
    here = open(__file__).read() + open(PRODUCTION_TESTS).read()
    missing = [r.name for r in Reason if r != Reason.OK and f"Reason.{r.name}" not in here]
    assert not missing, missing
