"""The host-read net of ``epkit.device.count_host_reads``, one read at a time, in this process.

The net is a torch function mode (production/hostreads.py), nothing patched: each read and
upload it knows is counted on would-be device memory and not on host memory, inside the body
of a ``torch.library.custom_op`` and its backward pass too (where a plain mode is switched off),
and ``torch.Tensor`` is left as it was. Here every CPU tensor not marked as host memory stands
in for device memory (``device_path`` is made to say so), as under ``EPKIT_KERNELS=triton``.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch

from epkit import hostreads
from epkit.device import count_host_reads, mark_host


@pytest.fixture
def device_like(monkeypatch):
    """Every unmarked CPU tensor is device memory, as on the interpreted device path."""
    monkeypatch.setattr(hostreads, "device_path",
                        lambda t: isinstance(t, torch.Tensor) and not hostreads.is_host(t))
    monkeypatch.setattr(hostreads, "_device_active", lambda: True)


def _x():
    return torch.arange(1, 5)


def _as(d, t):
    """``t`` in the memory ``d`` is in (a mask made from host memory is host memory)."""
    return mark_host(t) if hostreads.is_host(d) else t


# (kind counted, the read) over a fresh device tensor d and a host tensor h
READS = [
    ("item", lambda d, h: d[0].item()),
    ("tolist", lambda d, h: d.tolist()),
    ("numpy", lambda d, h: d.numpy()),
    ("cpu", lambda d, h: d.cpu()),
    ("int", lambda d, h: int(d[0])),
    ("float", lambda d, h: float(d[0])),
    ("bool", lambda d, h: bool(d[0])),
    ("index", lambda d, h: operator.index(d[0])),
    ("nonzero", lambda d, h: d.nonzero()),
    ("nonzero", lambda d, h: torch.nonzero(d)),
    ("masked_select", lambda d, h: d.masked_select(d > 2)),
    ("masked_select", lambda d, h: torch.masked_select(d, d > 2)),
    ("bincount", lambda d, h: d.bincount()),
    ("bincount", lambda d, h: torch.bincount(d)),
    ("unique", lambda d, h: d.unique()),
    ("unique", lambda d, h: torch.unique(d)),
    ("to cpu", lambda d, h: d.to("cpu")),
    ("copy to host", lambda d, h: h.copy_(d)),
    ("mask index", lambda d, h: d[_as(d, d > 2)]),
    ("repeat_interleave", lambda d, h: torch.repeat_interleave(d)),
    ("repeat_interleave", lambda d, h: d.repeat_interleave(d)),
]
UPLOADS = [
    lambda d, h: h.to(d.device),
    lambda d, h: d.copy_(h),
    lambda d, h: torch.tensor([1, 2], device=d.device),
    lambda d, h: torch.as_tensor([1, 2], device=d.device),
]


@pytest.mark.parametrize("kind,read", READS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(READS)])
def test_each_read_is_counted_once_on_device_memory_only(device_like, kind, read):
    with count_host_reads() as reads:
        read(_x(), mark_host(_x()))
        on_device = reads.take()
        h = mark_host(_x())
        read(h, mark_host(_x()))
        on_host = reads.take()
    assert [r.kind for r in on_device] == [kind]
    assert on_host == []


@pytest.mark.parametrize("upload", UPLOADS)
def test_host_to_device_copies_are_counted(device_like, monkeypatch, upload):
    # an upload counts when epkit's code makes it: let this file be epkit's for the test
    monkeypatch.setattr(hostreads, "_where", lambda: ("other", "test"))
    with count_host_reads() as reads:
        upload(_x(), mark_host(_x()))
    assert [r.kind for r in reads.reads] == ["host-to-device copy"]


def test_the_net_sees_inside_custom_ops_and_their_backward(device_like):
    """A plain function mode is popped inside an op's body; the net puts itself back."""
    @torch.library.custom_op("epkit_test::reads_inside", mutates_args=())
    def reads_inside(x: torch.Tensor) -> torch.Tensor:
        x.tolist()
        return x.clone()

    @reads_inside.register_fake
    def _(x):
        return torch.empty_like(x)

    def backward(ctx, g):
        int(g[0])
        return g * 2

    reads_inside.register_autograd(backward)
    x = torch.ones(3, requires_grad=True)
    with count_host_reads() as reads:
        y = reads_inside(x)
        forward = reads.take()
        torch.autograd.grad(y.sum(), [x])
        back = reads.take()
    assert [r.kind for r in forward] == ["tolist"]
    assert [r.kind for r in back] == ["int"]


def test_nothing_is_patched_and_nothing_counted_after(device_like):
    before = {n: torch.Tensor.__dict__.get(n) for n in ("item", "tolist", "to", "copy_")}
    with count_host_reads() as reads:
        assert {n: torch.Tensor.__dict__.get(n) for n in before} == before
        _x().tolist()
    _x().tolist()
    assert len(reads.reads) == 1


def test_nested_counters_each_see_every_read(device_like):
    with count_host_reads() as outer:
        _x().tolist()
        with count_host_reads() as inner:
            _x().sum().item()
    assert [r.kind for r in outer.reads] == ["tolist", "item"]
    assert [r.kind for r in inner.reads] == ["item"]


def test_a_cuda_sync_warning_is_a_read_unless_counted(device_like):
    """What ``torch.cuda.set_sync_debug_mode("warn")`` reports (a sync inside a C++ op) is
    counted; other warnings pass through."""
    with count_host_reads() as reads:
        warnings.warn(hostreads.SYNC_WARNING)
        with hostreads.quiet():
            warnings.warn(hostreads.SYNC_WARNING)
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else")
    assert [r.kind for r in reads.reads] == ["cuda sync"]


def test_grad_mode_and_repr_inside_the_counter(device_like):
    """``no_grad`` (torch._C._set_grad_enabled, which the mode's own entry calls) and a
    tensor's repr (Python that reads the values) run inside the counter; repr's read counts."""
    x = _x()
    with count_host_reads() as reads:
        with torch.no_grad():
            y = x * 2
        with torch.enable_grad():
            pass
        text = repr(y)
    assert "tensor" in text
    assert reads.reads and all(r.kind in ("item", "tolist") for r in reads.reads)


def test_counters_in_two_threads_restore_the_warning_hook(device_like):
    """A opens, B opens, A closes, B closes: the warning hook and its filter are put back."""
    import threading

    shown, filters = warnings.showwarning, list(warnings.filters)
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()

    def a():
        with count_host_reads():
            a_open.set()
            b_open.wait(10)
        a_closed.set()

    def b():
        a_open.wait(10)
        with count_host_reads():
            b_open.set()
            a_closed.wait(10)

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert warnings.showwarning is shown
    assert list(warnings.filters) == filters
