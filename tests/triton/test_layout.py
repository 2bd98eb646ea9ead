"""epkit.triton.layout (``layout``, ``prepare``) against the C++ kernels (cpu/layout.cpp), word
for word: the count words, every error reason prepare detects with its "first bad" position
(the earliest check winning when several fail), and the messages of the metadata errors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epkit.triton import layout as tl_layout

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BLOCKS = {0: 0, 1: 32, 2: 128}  # payload code -> elements per scale along H


def routing(rng, T, K, E, unused=0.2) -> np.ndarray:
    """[T, K] expert ids: distinct per row, -1 in about ``unused`` of the slots (and wherever
    K > E: a row names at most E experts)."""
    idx = np.full((T, K), -1, np.int64)
    for t in range(T):
        n = min(K, E)
        idx[t, rng.permutation(K)[:n]] = rng.permutation(E)[:n]
    idx[rng.random((T, K)) < unused] = -1
    return idx


def raised(fn, *args):
    """The message ``fn(*args)`` raises (None if it returns)."""
    try:
        fn(*args)
    except RuntimeError as exc:
        return str(exc)
    return None


def same_words(cpp, args):
    want = cpp.prepare(*args)
    got = tl_layout.prepare(*args)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), f"\n got {got.tolist()}\nwant {want.tolist()}"
    return want


@st.composite
def prepare_cases(draw):
    R = draw(st.integers(1, 4))
    E = R * draw(st.sampled_from([1, 2, 3, 16]))
    K = draw(st.sampled_from([0, 1, 2, 3, 8, 130]))
    T = draw(st.integers(0, 8))
    payload = draw(st.sampled_from([0, 0, 1, 2]))
    H = draw(st.sampled_from([8, 32, 96, 128] if payload else [1, 8, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    idx = routing(rng, T, K, E, unused=draw(st.sampled_from([0.0, 0.2, 0.9])))
    w = rng.random((T, K)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    faults = draw(st.sets(st.sampled_from(["range", "dup", "weight", "payload"]), max_size=3))
    if T and K:
        if "range" in faults:
            idx[rng.integers(T), rng.integers(K)] = draw(st.sampled_from([E, -2, 10**12, E + 7]))
        if "dup" in faults and K > 1 and E > 1:
            t = rng.integers(T)
            k1, k2 = rng.permutation(K)[:2]
            idx[t, k1] = idx[t, k2] = rng.integers(E)
        if "weight" in faults:
            w[rng.integers(T), rng.integers(K)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if T and "payload" in faults:
        x[rng.integers(T), rng.integers(H)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    itype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16]))
    if itype == torch.int16:
        idx = np.clip(idx, -32768, 32767)
    pre = [0, 0, 0, draw(st.sampled_from([1, 2]))]
    mt = draw(st.one_of(st.none(), st.integers(-1, 9)))
    if mt is not None:
        pre.append(mt)
    return (torch.from_numpy(x).to(dtype), torch.from_numpy(idx).to(itype),
            torch.from_numpy(w), E, R, pre, payload)


@SETTINGS
@given(prepare_cases())
def test_prepare_matches_cpp(cpp, case):
    same_words(cpp, case)


@pytest.mark.parametrize("payload", [0, 1, 2])
def test_prepare_error_priority(cpp, payload):
    """Every check failing at once, then one fewer each time: the earliest check in the C++
    order always wins, with its first bad position (not just any bad one)."""
    rng = np.random.default_rng(payload)
    T, K, E, R, H = 6, 4, 8, 2, 128 if payload else 16
    idx = routing(rng, T, K, E, unused=0.0)
    w = rng.random((T, K)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx[4, 1], idx[3, 2] = E, -5                  # range: first in (t, k) order is row 3
    idx[5, 0] = idx[5, 3] = 1                     # dup rows 5 and 2 (2 has two: smallest wins)
    idx[2, 0], idx[2, 1], idx[2, 2], idx[2, 3] = 6, 3, 6, 3
    w[5, 1], w[1, 3] = np.nan, np.inf             # weights: row 1 first
    x[4, 7], x[2, 0] = np.inf, np.nan             # payload: row 2 first
    args = [torch.from_numpy(x), torch.from_numpy(idx), torch.from_numpy(w), E, R,
            [0, 0, 0, 1, 3], payload]             # static overflow: 6 tokens > 3
    codes = []
    for fix in ("range", "dup", "weight", "payload", "static"):
        codes.append(int(same_words(cpp, args)[0]))
        if fix == "range":
            args[1] = args[1].clone()
            args[1][4, 1], args[1][3, 2] = 0, 7
        elif fix == "dup":
            args[1] = torch.from_numpy(routing(rng, T, K, E, unused=0.0))
        elif fix == "weight":
            args[2] = torch.rand(T, K)
        elif fix == "payload":
            args[0] = torch.randn(T, H)
        else:
            args[5] = [0, 0, 0, 1, T]
    codes.append(int(same_words(cpp, args)[0]))
    assert codes == ([1, 2, 13, 14, 20, 0] if payload else [1, 2, 13, 20, 20, 0])


@pytest.mark.parametrize("fault", ["none", "range", "dup", "weight", "payload"])
def test_prepare_across_many_programs(cpp, fault):
    """At a GPU launch's tiles the scan is several programs (300 tokens, 64 a program): each
    block's counts add up, and of two faults in different blocks the first block's wins, with
    its own position and value (a bfloat16 payload: its bits are checked, not a conversion)."""
    from epkit.triton import _runtime

    rng = np.random.default_rng(11)
    T, K, E, R, H = 300, 4, 16, 4, 64
    idx = routing(rng, T, K, E, unused=0.3)
    w = rng.random((T, K)).astype(np.float32)
    x = torch.randn(T, H).to(torch.bfloat16)
    if fault == "range":
        idx[250, 1], idx[130, 3] = E + 3, -7
    elif fault == "dup":
        idx[200, 0] = idx[200, 2] = 5
        idx[70, 1] = idx[70, 3] = 9
        idx[70, 0] = idx[70, 2] = 2
    elif fault == "weight":
        w[290, 0], w[140, 2] = np.nan, -np.inf
    elif fault == "payload":
        x[299, 5], x[65, 63] = float("inf"), float("nan")
    args = (x, torch.from_numpy(idx), torch.from_numpy(w), E, R, [0, 0, 0, 2, -1], 1)
    with _runtime.gpu_tiles():
        assert -(-T // tl_layout.SCAN_TB) >= 4
        words = same_words(cpp, args)
    assert int(words[0]) == {"none": 0, "range": 1, "dup": 2, "weight": 13, "payload": 14}[fault]


@pytest.mark.parametrize("H", [48, 100])
def test_prepare_hidden_not_a_block_multiple(cpp, H):
    x, idx, w = torch.randn(3, H), torch.tensor([[0, 1], [1, -1], [2, 3]]), torch.rand(3, 2)
    for payload in (1, 2):
        assert int(same_words(cpp, (x, idx, w, 4, 2, [0, 0, 0, 1], payload))[0]) == (
            15 if H % BLOCKS[payload] else 0)


@pytest.mark.parametrize("E,R", [(8, 2), (-4, 4), (-3, 4), (0, 3)])
def test_prepare_carries_the_callers_error(cpp, E, R):
    """A nonzero pre_error code travels as is and the tensors are not looked at (they may be
    anything: here the wrong shapes and dtypes), with E down to -R."""
    x, idx, w = torch.zeros(2, 3, 5), torch.zeros(7, dtype=torch.float64), torch.zeros(1)
    words = same_words(cpp, (x, idx, w, E, R, [22, E, 9, 2], 1))
    assert words.shape == (8 + E + R,) and int(words[0]) == 22


def test_prepare_larger(cpp):
    rng = np.random.default_rng(7)
    T, K, E, R = 512, 8, 256, 16
    idx = torch.from_numpy(routing(rng, T, K, E))
    x, w = torch.randn(T, 128, dtype=torch.bfloat16), torch.rand(T, K)
    same_words(cpp, (x, idx, w, E, R, [0, 0, 0, 2, 600], 1))


@st.composite
def layout_cases(draw):
    R = draw(st.integers(1, 4))
    E = R * draw(st.sampled_from([1, 2, 5, 16]))
    K = draw(st.sampled_from([0, 1, 2, 4, 130]))
    T = draw(st.integers(0, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    idx = routing(rng, T, K, E, unused=draw(st.sampled_from([0.0, 0.3])))
    if T and K and draw(st.booleans()):
        idx[rng.integers(T), rng.integers(K)] = draw(st.sampled_from([E, -2, E + 3]))
    return torch.from_numpy(idx).to(draw(st.sampled_from([torch.int64, torch.int32]))), E, R


@SETTINGS
@given(layout_cases())
def test_layout_matches_cpp(cpp, case):
    want_err = raised(cpp.layout, *case)
    got_err = raised(tl_layout.layout, *case)
    assert got_err == want_err
    if want_err is None:
        want, got = cpp.layout(*case), tl_layout.layout(*case)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_prepare_has_no_host_read(monkeypatch, cpp):
    """The words are made without reading a tensor on the host: every way a tensor's value
    reaches Python raises here (``layout`` is the standalone op that may)."""
    def refuse(*_a, **_k):
        raise AssertionError("a host read in prepare")

    x, idx, w = torch.randn(5, 64), torch.tensor([[0, 3], [1, -1], [2, 2], [3, 1], [9, 9]]), \
        torch.rand(5, 2)
    w[2, 0] = math.nan
    want = cpp.prepare(x, idx, w, 4, 2, [0, 0, 0, 1, 2], 1)
    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = tl_layout.prepare(x, idx, w, 4, 2, [0, 0, 0, 1, 2], 1)
    monkeypatch.undo()
    assert torch.equal(got, want)
