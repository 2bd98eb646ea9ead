"""The exchange variants as a table, and the lazy schedule, in the reference."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import importlib

# the module, not the function epkit.reference.exchange that shadows its name
ex = importlib.import_module("epkit.reference.exchange")


@st.composite
def plans(draw):
    R = draw(st.integers(1, 4))
    B = draw(st.integers(1, 12))
    counts = np.array(draw(st.lists(st.lists(st.integers(0, 5), min_size=R, max_size=R),
                                    min_size=R, max_size=R)), np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    bufs = [rng.integers(0, 256, (int(counts[s].sum()), B), dtype=np.uint8) for s in range(R)]
    return bufs, counts


@settings(max_examples=60, deadline=None)
@given(plans(), st.sampled_from(["ragged", "padded", "static", "auto"]))
def test_every_variant_moves_the_ragged_result_and_the_bytes_it_says(plan, name):
    bufs, counts = plan
    cap = int(counts.max(initial=0)) + 1
    want, _ = ex.exchange_rows(bufs, counts, "ragged")
    got, moved = ex.exchange_rows(bufs, counts, name, cap)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # the variant's byte count without moving equals what its move reported
    assert np.array_equal(moved, ex.exchange_bytes(counts, bufs[0].shape[1], name, cap))


def test_the_table_names_every_variant_an_option_may_name():
    assert set(ex.NAMES) == set(ex.VARIANTS) | {"auto"}
    assert all(v.name == k for k, v in ex.VARIANTS.items())
    assert all(o.name == k for k, o in ex.OPTIONS.items())
    # the codes are abi.py's: one row per code, no name typed twice
    from epkit.reference import abi

    assert {v.code for v in ex.VARIANTS.values()} == set(abi.VARIANT_CODES.values())
    assert {o.code for o in ex.OPTIONS.values()} == set(abi.EXCHANGE_CODES.values())


def test_lazy_is_the_auto_variant_on_the_lazy_schedule():
    assert ex.split_option("lazy") == ("auto", "lazy")
    assert ex.split_option("padded") == ("padded", "eager")
    xs = [np.arange(6, dtype=np.float32).reshape(3, 2), np.arange(2, dtype=np.float32).reshape(1, 2)]
    counts = [[1, 2], [0, 1]]
    pending = ex.issue(xs, counts, "padded")
    first = pending.wait()
    want = ex.exchange(xs, counts, "padded")
    assert all(np.array_equal(a, b) for a, b in zip(first, want))
    assert pending.wait() is first  # once


def test_a_dispatch_asked_for_lazy_runs_its_eager_twin_auto():
    """Every name the ABI codes is an option (validate.option_triple, both tiers): ``"lazy"``
    changes when the exchange runs, not what moves, so the reference runs ``"auto"``."""
    from epkit import reference as ref

    def eager(name):
        return ex.split_option(name)[0]

    assert eager("lazy") == "auto" and eager("static") == "static"
    assert eager(None) is None and eager("nope") == "nope"
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2)]
    idx = [np.array([[0, 3], [1, -1], [2, 0]])] * 2
    ws = [rng.random((3, 2)).astype(np.float32) for _ in range(2)]
    for transport in ("pairs", "dedup"):
        lazy = ref.dispatch(xs, idx, ws, num_experts=4, transport=transport, exchange="lazy")
        auto = ref.dispatch(xs, idx, ws, num_experts=4, transport=transport, exchange="auto")
        for a, b in zip(lazy, auto):
            assert np.array_equal(a.expert_x, b.expert_x)
            assert a.group.exchange == b.group.exchange == "auto"


def test_static_overflow_is_an_input_error_in_move_and_bytes():
    from epkit.reference.errors import InputError, Reason

    bufs = [np.zeros((3, 4), np.uint8), np.zeros((0, 4), np.uint8)]
    counts = np.array([[0, 3], [0, 0]])
    for fn in (lambda: ex.exchange_rows(bufs, counts, "static", 2),
               lambda: ex.exchange_bytes(counts, 4, "static", 2)):
        with pytest.raises(InputError) as e:
            fn()
        assert e.value.code == Reason.STATIC_OVERFLOW and e.value.rank == 0


def test_the_transport_table_covers_every_transport_with_the_three_passes():
    from epkit.reference import records, transports

    assert set(transports.TABLE) == set(records.TRANSPORTS)
    for name, transport in transports.TABLE.items():
        assert isinstance(transport, transports.Transport) and transport.name == name
        for fn in ("wire_plan", "dispatch", "reduce_back", "combine_backward",
                   "dispatch_bytes_of", "combine_bytes_of"):
            method = getattr(type(transport), fn)
            assert method is not getattr(transports.Transport, fn), (name, fn)  # its own body
