"""Top-k at the documented limit: K = 128, 129, 200 and 255 with E = 256, under
both transports, world sizes 1 to 4 (E = 258 at 3 ranks), align > 1 and capacity, forward and backward bit for bit
against the reference (K >= 128 sets the sign bit of dedup's slot word; an arithmetic shift
once decoded it as k - 256 and wrote out of bounds)."""

import numpy as np
import pytest

from test_against_reference import check_case

H = 8


def wide_case(R, K, transport, align, capacity, exchange="ragged", seed=0):
    E = 258 if R == 3 else 256  # a multiple of the group size
    rng = np.random.default_rng(seed + 31 * K + R)
    xs, idxs, ws, gouts = [], [], [], []
    for r in range(R):
        T = 3 + r % 2
        idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
        idx[0, rng.random(K) < 0.1] = -1  # a few unused slots
        xs.append(rng.standard_normal((T, H)).astype(np.float32))
        idxs.append(idx)
        ws.append(rng.random((T, K)).astype(np.float32))
        gouts.append(rng.standard_normal((T, H)).astype(np.float32))
    opts = dict(E=E, align=align, capacity=capacity, transport=transport, exchange=exchange,
                y_dtype="float32", weighted=True)
    if exchange == "static":
        opts["max_tokens_per_rank"] = 4
    return R, xs, idxs, ws, gouts, opts


@pytest.mark.parametrize("K", [128, 129, 200, 255])
@pytest.mark.parametrize("transport", ["dedup", "pairs"])
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_wide_topk_bitwise(group_pool, R, K, transport):
    # align > 1 at every size; capacity (which drops slots of wide rows) on two of them
    capacity = 5 if R in (2, 4) else None
    got = check_case(group_pool, wide_case(R, K, transport, align=3, capacity=capacity))
    assert sum(int(g["tokens_per_expert"].sum()) for g in got) > 0


@pytest.mark.parametrize("exchange", ["padded", "static", "lazy"])
def test_wide_topk_other_exchanges(group_pool, exchange):
    check_case(group_pool, wide_case(3, 255, "dedup", align=2, capacity=None, exchange=exchange))
