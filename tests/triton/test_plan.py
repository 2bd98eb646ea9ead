"""epkit.triton.plan (three single-program Triton kernels) against the C++ plan kernel
(cpu/plan.cpp), word for word for every rank: both transports, every exchange request (static
with max_tokens_per_rank included), align, capacity with drops, words made by ``prepare`` from
routing and words made directly (dedup's second gather writes kept token rows, any counts),
errors carried in the words (a rank's own, H / dtype / K mismatches), corrupt words and option
values (the C++ messages), and metadata errors."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_layout import raised, routing

from epkit.reference import abi
from epkit.reference.errors import Reason
from epkit.triton import plan as tp

@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every ``torch.empty`` of epkit.triton.plan filled with a sentinel: the plan is not
    zero-filled first, so a word the kernels forget to write shows up as a difference from the
    C++ plan instead of hiding behind memory that happens to be zero."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(-0x5EED) if t.dtype == torch.int64 else t

    monkeypatch.setattr(tp.torch, "empty", empty)


SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
F = {name: i for i, name in enumerate(abi.PLAN_FIELDS)}


def same_plans(cpp, words, E, align, capacity, transport, exchange, max_tokens, ranks=None):
    """Every rank's plan (or ``ranks``') from both kernels; returns rank 0's."""
    out = None
    for rank in range(words.shape[0]) if ranks is None else ranks:
        args = (words, rank, E, align, capacity, transport, exchange, max_tokens)
        want = cpp.plan(*args)
        got = tp.plan(*args)
        assert got.dtype == torch.int64 and got.shape == want.shape
        if not torch.equal(got, want):
            bad = (got != want).nonzero().view(-1).tolist()
            raise AssertionError(f"rank {rank} {args[2:]}: words {bad[:8]} differ\n"
                                 f" got {got.tolist()}\nwant {want.tolist()}")
        out = want if out is None else out
    return out


def prepared_words(cpp, rng, R, E, K, Ts, H=16, payload=0, dtypes=None, max_tokens=-1):
    """[R, 8 + E + R] the count words of R ranks' routing (as the all-gather makes them)."""
    rows = []
    for r, T in enumerate(Ts):
        idx = torch.from_numpy(routing(rng, T, K, E, unused=rng.choice([0.0, 0.3])))
        dt = (dtypes or {}).get(r, 1)
        x = torch.randn(T, H, dtype=torch.bfloat16 if dt == 2 else torch.float32)
        rows.append(cpp.prepare(x, idx, torch.rand(T, K), E, R, [0, 0, 0, dt, max_tokens],
                                payload))
    return torch.stack(rows)


def direct_words(rng, R, E, K, H, dtype, payload, hi):
    """Words written directly: any counts in [0, hi] (unrelated to one another, as the dedup
    second gather's kept token rows are to the slot counts)."""
    words = np.zeros((R, 8 + E + R), np.int64)
    words[:, 3] = rng.integers(0, 9, R)
    words[:, 4], words[:, 5], words[:, 6], words[:, 7] = H, K, dtype, payload
    words[:, 8:] = rng.integers(0, hi + 1, (R, E + R))
    return torch.from_numpy(words)


OPTIONS = dict(align=st.sampled_from([1, 1, 2, 4, 16]),
               capacity=st.sampled_from([-1, -1, 0, 1, 2, 3, 7]),
               transport=st.sampled_from([0, 1]),
               exchange=st.sampled_from(sorted(abi.EXCHANGE_CODES.values())))


@st.composite
def plan_cases(draw):
    R = draw(st.integers(1, 4))
    L = draw(st.sampled_from([1, 2, 3, 16]))
    E = R * L
    K = draw(st.sampled_from([0, 1, 2, 4, 8, 130]))
    seed = draw(st.integers(0, 2**32 - 1))
    opts = {k: draw(v) for k, v in OPTIONS.items()}
    static = opts["exchange"] == abi.EXCHANGE_CODES["static"] or draw(st.booleans())
    opts["max_tokens"] = draw(st.integers(0, 8)) if static else -1
    kind = draw(st.sampled_from(["prepared", "prepared", "direct", "uniform"]))
    fault = draw(st.sampled_from([None] * 4 + ["own", "hidden", "dtype", "topk"]))
    return R, E, K, seed, kind, fault, opts


@SETTINGS
@given(plan_cases())
def test_plan_matches_cpp(cpp, case):
    R, E, K, seed, kind, fault, opts = case
    rng = np.random.default_rng(seed)
    if kind == "direct":
        words = direct_words(rng, R, E, K, int(rng.choice([8, 64, 96])), int(rng.choice([1, 2])),
                             int(rng.integers(0, 3)), int(rng.choice([1, 5, 40])))
    else:
        Ts = [int(t) for t in rng.integers(0, 9, R)]
        if kind == "uniform":  # every rank the same routing: the equal / auto variants
            one = prepared_words(cpp, rng, R, E, K, Ts[:1] * R)[0]
            words = one.repeat(R, 1)
        else:
            words = prepared_words(cpp, rng, R, E, K, Ts, max_tokens=opts["max_tokens"])
    if fault:
        s = int(rng.integers(0, R))
        field = {"own": 0, "hidden": 4, "dtype": 6, "topk": 5}[fault]
        words[s, field] += 1 if fault != "own" else int(rng.choice([1, 2, 13, 20]))
        if fault == "own":
            words[s, 1:3] = torch.from_numpy(rng.integers(-5, 50, 2))
    same_plans(cpp, words, E, **opts)


@pytest.mark.parametrize("transport", [0, 1])
@pytest.mark.parametrize("exchange", sorted(abi.EXCHANGE_CODES.values()))
def test_plan_capacity_drops(cpp, transport, exchange):
    """Hot experts under a capacity: drops (dropped_any, dropped per expert, kept per source in
    (source, token) order), then dedup's second gather (kept token rows in place of
    tokens_per_rank) planned again."""
    rng = np.random.default_rng(exchange)
    R, E, K = 4, 16, 4
    words = prepared_words(cpp, rng, R, E, K, [7, 0, 8, 5])
    words[:, 8] += 5  # expert 0 is hot on every rank
    mt = 8 if exchange == abi.EXCHANGE_CODES["static"] else -1
    plan = same_plans(cpp, words, E, 2, 3, transport, exchange, mt, ranks=[0, 2])
    assert int(plan[F["dropped_any"]]) == 1
    second = words.clone()
    second[:, 8 + E:] = torch.from_numpy(rng.integers(0, 4, (R, R)))
    same_plans(cpp, second, E, 2, 3, transport, exchange, mt, ranks=[1, 3])


@pytest.mark.parametrize("R,E,K,transport", [(16, 256, 8, 1), (8, 1024, 130, 0), (64, 64, 2, 1),
                                             (20, 40, 4, 1)])
def test_plan_larger(cpp, R, E, K, transport):
    """Beyond one tile in every direction (sources, experts, ranks; phase 1 a program per tile
    of sources, the last one part full at R = 20)."""
    rng = np.random.default_rng(R)
    words = direct_words(rng, R, E, K, 7168, 2, 0, 50)
    same_plans(cpp, words, E, 8, 40, transport, abi.EXCHANGE_CODES["auto"], -1,
               ranks=[0, R - 1])


@pytest.mark.parametrize("where,value", [
    ((0, 8), -3), ((2, 8 + 5), 2**48 + 1), ((1, 8 + 16), -1), ((2, 8 + 16 + 3), 2**50),
    ((0, 4), -1), ((0, 5), -2), ((0, 7), 3), ((0, 7), -1)])
def test_plan_corrupt_words(cpp, where, value):
    """Words no prepare makes: the C++ kernel raises (after the words' errors, before any
    count is used); so does this one on CPU tensors, with the same message."""
    rng = np.random.default_rng(0)
    words = direct_words(rng, 4, 16, 2, 32, 1, 0, 5)
    if where[1] in (4, 5, 7):
        words[:, where[1]] = value  # a header field alike on every rank
    else:
        words[where] = value
    args = (words, 1, 16, 1, -1, 1, abi.EXCHANGE_CODES["ragged"], -1)
    want = raised(cpp.plan, *args)
    assert want is not None
    assert raised(tp.plan, *args) == want
    words[3, 0] = 13  # a rank's own error comes first: a plan carrying it
    same_plans(cpp, words, 16, 1, -1, 1, abi.EXCHANGE_CODES["ragged"], -1)


@pytest.mark.parametrize("option", [dict(align=0), dict(align=-3), dict(align=2**40),
                                    dict(capacity=-5), dict(max_tokens=2**40),
                                    dict(exchange=5, max_tokens=-1), dict(E=10)])
def test_plan_bad_options(cpp, option):
    """Bad option values raise, as the C++ kernel does, unless the words carry an error: then
    the plan carries it (the error reaches every rank as such)."""
    rng = np.random.default_rng(1)
    E = option.get("E", 12)
    R = 3
    words = direct_words(rng, R, E, 2, 32, 1, 0, 5)
    args = dict(align=1, capacity=-1, exchange=0, max_tokens=-1)
    args.update({k: v for k, v in option.items() if k != "E"})
    call = (words, 0, E, args["align"], args["capacity"], 1, args["exchange"], args["max_tokens"])
    want = raised(cpp.plan, *call)
    assert want is not None
    assert raised(tp.plan, *call) == want
    for field, value in ((0, 11), (4, 33)):  # a rank's own error; a hidden mismatch
        bad = words.clone()
        bad[2, field] = value
        plan = same_plans(cpp, bad, E, args["align"], args["capacity"], 1, args["exchange"],
                          args["max_tokens"])
        assert int(plan[F["err_code"]]) in (11, 7)


def test_plan_error_words_with_few_experts(cpp):
    """Error words of prepare with E down to -R (the collective InputError path) plan to the
    same header-only plan, of the C++ kernel's size."""
    for E, R in ((-4, 4), (-3, 4), (0, 2), (1, 2)):
        words = torch.zeros((R, 8 + E + R), dtype=torch.int64)
        words[1, 0], words[1, 1] = 22, E
        same_plans(cpp, words, E, 0, -7, 0, 3, -1)


def test_plan_has_no_host_read(monkeypatch, cpp):
    """With good options the plan is made without reading a tensor on the host (the corrupt-word
    check reads ``fault`` on CPU tensors only; here it is off as on a GPU)."""
    rng = np.random.default_rng(3)
    words = prepared_words(cpp, rng, 3, 12, 4, [5, 2, 7])
    want = cpp.plan(words, 1, 12, 4, 2, 1, abi.EXCHANGE_CODES["auto"], -1)
    monkeypatch.setattr(tp, "_raise_fault", lambda *a: None)

    def refuse(*_a, **_k):
        raise AssertionError("a host read in plan")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = tp.plan(words, 1, 12, 4, 2, 1, abi.EXCHANGE_CODES["auto"], -1)
    monkeypatch.undo()
    assert torch.equal(got, want)


@pytest.mark.parametrize("K", [255, 256, 300])
def test_plan_topk_over_the_dedup_limit(cpp, K):
    """An agreed K over dedup's limit (k in 8 bits) is rank 0's TOPK_TOO_LARGE, decided after
    every rank's own error and the H / dtype / K agreement; pairs takes any K."""
    rng = np.random.default_rng(K)
    R, E = 3, 6
    words = direct_words(rng, R, E, K, 16, 1, 0, 4)
    dedup = same_plans(cpp, words, E, 1, -1, 1, 0, -1)
    assert int(dedup[F["err_code"]]) == (int(Reason.TOPK_TOO_LARGE) if K > 255 else 0)
    if K > 255:
        assert [int(dedup[F[n]]) for n in ("err_rank", "err_a", "err_b")] == [0, K, 255]
    assert int(same_plans(cpp, words, E, 1, -1, 0, 0, -1)[F["err_code"]]) == 0  # pairs
    differs = words.clone()
    differs[2, 5] = K + 1  # rank 2's K differs: its mismatch, not the limit
    plan = same_plans(cpp, differs, E, 1, -1, 1, 0, -1)
    assert [int(plan[F[n]]) for n in ("err_code", "err_rank")] == [int(Reason.TOPK_MISMATCH), 2]
