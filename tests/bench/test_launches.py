"""What one training step issues on the device path (``epkit bench --launches``), counted here
without a GPU: the ops are the ones CUDA would run (``EPKIT_KERNELS=triton``, interpreted).

Budgets (docs/design.md, "Launch budget"; ``bench_launches.BUDGET``): the counts must not depend
on the data sizes or the world size, host waits are 1 / 0 / 0 (static 0 / 0 / 0) with
host-to-device copies counted, and the kernel and collective counts stay at or under
:data:`CEILING`: what the device path issues today, a ratchet that only goes down as the
bookkeeping moves into kernels, until it meets the budget (the budget table is printed by
``epkit bench --launches`` with what each mode still misses).
"""

from __future__ import annotations

import pytest
import torch

from epkit.launches import DELEGATES, LAUNCH_FREE, count_launches
from epkit.tools import bench_launches as bl

SIZES = ((64, 128, 8, 2), (96, 256, 16, 4))
# mode -> (dispatch, combine, backward kernels, collectives a step), the most any world size
# and size issues as of this commit (world sizes 2 and 4). Lower these when a change lowers
# the counts; the goal is bench_launches.budget(mode).
CEILING = {
    "dedup/auto": (28, 3, 11, 10),
    "dedup/static": (27, 3, 11, 10),
    "pairs/auto": (16, 2, 10, 10),
    "pairs/static": (15, 2, 10, 10),
    "hier/auto": (155, 65, 88, 18),
    "dedup/auto/mxfp8": (30, 3, 11, 10),
    "pairs/static/fp8_block128": (17, 2, 10, 10),
}


# One worker runs this module (--dist loadgroup, pyproject.toml): its module fixture is
# costly, and under xdist every worker that took one of its tests would build it again.
pytestmark = pytest.mark.xdist_group("launches")


@pytest.fixture(scope="module")
def counted():
    """``{world size: {size: {mode: {phase: counts}}}}`` at world sizes 2 and 4."""
    return {world: bl.measure(world, sizes=SIZES, deadline_s=600) for world in (2, 4)}


def _each(counted):
    for world, result in counted.items():
        for size, modes in result.items():
            for mode, c in modes.items():
                yield world, size, mode, c


def test_counts_do_not_depend_on_the_sizes(counted):
    for world, result in counted.items():
        (a, first), (b, second) = result.items()
        for mode in bl.MODES:
            for phase in bl.PHASES:
                x, y = first[mode][phase], second[mode][phase]
                assert (x["kernels"], x["collectives"]) == (y["kernels"], y["collectives"]), (
                    world, mode, phase, a, b)
                # the counter sees inside epkit's ops: the Triton launches and the exchanges
                assert x["triton"] > 0 and x["collectives"] > 0, (world, mode, phase, x)


def test_counts_do_not_depend_on_the_world_size(counted):
    """The one-stage transports issue the same at world sizes 2 and 4 (hier's stages depend on
    its node count)."""
    for size in counted[2]:
        for mode in bl.MODES:
            if mode.startswith("hier"):
                continue
            for phase in bl.PHASES:
                a, b = counted[2][size][mode][phase], counted[4][size][mode][phase]
                assert (a["kernels"], a["collectives"]) == (b["kernels"], b["collectives"]), (
                    size, mode, phase)


def test_host_waits_meet_the_budget(counted):
    for world, size, mode, c in _each(counted):
        waits = tuple(c[p]["host_waits"] for p in bl.PHASES)
        assert waits == bl.budget(mode)["host_waits"], (
            world, size, mode, [c[p]["waits"] for p in bl.PHASES])


def test_kernels_and_collectives_within_the_ceiling(counted):
    for world, size, mode, c in _each(counted):
        got = tuple(c[p]["kernels"] for p in bl.PHASES) + (
            sum(c[p]["collectives"] for p in bl.PHASES),)
        assert all(g <= m for g, m in zip(got, CEILING[mode])), (world, size, mode, got)


def test_combine_and_backward_meet_the_budget(counted):
    """What already meets docs/design.md's budget stays within it: combine and both backward
    passes for every one-stage transport, exchange and payload."""
    for world, size, mode, c in _each(counted):
        b = bl.budget(mode)
        if not mode.startswith("hier"):
            assert c["combine"]["kernels"] <= b["combine"], (world, size, mode)
            assert c["backward"]["kernels"] <= b["backward"], (world, size, mode)


def test_a_quantized_payload_adds_at_most_its_two_launches(counted):
    """A quantized payload's dispatch issues at most bench_launches.PAYLOAD_EXTRA launches more
    than the same transport and exchange without one (its wire rows made and split: one
    launch each way), and no more in combine or the backward passes."""
    quantized = [m for m in bl.MODES if len(m.split("/")) > 2]
    assert quantized
    for world, size, mode, c in _each(counted):
        if mode not in quantized:
            continue
        plain = counted[world][size]["/".join(mode.split("/")[:2])]
        assert c["dispatch"]["kernels"] - plain["dispatch"]["kernels"] <= bl.PAYLOAD_EXTRA, \
            (world, size, mode)
        for phase in ("combine", "backward"):
            assert c[phase]["kernels"] <= plain[phase]["kernels"], (world, size, mode, phase)


def test_the_table_names_what_misses_the_budget(counted):
    result = counted[2]
    table = bl.format_table(result)
    for mode in bl.MODES:
        assert mode in table
    c = next(iter(result.values()))["pairs/auto"]
    assert set(bl.over_budget("pairs/auto", c)) == {"dispatch", "collectives"}
    d = next(iter(result.values()))["dedup/auto"]
    assert set(bl.over_budget("dedup/auto", d)) == {"dispatch", "collectives"}
    fake = {p: dict(kernels=0, collectives=0, host_waits=0) for p in bl.PHASES}
    assert bl.over_budget("pairs/auto", fake) == {}


def test_counter_rules():
    """What counts as a launch: compute, copy and fill ops once each (not their inner
    implementation ops), views and empty allocations never, a ``.to`` / ``contiguous`` only
    when it copies."""
    a = torch.arange(12.0)
    with count_launches() as n:
        b = a.view(3, 4).t()                  # views: nothing
        c = b.contiguous()                    # a copy: 1
        d = c.contiguous()                    # already contiguous: nothing
        e = torch.empty(5)                    # allocation: nothing
        f = d.to(torch.float64)               # a conversion: 1
        g = f.to(torch.float64)               # same dtype: nothing
        h = torch.zeros(4) + 1                # fill, add: 2
        i = torch.where(h > 1, h, 0.0)        # compare, where: 2
    assert n.aten == 6 and n.triton == 0 and n.collectives == 0, n.by_name
    assert n.by_name["aten::where"] == 1 and "aten::view" not in n.by_name
    del e, g, i
    assert "aten::view" in LAUNCH_FREE and "aten::to" in DELEGATES


def test_host_work_is_not_counted():
    """Work marked as host memory only (the static exchange's template plan) launches nothing on
    a GPU: not counted; the same ops outside the range are."""
    from epkit.memory import host_work

    with count_launches() as n:
        with host_work():
            t = torch.zeros(4)                # on CUDA: CPU work
            t[1] = 3
        u = torch.zeros(4)                    # a fill: 1
        u[1] = 3                              # a copy into it: 1
    assert n.aten == 2, n.by_name
    del t


def test_host_to_device_copies_count_as_waits(monkeypatch):
    """Every way epkit's code could upload host data is a counted wait on the device path: a
    host tensor moved with ``.to(device)`` or copied into device memory, and device tensors made
    from Python data; host memory staying on the host is not."""
    import os

    import epkit
    import epkit.triton as kernels
    from epkit.hostreads import count_host_reads
    from epkit.memory import mark_host

    monkeypatch.setattr(kernels, "registered_keys", lambda: ("CPU",))  # the device path
    # code whose frames lie in the package, as epkit's own lines would
    where = os.path.join(os.path.dirname(epkit.__file__), "planted_uploads.py")
    src = ("def uploads(dev, mark_host, torch):\n"
           "    table = mark_host(torch.arange(4))\n"
           "    a = table.to(dev)\n"                                  # 1
           "    b = torch.empty(4, dtype=torch.int64); b.copy_(table)\n"  # 2
           "    c = torch.tensor([1, 2], device=dev)\n"                # 3
           "    d = mark_host(torch.tensor([1, 2]))\n"                 # host: no
           "    e = table.to('cpu')\n"                                 # host to host: no
           "    return a, b, c, d, e\n")
    scope = {}
    exec(compile(src, where, "exec"), scope)
    with count_host_reads() as reads:
        scope["uploads"](torch.device("cpu"), mark_host, torch)
    kinds = [(r.kind, r.where) for r in reads.reads]
    assert kinds == [("host-to-device copy", f"planted_uploads.py:{n}") for n in (3, 4, 5)], kinds


def test_measuring_leaves_the_environment_as_it_was(counted, monkeypatch):
    """The ranks run the device path; the process that measured keeps its own kernels (a test
    process that kept EPKIT_KERNELS=triton would start every later group on Triton)."""
    import os

    assert counted  # measured (world sizes 2 and 4) in this process
    assert os.environ.get("EPKIT_KERNELS") in (None, "cpp")
