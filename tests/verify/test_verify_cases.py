"""Cases and strategies: deterministic inputs, valid draws for every mode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from epkit.verify.adapters import epkit_modes
from epkit.verify.cases import Case, ModeSpec, valid_rows
from epkit.verify.cases import SEQUENCES
from epkit.verify.strategies import MANY_TOKENS, cases

MODES = {m.name: m for m in epkit_modes()}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def test_inputs_are_deterministic_and_repr_replays():
    c = Case(world_size=2, num_experts=4, topk=3, hidden=9, tokens=(5, 0), dtype="bfloat16",
             routing="grouped", capacity=2, seed=7)
    a, b = c.all_inputs(), eval(repr(c)).all_inputs()  # noqa: S307 - the reproducer contract
    for xa, xb in zip(a, b):
        assert [_bits(v) for v in xa] == [_bits(v) for v in xb]
    assert eval(repr(c)) == c  # noqa: S307
    assert "replay(" in c.snippet("m:f", "default")


def _check_routing(c: Case):
    xs, idx, ws = c.all_inputs()
    assert len(xs) == c.world_size
    for r in range(c.world_size):
        T = c.tokens[r]
        assert xs[r].shape == (T, c.hidden) and str(xs[r].dtype) == c.dtype
        assert idx[r].shape == (T, c.topk) and idx[r].dtype == np.dtype(c.idx_dtype)
        assert ws[r].shape == (T, c.topk) and ws[r].dtype == np.float32
        assert np.isfinite(ws[r]).all()
        assert c.specials or np.isfinite(xs[r].astype(np.float32)).all()
        assert c.payload is None or np.isfinite(xs[r].astype(np.float32)).all()
        assert ((idx[r] >= -1) & (idx[r] < c.num_experts)).all()
        for row in idx[r]:
            used = row[row >= 0]
            assert len(set(used.tolist())) == len(used), "an expert twice in a row"
        assert T <= c.max_tokens


@FAST
@given(cases(4))
def test_drawn_cases_are_valid(c):
    _check_routing(c)
    assert c.num_experts % c.world_size == 0 and 1 <= c.world_size <= 4
    if c.payload is not None:
        assert c.hidden % {"mxfp8": 32, "fp8_block128": 128}[c.payload] == 0


@FAST
@given(cases(3, MODES["dedup/equal"]))
def test_equal_mode_draws_uniform_plans(c):
    _check_routing(c)
    assert c.capacity is None and len(set(c.tokens)) == 1
    R, L = c.world_size, c.local_experts
    _, idx, _ = c.all_inputs()
    slots, tokens = np.zeros((R, R), int), np.zeros((R, R), int)
    for s in range(R):
        for row in idx[s]:
            ranks = row[row >= 0] // L
            slots[s] += np.bincount(ranks, minlength=R)
            tokens[s] += np.bincount(np.unique(ranks), minlength=R)
    assert len(np.unique(slots)) == 1 and len(np.unique(tokens)) == 1


@FAST
@given(cases(2, MODES["pairs/static/mxfp8"], max_tokens=10))
def test_static_mxfp8_mode_bounds_tokens_and_hidden(c):
    _check_routing(c)
    assert c.hidden % 32 == 0 and c.payload == "mxfp8" and max(c.tokens) <= c.max_tokens
    assert c.max_tokens in (10, MANY_TOKENS)
    assert MODES["pairs/static/mxfp8"].factory_kwargs(c)["max_tokens_per_rank"] == c.max_tokens


@FAST
@given(cases(2, MODES["dedup/lazy/fp8_block128"], max_tokens=10))
def test_fp8_block128_mode_draws_whole_blocks(c):
    _check_routing(c)
    assert c.hidden in (128, 256) and c.payload == "fp8_block128"


def test_expert_rows_put_nan_only_in_padding():
    c = Case(world_size=1, num_experts=2, topk=1, hidden=4, tokens=(3,), nan_padding=True)
    valid = valid_rows([1, 2], [0, 2, 4], 4)
    assert valid.tolist() == [True, False, True, True]
    y = c.expert_rows(0, 1, valid, "bfloat16")
    assert np.isnan(y[1].astype(np.float32)).all()
    assert np.isfinite(y[valid].astype(np.float32)).all()


def test_valid_rows_tolerates_a_malformed_layout():
    assert valid_rows([5, -3], [0, 9], 4).tolist() == [True] * 4
    assert valid_rows([], [], 2).tolist() == [False, False]


def test_mode_names_cover_every_knob():
    names = set(MODES)
    assert len(names) == 2 * 6 * 3 + 4  # pairs, dedup: every knob; hier: four exchanges
    assert {"dedup/ragged", "pairs/lazy", "dedup/static/mxfp8", "pairs/ragged/fp8_block128",
            "dedup/static/fp8_block128", "hier/padded"} <= names
    assert MODES["pairs/padded/fp8_block128"].payload == "fp8_block128"
    assert not {"hier/lazy", "hier/static", "hier/auto/mxfp8"} & names
    assert MODES["dedup/static"].static and MODES["pairs/equal"].uniform
    assert ModeSpec().factory_kwargs() == {}


def test_nodes_modes_pass_ranks_per_node():
    """Every epkit mode draws ranks_per_node and hands it to the factory (explicitly, so that a
    LOCAL_WORLD_SIZE never makes epkit's default differ from the reference's)."""
    assert all(m.nodes for m in MODES.values())
    case = Case(world_size=4, num_experts=4, topk=1, hidden=1, tokens=(1,) * 4, ranks_per_node=2)
    assert MODES["hier/ragged"].factory_kwargs(case)["ranks_per_node"] == 2
    assert "ranks_per_node" not in ModeSpec().factory_kwargs(case)
    with pytest.raises(ValueError):
        case.replace(ranks_per_node=3)


# -- capabilities and wide top-k ----------------------------------------------------------------
from epkit.verify.capabilities import Capabilities, parse_supports, resolve_capabilities  # noqa: E402

NARROW = Capabilities(**parse_supports(["capacity=no", "align=1,4", "unused_slots=no",
                                        "mixed_dtypes=no", "unweighted=no",
                                        "index_dtypes=int32", "max_topk=5",
                                        "zero_token_ranks=no"]))


@FAST
@given(cases(3, capabilities=NARROW))
def test_draws_stay_inside_declared_capabilities(c):
    _check_routing(c)
    assert c.capacity is None and c.align in (1, 4) and c.y_dtype == c.dtype
    assert c.weighted and c.idx_dtype == "int32" and c.topk <= 5 and min(c.tokens) >= 1
    _, idx, _ = c.all_inputs()
    assert all((i >= 0).all() for i in idx), c


def _draws(mode, n=300, seed=20, **kw):
    from hypothesis import Phase
    from hypothesis import seed as hseed

    seen = []

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases(4, mode, **kw))
    def draw(c):
        seen.append(c)

    draw()
    return seen


@pytest.mark.parametrize("name", ["dedup/ragged", "pairs/static"])
def test_random_draws_reach_every_regime(name):
    """K over 1..255 (every power-of-two bucket), tokens in the hundreds now and then,
    special values and weights, and a balanced mix of dtypes and weighted / unweighted."""
    seen = _draws(MODES[name])
    n = len(seen)
    buckets = {c.topk.bit_length() - 1 for c in seen}
    assert buckets == set(range(8)), sorted(buckets)
    assert max(c.topk for c in seen) <= 255 and max(c.num_experts for c in seen) <= 512
    assert any(9 <= c.topk <= 128 for c in seen)
    many = [c for c in seen if max(c.tokens) > 64]
    assert len(many) >= n // 30 and max(max(c.tokens) for c in many) <= MANY_TOKENS
    for share, what in ((sum(c.dtype == "bfloat16" for c in seen) / n, "bfloat16"),
                        (sum(c.weighted for c in seen) / n, "weighted")):
        assert 0.35 <= share <= 0.65, (what, share)
    assert sum(c.specials for c in seen) >= n // 6
    assert sum(c.special_weights for c in seen) >= n // 12
    # float16 a quarter, the calls' orders three to one, one in eight with its twin
    assert 0.12 <= sum(c.dtype == "float16" for c in seen) / n <= 0.38
    assert 0.12 <= sum(c.order == "stages" for c in seen) / n <= 0.38
    assert {c.sequence for c in seen} == set(SEQUENCES)
    assert n // 20 <= sum(c.sequence != "single" for c in seen) <= n // 4
    assert all(c.order == "training" for c in seen if c.sequence.startswith("overlap"))
    for c in [c for c in seen if c.topk > 8][:3] + many[:2]:
        _check_routing(c)


def test_special_values_sit_in_real_rows():
    c = Case(world_size=2, num_experts=4, topk=2, hidden=16, tokens=(40, 30), specials=True,
             special_weights=True, seed=3)
    xs, _, ws = c.all_inputs()
    x = np.concatenate(xs).astype(np.float32)
    w = np.concatenate(ws)
    assert np.isnan(x).any() and np.isposinf(x).any() and np.isneginf(x).any()
    tiny = (x != 0) & (np.abs(x) < 2.0**-126)
    assert tiny.any() and (np.signbit(x) & (x == 0)).any()
    assert (w == 1).any() and ((w == 0) & ~np.signbit(w)).any() and ((w == 0) & np.signbit(w)).any()
    quantized = c.replace(payload="mxfp8", hidden=32)
    assert all(np.isfinite(x.astype(np.float32)).all() for x in quantized.all_inputs()[0])


def test_invalid_draws_make_the_reference_raise():
    import epkit.reference as ref
    from epkit.verify.cases import VIOLATIONS

    seen = _draws(MODES["dedup/ragged"], n=200, check_errors=True)
    kinds = {c.violation for c in seen if c.violation}
    assert len(kinds) >= len(VIOLATIONS) - 3, kinds  # every kind: the corner matrix
    for c in [c for c in seen if c.violation][:25]:
        xs, idx, ws = c.all_inputs()
        with pytest.raises(ValueError):
            ref.dispatch(xs, idx, ws, num_experts=c.num_experts, align=c.align,
                         capacity=c.capacity, payload=c.payload)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_the_corner_matrix_covers_every_combination(world):
    from epkit.verify.strategies import PEER_ROWS, corner_cases

    corners = corner_cases(world, MODES["dedup/ragged"], check_errors=True)
    plain = [c for c in corners if c.violation is None and max(c.tokens) < 32]
    combos = {(c.world_size, c.dtype, c.weighted) for c in plain
              if 0 in c.tokens or c.world_size == 1}
    assert combos == {(R, d, w) for R in range(1, min(world, 4) + 1)
                      for d in ("float32", "bfloat16", "float16") for w in (True, False)}
    if world >= 2:
        assert any(c.topk == 1 for c in plain) and any(c.topk == c.num_experts for c in plain)
        assert any(c.unused_pct == 100 for c in plain) and any(c.routing == "hot" for c in plain)
    assert any(c.specials for c in plain) and any(c.special_weights for c in plain)
    assert any(c.topk == c.num_experts > 16 for c in plain)  # every slot past 16 used
    assert any(c.topk == 255 for c in plain)
    big = [c for c in corners if max(c.tokens) >= 32 and c.routing != "every"]
    if world > 1:
        for rows in PEER_ROWS:  # some rank sends some peer more than `rows` rows
            assert any(_max_peer_rows(c) > rows for c in big), rows
    from epkit.verify.cases import VIOLATIONS

    single = {"topk_differs", "hidden_differs", "dtype_differs", "experts_not_divisible"}
    assert sorted(c.violation for c in corners if c.violation) == sorted(
        v for v in VIOLATIONS if world > 1 or v not in single)
    for c in plain + big:
        _check_routing(c)


def _max_peer_rows(c):
    _, idx, _ = c.all_inputs()
    L = c.local_experts
    return max(int(np.bincount(i[i >= 0] // L, minlength=c.world_size).max()) for i in idx)


def test_supports_parse_and_layer():
    assert parse_supports(["align=any", "max_topk=16"]) == {"align": "any", "max_topk": 16}
    for bad in (["capacity=maybe"], ["nonsense=1"], ["align=0"], ["capacity"]):
        with pytest.raises(ValueError):
            parse_supports(bad)

    def factory(group):
        return None

    factory.capabilities = {"capacity": False, "align": 1}
    mode = ModeSpec("m", capabilities={"align": "1,2"})
    caps = resolve_capabilities(factory, mode, ["capacity=yes"])
    assert caps.capacity is True and caps.aligns() == (1, 2)
    assert caps.declared("capacity") and not caps.declared("unused_slots")


def test_slot_rows_follow_the_slot_not_the_position():
    c = Case(world_size=2, num_experts=2, topk=2, hidden=3, tokens=(2, 1), nan_padding=True)
    src = np.array([[0, 1, 0], [-1, -1, -1], [1, 0, 1]])
    a = c.slot_rows(0, 1, src, "float32")
    b = c.slot_rows(1, 1, src[::-1], "float32")
    assert _bits(a[0]) == _bits(b[2]) and _bits(a[2]) == _bits(b[0])
    assert np.isnan(a[1]).all() and np.isfinite(a[[0, 2]]).all()


def test_refusal_hints_match_what_was_refused_and_never_contradict():
    from epkit.verify.capabilities import declarations

    c = Case(world_size=1, num_experts=2, topk=1, hidden=1, tokens=(1,), idx_dtype="int32")
    assert declarations({"capacity": [c], "index_dtypes": [c]}) == [
        "capacity=no", "index_dtypes=int64"]
    # weighted and unweighted both refused on some draws: neither is suggested
    assert declarations({"weighted": [c], "unweighted": [c.replace(weighted=False)]}) == []
    # both index dtypes refused: no single declaration fits
    assert declarations({"index_dtypes": [c, c.replace(idx_dtype="int64")]}) == []
    assert declarations({"max_topk": [c], "align": [c]}) == ["align=1", "max_topk=8"]


@pytest.mark.parametrize("mode", ["dedup/equal", "dedup/ragged"])
def test_corner_cases_stay_inside_declared_capabilities(mode):
    from epkit.verify.strategies import corner_cases

    for c in corner_cases(4, MODES[mode], NARROW):
        _check_routing(c)
        assert c.capacity is None and c.align in (1, 4) and c.y_dtype == c.dtype
        assert c.weighted and c.idx_dtype == "int32" and c.topk <= 5 and min(c.tokens) >= 1
        assert all((i >= 0).all() for i in c.all_inputs()[1]), c


def test_a_twin_has_the_shapes_and_a_fresh_routing():
    c = Case(world_size=2, num_experts=8, topk=3, hidden=5, tokens=(7, 4), seed=9,
             sequence="overlap")
    t = c.twin()
    assert t.sequence == "single" and t.replace(seed=c.seed, sequence=c.sequence) == c
    (x0, i0, _), (x1, i1, _) = c.inputs(0), t.inputs(0)
    assert x0.shape == x1.shape and i0.shape == i1.shape and not (i0 == i1).all()
    for bad in (dict(sequence="overlap", order="stages"), dict(order="backwards"),
                dict(sequence="twice")):
        with pytest.raises(ValueError):
            c.replace(**bad)
