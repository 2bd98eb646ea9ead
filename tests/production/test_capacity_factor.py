"""``capacity_factor=f`` equals ``capacity=ceil(f * S / E)`` bit for bit, ``S`` the group's used
slots (reference/capacity.py's capacity_from_factor)."""

import numpy as np
import pytest

import rank_fns
from cases import assert_bitwise, expected
from epkit.reference.capacity import capacity_from_factor


def routed_case(R, seed):
    rng = np.random.default_rng(seed)
    E, H, K = 4 * R, 8, 3
    xs, idxs, ws, gouts = [], [], [], []
    for r in range(R):
        T = 7 + r
        hot = rng.integers(0, 2, T)  # experts 0 and 1 are hot: capacity drops there
        idx = np.stack([np.concatenate([[h], rng.permutation(np.arange(2, E))[:K - 1]])
                        for h in hot])
        idx[1, 2] = -1
        xs.append(rng.standard_normal((T, H)).astype(np.float32))
        idxs.append(idx)
        ws.append(rng.random((T, K)).astype(np.float32))
        gouts.append(rng.standard_normal((T, H)).astype(np.float32))
    return E, xs, idxs, ws, gouts


def test_capacity_from_factor_is_exact():
    assert capacity_from_factor(100, 8, 1.0) == 13           # 12.5 up
    assert capacity_from_factor(96, 8, 1.0) == 12            # exact: no ceiling past it
    assert capacity_from_factor(10, 4, 1.25) == 4            # 3.125 up
    assert capacity_from_factor(3, 1, 0.1) == 1              # 0.1's float64 value is > 1/10
    assert capacity_from_factor(0, 4, 2.0) == 0


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
@pytest.mark.parametrize("transport", ["dedup", "pairs"])
@pytest.mark.parametrize("R", [2, 3])
def test_factor_equals_explicit_capacity(group_pool, R, transport, factor):
    E, xs, idxs, ws, gouts = routed_case(R, seed=R * 10 + int(factor * 4))
    used = sum(int((i >= 0).sum()) for i in idxs)
    cap = capacity_from_factor(used, E, factor)
    base = dict(E=E, align=2, transport=transport, exchange="auto", y_dtype="float32",
                weighted=True)
    got = group_pool.run(rank_fns.forward_backward, R, xs, idxs, ws, gouts,
                         [dict(base, capacity=None, capacity_factor=factor)] * R)
    want = expected(xs, idxs, ws, gouts, dict(base, capacity=cap))
    assert sum(int(w["dropped_per_expert"].sum()) for w in want) > 0, "the case must drop slots"
    for r in range(R):
        for name in ("expert_x", "tokens_per_expert", "dropped_per_expert", "row_src",
                     "row_weight", "out", "grad_x"):
            assert_bitwise(name, got[r][name], want[r][name], r)
