"""Host reads of device memory on epkit's GPU code path, counted on this machine.

The workers run ``EPKIT_KERNELS=triton``: the Triton kernels, interpreted, stand in for the
GPU's, and epkit's Python takes the device path (``epkit.device.device_path``), where every
host read of would-be device memory is counted (``epkit.device.count_host_reads``). The design
(docs/design.md, "Host reads"): an eager dispatch reads once (the plan's mirror; hier's
counts with it), dedup with a capacity factor and drops twice; combine, both backward
passes and the static exchange never. Host-to-device copies count as waits too (none is made:
hier's forwarder makes its source table on the device). The reads the kernels make themselves
(modules under ``epkit/triton/``) are theirs to answer for and are left out here; ``python
tests/production/host_read_fns.py`` prints them with the rest.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import host_read_fns as fns
from group import started_with_kernels


@pytest.fixture(scope="module")
def triton_pool():
    """Two gloo workers spawned with EPKIT_KERNELS=triton (read when epkit loads its kernels,
    so it must be in their environment before they import epkit)."""
    pool = started_with_kernels("triton", 2, 120)
    yield pool
    pool.close()


def above_kernels(reads) -> dict:
    """``{operation: count}`` of the reads epkit's Python makes (not the kernels')."""
    out: dict = {}
    for op, kind, where in reads:
        if not where.startswith("triton/"):
            out[op] = out.get(op, 0) + 1
    return out


def assert_reads(reads, dispatch: dict, what):
    assert above_kernels(reads["dispatch"]) == dispatch, (what, reads["dispatch"])
    assert above_kernels(reads["combine"]) == {}, (what, reads["combine"])
    assert above_kernels(reads["backward"]) == {}, (what, reads["backward"])


def same_bits(a: dict, b: dict, what):
    for name in a:
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), (what, name)


def test_counter_catches_a_planted_read(triton_pool):
    """A ``.item()`` planted inside combine's op and an ``int()`` of a dispatch output are
    counted, attributed to their operation; a read of the plan's host mirror is not."""
    for in_op, in_caller, mirror in triton_pool.run(fns.planted_read, 2):
        assert ("combine_tokens", "item") in in_op
        assert in_caller == [("other", "int")]
        assert mirror == 0


def test_device_path_predicate(triton_pool):
    """Dispatch outputs and the plan are device memory on the interpreted path; the plan's
    mirror and its views are host memory."""
    for got in triton_pool.run(fns.paths, 2):
        assert got == (True, True, False, False)


@pytest.mark.parametrize("transport", ["pairs", "dedup", "hier"])
def test_reads_per_exchange_and_payload(triton_pool, transport):
    """Every exchange, and each payload under every kind of exchange (eager, lazy, static): the
    eager dispatch reads once, the static one never (check_static, asked for,
    once); combine and both backward passes never. The results agree bit for bit across
    exchanges (the uniform routing of ``equal`` apart)."""
    results = triton_pool.run(fns.matrix, 2, [transport] * 2, ["bfloat16"] * 2)
    # hier: the plan with its hier counts in one read, no host-to-device copy (docs/design.md)
    eager = {"count_exchange": 1}
    for rank_results in results:
        first = {}
        for exchange, payload, reads, bits in rank_results:
            what = (transport, exchange, payload)
            assert_reads(reads, {} if exchange == "static" else eager, what)
            if exchange == "static":
                assert above_kernels(reads["check_static"]) == {"check_static": 1}, what
            key = (payload, exchange == "equal")
            if key in first:
                same_bits(first[key], bits, what)
            first.setdefault(key, bits)


def test_transports_agree_on_the_device_path(triton_pool):
    """pairs, dedup and hier give the same bits (combine, both gradients) on the device path."""
    for pairs, dedup, hier in triton_pool.run(fns.transports_agree, 2):
        same_bits(pairs, dedup, "pairs vs dedup")
        same_bits(dedup, hier, "dedup vs hier")


def test_reads_with_capacity(triton_pool):
    """Capacity drops: an eager dispatch reads once (dedup gathers its token rows before the
    read; hier's counts ride on it), a capacity factor once (the gathered counts; dedup with
    drops once more, hier's counts riding on that), static never; combine and backward never.
    hier's results are dedup's, bit for bit."""
    want = {("pairs", "capacity"): 1, ("pairs", "factor"): 1, ("pairs", "capacity static"): 0,
            ("dedup", "capacity"): 1, ("dedup", "factor"): 2, ("dedup", "capacity static"): 0,
            ("hier", "capacity"): 1, ("hier", "factor"): 2}
    bits_of = {}
    for transport in ("pairs", "dedup", "hier"):
        for rank, rank_results in enumerate(triton_pool.run(fns.capacity_cases, 2,
                                                            [transport] * 2)):
            for name, reads, bits in rank_results:
                n = want[(transport, name)]
                assert_reads(reads, {"count_exchange": n} if n else {}, (transport, name))
                bits_of[(transport, name, rank)] = bits
    for name in ("capacity", "factor"):
        for rank in range(2):
            same_bits(bits_of[("dedup", name, rank)], bits_of[("hier", name, rank)],
                      ("hier", name))


def test_header_on_the_device_is_a_read_per_call(triton_pool):
    """Where the call header lives on the device (an NCCL-only group), every call reads it
    once more: dispatch, combine, and each backward pass."""
    for reads in triton_pool.run(fns.nccl_only_headers, 2):
        assert above_kernels(reads["dispatch"]) == {"call header": 1, "count_exchange": 1}
        assert above_kernels(reads["combine"]) == {"call header": 1}
        assert above_kernels(reads["backward"]) == {"call header": 2}


def test_nccl_only_group_warns_once(monkeypatch):
    """A group without a CPU backend makes every call header a host wait: said once."""
    from epkit import collectives

    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(collectives, "_WARNED_NCCL_ONLY", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert collectives.small_device(None) == torch.device("cuda", 0)
    said = [w for w in caught if "no CPU backend" in str(w.message)]
    assert len(said) == 1
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert collectives.small_device(None) == torch.device("cpu")


def test_hier_bad_routing_raises_on_every_rank(triton_pool):
    """hier's counts ride on the plan's read, so they are made before the group's error is
    known: a routing out of range on one rank still raises the plan's InputError on every rank
    (and crashes nothing), with and without a capacity."""
    got = triton_pool.run(fns.hier_bad_routing, 2)
    for per_rank in got:
        assert len(per_rank) == 4 and all(m is not None and "rank 1" in m for m in per_rank), got
    assert got[0] == got[1]
