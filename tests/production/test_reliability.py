"""Reliability of the production API over real gloo groups.

- Nothing lost or corrupted (item 3): inputs byte-identical after every call, failed calls
  included; outputs share no storage with each other, with the inputs, or with the next call's
  outputs; a failed call leaves the Dispatcher (and the Dispatch) usable.
- Determinism (item 4): 100 repeated calls bitwise identical; every transport and exchange
  variant bitwise identical; torch.set_num_threads(1) vs 2 bitwise identical.
- Edges (item 5): zero tokens everywhere, one expert, K == E, hidden 1 and 16384, 65536 tokens
  on one rank and none elsewhere, int32 (and narrower) indices, non-contiguous inputs.

Every result is also compared with ``epkit.reference`` bit for bit (``grad_topk_weights``
within the tolerance of docs/design.md item 6). Per-rank code: reliability_fns.py. The soak
(item 6) is scripts/soak.py, outside the fast test path; docs/reliability.md has the overview.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import reliability_fns as fns
from cases import BF16, assert_bitwise, expected, group_cases
from epkit import reference as ref
from epkit.reference.errors import Reason
from epkit.verify.tolerances import weight_grad_allowed_error

SETTINGS = settings(max_examples=6, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
TRANSPORTS = ("dedup", "pairs")
EXCHANGES = ("ragged", "padded", "auto", "lazy", "static")
BITWISE = ("expert_x", "tokens_per_expert", "expert_offsets", "row_src", "row_weight",
           "dropped_per_expert", "out", "grad_x")


# ---- helpers -------------------------------------------------------------------------------------

def opts_of(E, transport="dedup", exchange="ragged", align=1, capacity=None, y_dtype="float32",
            weighted=True, max_tokens=None, **extra):
    o = dict(E=E, align=align, capacity=capacity, transport=transport, exchange=exchange,
             y_dtype=y_dtype, weighted=weighted, **extra)
    if exchange == "static" or max_tokens is not None:
        o["max_tokens_per_rank"] = max_tokens
    return o


def make_case(Ts, E, K, H, seed=0, dtype=np.float32, idx_dtype=np.int64, unused=0.2):
    """Per-rank inputs: random distinct experts per row, some slots -1."""
    rng = np.random.default_rng(seed)
    xs, idxs, ws, gouts = [], [], [], []
    for T in Ts:
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        idx[rng.random((T, K)) < unused] = -1
        xs.append(rng.standard_normal((T, H)).astype(np.float32).astype(dtype))
        idxs.append(idx.astype(idx_dtype))
        ws.append(rng.random((T, K)).astype(np.float32))
        gouts.append(rng.standard_normal((T, H)).astype(np.float32).astype(dtype))
    return xs, idxs, ws, gouts


def weight_grad_ok(got_w, want, res, ys, gouts, H):
    """grad_topk_weights within docs/design.md item 6's bound (:mod:`epkit.verify.tolerances`),
    vectorized (big cases too); exactly 0 on unused slots."""
    R = len(gouts)
    bound = [np.full(np.asarray(w).shape, -1.0) for w in got_w]
    for d in range(R):
        rs = res[d].row_src
        m = rs[:, 0] >= 0
        s, t, k = rs[m].T
        y = np.asarray(ys[d][m], np.float64)
        for src in np.unique(s):
            sel = s == src
            g = np.asarray(gouts[src], np.float64)[t[sel]]
            bound[src][t[sel], k[sel]] = weight_grad_allowed_error(H, np.abs(g * y[sel]).sum(1))
    for r in range(R):
        got, w = np.asarray(got_w[r], np.float64), np.asarray(want[r], np.float64)
        assert got.shape == w.shape, (r, got.shape, w.shape)
        used = bound[r] >= 0
        assert np.all(np.abs(got - w)[used] <= bound[r][used]), f"rank {r}: grad_topk_weights"
        assert np.all(got[~used] == 0) and np.all(w[~used] == 0), f"rank {r}: unused slot grads"


def check_reference(got, xs, idxs, ws, gouts, opts, fast=False):
    """Every rank's round_trip results equal the reference's (static: canonical rows, then
    zero rows, cut before comparing)."""
    mod = ref.fast if fast else ref
    want = expected(xs, idxs, ws, gouts, opts, ref=mod)
    res = mod.dispatch(xs, idxs, ws, num_experts=opts["E"], align=opts["align"],
                       capacity=opts["capacity"])  # for the weight-gradient bound's row_src
    for r, g in enumerate(got):
        if opts["exchange"] == "static":
            M = want[r]["expert_x"].shape[0]
            assert np.all(g["expert_x"][M:].astype(np.float32) == 0)
            assert np.all(g["row_src"][M:] == -1) and np.all(g["row_weight"][M:] == 0)
            g = dict(g, **{k: g[k][:M] for k in ("expert_x", "row_src", "row_weight")})
        for name in BITWISE:
            assert_bitwise(name, g[name], want[r][name], r)
    want_w = [w["grad_w"] if opts["weighted"] else np.zeros_like(w["grad_w"]) for w in want]
    ys = [w["y"] if opts["weighted"] else np.zeros_like(w["y"]) for w in want]
    weight_grad_ok([g["grad_w"] for g in got], want_w, res, ys, gouts, xs[0].shape[1])


def run_edge(group_pool, xs, idxs, ws, gouts, opts, fast=False):
    R = len(xs)
    got = group_pool.run(fns.edge_round, R, xs, idxs, ws, gouts, [opts] * R)
    check_reference(got, xs, idxs, ws, gouts, opts, fast=fast)
    return got


def same_bits(a, b, where):
    for k in a:
        assert_bitwise(f"{where}: {k}", b[k], a[k], -1)


# ---- item 3: nothing lost or corrupted ----------------------------------------------------------

@SETTINGS
@given(case=group_cases(max_world=3))
def test_inputs_untouched_outputs_unaliased(group_pool, case):
    """Random cases (every transport and exchange): inputs byte-identical after dispatch,
    combine and backward; no output shares storage with another output, an input, or the next
    round's outputs; the first round's outputs unchanged by the second round."""
    R, xs, idxs, ws, gouts, opts = case
    got = group_pool.run(fns.guarded_round, R, xs, idxs, ws, gouts, [opts] * R)
    check_reference(got, xs, idxs, ws, gouts, opts)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_inputs_untouched_outputs_unaliased_every_variant(group_pool, transport):
    """The same checks on one case per exchange variant, the MXFP8 payload, and
    non-contiguous inputs (whose whole storages, not only the viewed bytes, must stay)."""
    R, E, H = 3, 6, 32
    xs, idxs, ws, gouts = make_case((5, 0, 7), E, 2, H, seed=11)
    for exchange in EXCHANGES:
        for views in (False, True):
            opts = opts_of(E, transport, exchange, align=2, capacity=3, max_tokens=7,
                           views=views)
            got = group_pool.run(fns.guarded_round, R, xs, idxs, ws, gouts, [opts] * R)
            check_reference(got, xs, idxs, ws, gouts, opts)
    mx = opts_of(E, transport, "auto", payload="mxfp8")
    group_pool.run(fns.guarded_round, R, xs, idxs, ws, gouts, [mx] * R)


@pytest.mark.parametrize("transport,exchange", [("dedup", "auto"), ("pairs", "ragged"),
                                                ("dedup", "lazy"), ("pairs", "static")])
def test_failed_calls_leave_dispatcher_usable(group_pool, transport, exchange):
    """One Dispatcher: a dispatch with a bad index on the middle rank (InputError naming rank 1
    on every rank), then a valid dispatch; two combines with a bad expert_y on the middle rank
    (a row too many, a column too many: InputError naming rank 1 on every rank); then the valid
    combine and backward on the same Dispatch, equal to the reference. The failed calls leave
    their inputs untouched."""
    R, E, H = 3, 6, 4
    xs, idxs, ws, gouts = make_case((4, 3, 5), E, 2, H, seed=5)
    bad = list(zip(idxs, ws))
    b_idx = idxs[1].copy()
    b_idx[1, 0] = E  # out of range, on rank 1 only
    bad[1] = (b_idx, ws[1])
    opts = opts_of(E, transport, exchange, align=2, max_tokens=5)
    got = group_pool.run(fns.failures_then_valid, R, xs, idxs, ws, gouts, bad,
                         [r == 1 for r in range(R)], [opts] * R)
    for r, (errors, _) in enumerate(got):
        assert errors == [(1, int(Reason.INDEX_OUT_OF_RANGE)), (1, int(Reason.EXPERT_Y_ROWS)),
                          (1, int(Reason.EXPERT_Y_HIDDEN))], (r, errors)
    check_reference([res for _, res in got], xs, idxs, ws, gouts, opts)


# ---- item 4: determinism ------------------------------------------------------------------------

@pytest.mark.parametrize("transport,exchange", [("dedup", "auto"), ("pairs", "lazy")])
def test_repeated_calls_bitwise_identical(group_pool, transport, exchange):
    """100 dispatch + combine + backward rounds (through one Dispatcher and through fresh
    ones, alternating): every output and gradient bitwise equal to the first round's."""
    R, E, H = 3, 6, 8
    xs, idxs, ws, gouts = make_case((9, 4, 12), E, 3, H, seed=21)
    opts = opts_of(E, transport, exchange, align=2, capacity=5, y_dtype="bfloat16")
    got = group_pool.run(fns.repeated, R, xs, idxs, ws, gouts, [opts] * R, [100] * R)
    check_reference(got, xs, idxs, ws, gouts, opts)


def test_identical_across_transports_and_exchanges(group_pool):
    """Every (transport, exchange) pair gives the same bits (grad_topk_weights too), and the
    reference's; the equal exchange on a uniform plan likewise."""
    R, E, H = 3, 6, 8
    xs, idxs, ws, gouts = make_case((6, 2, 5), E, 3, H, seed=4, dtype=BF16)
    combos = [(t, e) for t in TRANSPORTS for e in EXCHANGES]
    opts = opts_of(E, align=3, capacity=4, max_tokens=6)
    got = group_pool.run(fns.variants, R, xs, idxs, ws, gouts, [opts] * R, [combos] * R)
    for r in range(R):
        base = got[r][combos[0]]
        for c in combos[1:]:
            same_bits(base, got[r][c], f"rank {r} {c} vs {combos[0]}")
    check_reference([g[combos[0]] for g in got], xs, idxs, ws, gouts, opts)

    # A uniform plan (every rank sends every rank 4 rows): equal == ragged == padded == auto.
    xs = [np.random.default_rng(s).standard_normal((4, H)).astype(np.float32) for s in range(R)]
    idxs = [np.array([[2 * d + t % 2 for d in range(R)] for t in range(4)])] * R
    ws = [np.random.default_rng(9 + s).random((4, R)).astype(np.float32) for s in range(R)]
    gouts = [np.random.default_rng(20 + s).standard_normal((4, H)).astype(np.float32)
             for s in range(R)]
    combos = [(t, e) for t in TRANSPORTS for e in ("equal", "ragged", "padded", "auto")]
    opts = opts_of(E)
    got = group_pool.run(fns.variants, R, xs, idxs, ws, gouts, [opts] * R, [combos] * R)
    for r in range(R):
        for c in combos[1:]:
            same_bits(got[r][combos[0]], got[r][c], f"rank {r} {c} vs {combos[0]}")
    check_reference([g[combos[0]] for g in got], xs, idxs, ws, gouts, opts)


def test_identical_with_one_or_two_threads(group_pool):
    """2048 tokens x hidden 256 per rank (128 grains of 16 rows for at::parallel_for to split):
    torch.set_num_threads(1) and (2) give the same bits, both transports, and the reference's."""
    R, E, H = 2, 8, 256
    xs, idxs, ws, gouts = make_case((2048, 2048), E, 4, H, seed=8)
    for transport in TRANSPORTS:
        opts = opts_of(E, transport, "auto", align=4)
        one = group_pool.run(fns.with_threads, R, xs, idxs, ws, gouts, [opts] * R, [1] * R)
        two = group_pool.run(fns.with_threads, R, xs, idxs, ws, gouts, [opts] * R, [2] * R)
        for r in range(R):
            same_bits(one[r], two[r], f"rank {r} {transport}: 1 vs 2 threads")
    check_reference(one, xs, idxs, ws, gouts, opts, fast=True)


# ---- item 5: edges ------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_zero_tokens_on_every_rank(group_pool, transport):
    R, E, H, K = 3, 6, 4, 2
    xs, idxs, ws, gouts = make_case((0, 0, 0), E, K, H)
    for exchange in EXCHANGES:
        got = run_edge(group_pool, xs, idxs, ws, gouts,
                       opts_of(E, transport, exchange, align=4, max_tokens=0))
        assert all(g["out"].shape == (0, H) and g["grad_x"].shape == (0, H) for g in got)
        assert all(g["tokens_per_expert"].sum() == 0 for g in got)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_expert(group_pool, transport):
    """E == 1 (a group of one rank), and one expert per rank with every token on expert 0."""
    xs, idxs, ws, gouts = make_case((7,), 1, 1, 4, seed=1)
    run_edge(group_pool, xs, idxs, ws, gouts, opts_of(1, transport, align=3))
    xs, idxs, ws, gouts = make_case((5, 3), 2, 1, 4, seed=2, unused=0)
    idxs = [np.zeros_like(i) for i in idxs]
    run_edge(group_pool, xs, idxs, ws, gouts, opts_of(2, transport, "auto", capacity=6))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_k_equals_e(group_pool, transport):
    """Every token to every expert (rows in shuffled expert order), and with unused slots."""
    R, E, H = 2, 4, 8
    for unused in (0.0, 0.3):
        xs, idxs, ws, gouts = make_case((6, 4), E, E, H, seed=3, unused=unused)
        run_edge(group_pool, xs, idxs, ws, gouts, opts_of(E, transport, "auto", align=2))


@pytest.mark.parametrize("H,dtype", [(1, np.float32), (1, BF16), (16384, np.float32),
                                     (16384, BF16)])
def test_hidden_extremes(group_pool, H, dtype):
    R, E = 2, 4
    xs, idxs, ws, gouts = make_case((6, 3), E, 2, H, seed=H, dtype=dtype)
    for transport in TRANSPORTS:
        run_edge(group_pool, xs, idxs, ws, gouts, opts_of(E, transport, "auto", align=2),
                 fast=H > 1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_tokens_on_one_rank(group_pool, transport):
    """65536 tokens on rank 0 and none on rank 1 (hidden 2 to keep it small)."""
    R, E, H = 2, 4, 2
    xs, idxs, ws, gouts = make_case((65536, 0), E, 2, H, seed=6)
    got = run_edge(group_pool, xs, idxs, ws, gouts,
                   opts_of(E, transport, "auto", capacity=20000), fast=True)
    assert got[1]["out"].shape == (0, H)
    assert all(g["dropped_per_expert"].sum() > 0 for g in got)  # the capacity bit everywhere


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int16, np.int8])
def test_narrow_index_dtypes(group_pool, idx_dtype):
    """int32 (and int16, int8) topk_idx: the same bits as int64."""
    R, E, H = 3, 6, 4
    xs, idxs, ws, gouts = make_case((5, 2, 6), E, 3, H, seed=12, idx_dtype=idx_dtype)
    got = run_edge(group_pool, xs, idxs, ws, gouts, opts_of(E, "dedup", "auto", capacity=4))
    wide = run_edge(group_pool, xs, [i.astype(np.int64) for i in idxs], ws, gouts,
                    opts_of(E, "dedup", "auto", capacity=4))
    for r in range(R):
        same_bits(wide[r], got[r], f"rank {r} {idx_dtype.__name__} vs int64")


@pytest.mark.parametrize("transport,exchange", [("dedup", "ragged"), ("pairs", "padded"),
                                                ("dedup", "lazy"), ("pairs", "static")])
def test_non_contiguous_inputs(group_pool, transport, exchange):
    """x, topk_weights, expert_y, grad_out column-major (transposed views), topk_idx every other
    column of a wider tensor; and x expanded from one row (stride 0): the same bits as the
    contiguous copies (whose answer the reference gives)."""
    R, E, H = 3, 6, 8
    xs, idxs, ws, gouts = make_case((6, 5, 4), E, 2, H, seed=13)
    opts = opts_of(E, transport, exchange, align=2, capacity=5, y_dtype="bfloat16",
                   max_tokens=6)
    flat = run_edge(group_pool, xs, idxs, ws, gouts, opts)
    strided = run_edge(group_pool, xs, idxs, ws, gouts, dict(opts, views=True))
    for r in range(R):
        same_bits(flat[r], strided[r], f"rank {r} views vs contiguous")
    same_rows = [np.repeat(x[:1], len(x), 0) for x in xs]
    run_edge(group_pool, same_rows, idxs, ws, gouts, dict(opts, expand_x=True))


def test_non_contiguous_mxfp8(group_pool):
    """The MXFP8 payload quantizes non-contiguous x to the same bits as its contiguous copy."""
    R, E, H = 2, 4, 64
    xs, idxs, ws, gouts = make_case((5, 3), E, 2, H, seed=14)
    opts = opts_of(E, "dedup", "auto", payload="mxfp8")
    flat = group_pool.run(fns.edge_round, R, xs, idxs, ws, gouts, [opts] * R)
    strided = group_pool.run(fns.edge_round, R, xs, idxs, ws, gouts, [dict(opts, views=True)] * R)
    want = ref.dispatch(xs, idxs, ws, num_experts=E, payload="mxfp8")
    for r in range(R):
        same_bits(flat[r], strided[r], f"rank {r} mxfp8 views vs contiguous")
        assert_bitwise("q", strided[r]["expert_x"], want[r].expert_x.view(np.uint8), r)
        assert_bitwise("scale", strided[r]["scale"], want[r].expert_scale, r)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_workspace_reuse_is_invisible(group_pool, transport, exchange):
    """A Dispatcher's workspace (production/workspace.py): forward A, forward B, backward A,
    backward B through one Dispatcher equal a workspace-free Dispatcher's steps bit for bit (and the
    reference); no output, gradient or saved tensor shares a byte with a workspace buffer;
    release() empties it and the next step agrees."""
    R, E, H = 3, 6, 8
    xs, idxs, ws, gouts = make_case((6, 4, 9), E, 3, H, seed=17, dtype=BF16)
    opts = opts_of(E, transport, exchange, align=2, capacity=4, max_tokens=9,
                   y_dtype="bfloat16")
    got = group_pool.run(fns.workspace_rounds, R, xs, idxs, ws, gouts, [opts] * R)
    check_reference(got, xs, idxs, ws, gouts, opts)
