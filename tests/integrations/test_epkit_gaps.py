"""What framework glue needs from epkit itself: the padded segment lengths, bfloat16 / float16
routing weights, a group of one for expert-parallel size 1, Megatron's drop-and-pad maps. These
need no framework installed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import epkit
import epkit.reference as ref
import gaps_fns as fns


def test_padded_lengths_are_the_segments(pair):
    E, K, align = 6, 2, 8
    res = pair.run(fns.padded_lengths, 2, [9, 7], [E] * 2, [K] * 2, [align] * 2)
    xs, idx, ws = zip(*[fns.routing(r, T, E, K, 1) for r, T in enumerate((9, 7))])
    spec = ref.dispatch([x.numpy() for x in xs], [i.numpy() for i in idx],
                        [w.numpy() for w in ws], num_experts=E, align=align)
    for (tpe, padded, offsets, M), r in zip(res, spec):
        np.testing.assert_array_equal(padded.numpy(), r.padded_tokens_per_expert)
        assert torch.equal(padded, offsets.diff()) and int(padded.sum()) == M
        assert torch.equal(padded, (tpe + align - 1) // align * align)
        assert (padded > tpe).any()  # the case pads, so the two counts differ


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_weights_are_widened_exactly(pair, dtype):
    for out in pair.run(fns.narrow_weights, 2, [dtype] * 2):
        (ex, rw, res, gx, gw), (nex, nrw, nres, ngx, ngw) = out["wide"], out["narrow"]
        assert torch.equal(ex, nex) and torch.equal(rw, nrw) and rw.dtype == torch.float32
        assert torch.equal(res, nres) and torch.equal(gx, ngx)
        # The weights' gradient: the float32 one, rounded to the weights' dtype.
        assert ngw.dtype == getattr(torch, dtype) and torch.equal(ngw, gw.to(ngw.dtype))


def test_reference_takes_narrow_weights():
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    idx = np.array([[0, 1], [1, 2], [3, 0], [2, 3]])
    w = np.array([[0.5, 0.25], [1.5, 2.0], [0.75, 3.0], [1.0, 0.125]])
    for narrow in (ml_dtypes.bfloat16, np.float16):
        a = ref.dispatch([x], [idx], [w.astype(np.float32)], num_experts=4)[0]
        b = ref.dispatch([x], [idx], [w.astype(narrow)], num_experts=4)[0]
        np.testing.assert_array_equal(a.row_weight, b.row_weight)
        assert b.row_weight.dtype == np.float32
    with pytest.raises(epkit.InputError, match="float32, bfloat16 or float16, got float64"):
        ref.dispatch([x], [idx], [w], num_experts=4)


def test_group_of_one(pair):
    for rank, (size, sources, tpe) in enumerate(pair.run(fns.one_rank_group, 2)):
        assert size == 1 and sources == [0] and int(tpe.sum()) == 10


def megatron_drop_and_pad(T, E, K, capacity, seed):
    """A routing map as Megatron's router makes it under moe_pad_expert_input_to_capacity with
    the "probs" policy: each expert's column keeps the ``capacity`` highest probabilities,
    routed or not; the probs of unrouted entries are 0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g).softmax(1)
    top = scores.topk(K, dim=1).indices
    probs = torch.zeros(T, E).scatter(1, top, scores.gather(1, top))
    keep = torch.zeros(T, E, dtype=torch.bool).scatter(0, probs.topk(capacity, dim=0).indices, True)
    return keep, probs * keep


def test_drop_and_pad_map(pair):
    E, K, C = 4, 2, 3
    maps = [megatron_drop_and_pad(5, E, K, C, s) for s in (1, 2)]
    assert any(int(m.sum(1).max()) > K for m, _ in maps)  # rows name more than top-k experts
    with pytest.raises(ValueError, match=r"topk=routing_map.shape\[1\]"):
        epkit.topk_from_routing_map(*maps[0], topk=K)
    res = pair.run(fns.drop_and_pad, 2, *zip(*maps), [E] * 2)
    for tpe, row_weight, row_src in res:
        assert tpe.tolist() == [2 * C] * (E // 2)  # every local expert: R * capacity rows
        for segment in row_src.view(E // 2, 2 * C, 3):  # source rank, then token: Megatron's
            order = (segment[:, 0] * 100 + segment[:, 1]).tolist()
            assert order == sorted(order) and segment[:, 0].tolist() == [0] * C + [1] * C
    padding = sum(int((m & (p == 0)).sum()) for m, p in maps)
    assert padding and sum(int((rw == 0).sum()) for _, rw, _ in res) == padding


def test_integrations_without_their_frameworks():
    """Without the framework, importing its integration is an ImportError that names the
    package and the extra that installs it (one fresh interpreter, both frameworks hidden)."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["megatron"] = sys.modules["torchtitan"] = None
for module in ("megatron", "torchtitan"):
    try:
        __import__("epkit.integrations." + module)
    except ImportError as exc:
        print(exc)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) == 2, run.stdout + run.stderr
    for line, package in zip(lines, ("megatron-core", "torchtitan")):
        assert f"needs {package}" in line and "epkit[frameworks]" in line
