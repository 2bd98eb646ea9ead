"""epkit.DispatchOptions: the eight options in one frozen record, the Dispatcher's and the
layer's, in step with the public keyword arguments."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import epkit
import rank_fns
from epkit.options import OPTION_NAMES


def test_defaults_and_none_resolve_as_in_the_reference():
    from epkit.reference.records import resolve_options

    o = epkit.DispatchOptions(transport=None, exchange=None)
    assert (o.transport, o.exchange) == resolve_options("dedup", None) == ("dedup", "auto")
    assert o == epkit.DispatchOptions()
    assert o.replace(exchange="lazy").exchange == "lazy" and o.exchange == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.align = 4  # noqa: the refusal is the point


def test_the_record_has_every_public_keyword_and_nothing_else():
    """Dispatcher, epkit.dispatch and ExpertParallelMoE keep their keyword arguments; the record
    holds exactly the dispatch options among them (so a new option is added to all four)."""
    def keywords(fn, skip):
        return {p for p in inspect.signature(fn).parameters if p not in skip}

    assert keywords(epkit.Dispatcher.__init__, {"self", "group", "num_experts", "workspace"}) \
        == set(OPTION_NAMES)
    assert keywords(epkit.dispatch, {"x", "topk_idx", "topk_weights", "num_experts", "group"}) \
        == set(OPTION_NAMES)
    assert set(OPTION_NAMES) <= keywords(epkit.nn.ExpertParallelMoE.__init__, set())
    assert tuple(epkit.DispatchOptions().as_dict()) == OPTION_NAMES


def test_a_dispatcher_carries_its_options(group_pool):
    """Keywords and from_options give the same record and the same dispatch, bit for bit; the
    Dispatcher's option attributes are the record's, read-only."""
    for got in group_pool.run(rank_fns.options_round_trip, 2):
        assert got == "ok", got
