"""The worked example of docs/semantics.md: every number in its tables."""

import numpy as np
import pytest

from epkit import reference as ref

F = np.float32
XS = [np.array([[1, 2], [3, 4], [5, 6]], F), np.array([[7, 8], [9, 10]], F)]
IDX = [np.array([[0, 2], [3, -1], [1, 0]]), np.array([[2, 0], [2, 3]])]
WS = [np.array([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]], F), np.array([[0.5, 0.5], [0.75, 0.25]], F)]


def experts(res):
    """Expert e multiplies its rows by e + 1 (padding rows left at zero)."""
    ys = []
    for d, r in enumerate(res):
        y = np.zeros_like(r.expert_x)
        for j in range(2):
            lo = r.expert_offsets[j]
            y[lo:lo + r.tokens_per_expert[j]] = r.expert_x[lo:lo + r.tokens_per_expert[j]] * (2 * d + j + 1)
        ys.append(y)
    return ys


@pytest.mark.parametrize("tier", [ref, ref.fast], ids=["clear", "fast"])
def test_worked_example(tier):
    lay = tier.layout(IDX, 4)
    assert [l.tokens_per_expert.tolist() for l in lay] == [[2, 1, 1, 1], [1, 0, 2, 1]]
    assert [l.tokens_per_rank.tolist() for l in lay] == [[2, 2], [1, 2]]
    assert [l.slots_per_rank.tolist() for l in lay] == [[3, 2], [1, 3]]
    assert [l.is_token_in_rank.astype(int).tolist() for l in lay] == [[[1, 1], [0, 1], [1, 0]], [[1, 1], [0, 1]]]
    assert [l.recv_tokens_per_expert.tolist() for l in lay] == [[[2, 1], [1, 0]], [[1, 1], [2, 1]]]

    res = tier.dispatch(XS, IDX, WS, num_experts=4, align=2, rank_major=True)
    r0, r1 = res
    assert r0.tokens_per_expert.tolist() == [3, 1] and r0.expert_offsets.tolist() == [0, 4, 6]
    assert r1.tokens_per_expert.tolist() == [3, 2] and r1.expert_offsets.tolist() == [0, 4, 6]
    assert r0.dropped_per_expert.tolist() == r1.dropped_per_expert.tolist() == [0, 0]
    pad = [-1, -1, -1]
    assert r0.row_src.tolist() == [[0, 0, 0], [0, 2, 1], [1, 0, 1], pad, [0, 2, 0], pad]
    assert r0.expert_x.tolist() == [[1, 2], [5, 6], [7, 8], [0, 0], [5, 6], [0, 0]]
    assert r0.row_weight.tolist() == [0.5, 0.75, 0.5, 0, 0.25, 0]
    assert r1.row_src.tolist() == [[0, 0, 1], [1, 0, 0], [1, 1, 0], pad, [0, 1, 0], [1, 1, 1]]
    assert r1.expert_x.tolist() == [[1, 2], [7, 8], [9, 10], [0, 0], [3, 4], [9, 10]]
    assert r1.row_weight.tolist() == [0.5, 0.5, 0.75, 0, 1.0, 0.25]
    assert r0.rank_major.recv_src.tolist() == [[0, 0], [0, 2], [1, 0]]
    assert r0.rank_major.recv_topk_idx.tolist() == [[0, -1], [1, 0], [-1, 0]]
    assert r0.rank_major.recv_topk_weights.tolist() == [[0.5, 0], [0.25, 0.75], [0, 0.5]]
    assert r1.rank_major.recv_src.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert r1.rank_major.recv_topk_idx.tolist() == [[-1, 0], [1, -1], [0, -1], [0, 1]]
    assert r1.rank_major.recv_topk_weights.tolist() == [[0, 0.5], [1, 0], [0.5, 0], [0.75, 0.25]]

    ys = experts(res)
    assert [o.tolist() for o in tier.combine(ys, res)] == [[[2, 4], [12, 16], [6.25, 7.5]],
                                                           [[14, 16], [29.25, 32.5]]]
    assert [o.tolist() for o in tier.combine(ys, res, weighted=False)] == [[[4, 8], [12, 16], [15, 18]],
                                                                           [[28, 32], [63, 70]]]

    capped = tier.dispatch(XS, IDX, WS, num_experts=4, align=2, capacity=2, rank_major=True)
    assert [r.dropped_per_expert.tolist() for r in capped] == [[1, 0], [1, 0]]
    assert [r.tokens_per_expert.tolist() for r in capped] == [[2, 1], [2, 2]]
    assert [r.num_rows for r in capped] == [4, 4]
    out = tier.combine(experts(capped), capped)
    assert [o.tolist() for o in out] == [[[2, 4], [12, 16], [6.25, 7.5]], [[10.5, 12], [9, 10]]]
    # rank 1's token 0 lost its only slot on rank 0: it has no rank-major row there any more
    assert [r.rank_major.recv_src.tolist() for r in capped] == [[[0, 0], [0, 2]],
                                                                res[1].rank_major.recv_src.tolist()]
    assert capped[0].rank_major.recv_topk_idx.tolist() == [[0, -1], [1, 0]]

    kw = dict(num_experts=4, hidden=2, dtype="float32", exchange="ragged")
    assert tier.dispatch_bytes(IDX, transport="pairs", **kw).tolist() == [[72, 48], [24, 72]]
    assert tier.combine_bytes(IDX, transport="pairs", **kw).tolist() == [[24, 8], [16, 24]]
    assert tier.dispatch_bytes(IDX, transport="dedup", **kw).tolist() == [[56, 48], [24, 56]]
    assert tier.combine_bytes(IDX, transport="dedup", **kw).tolist() == [[16, 8], [16, 16]]
    # capacity 2: rank 1's token 0 lost its only slot on rank 0 and no longer travels there
    assert tier.dispatch_bytes(IDX, transport="pairs", capacity=2, **kw).tolist() == [[72, 48], [0, 48]]
    assert tier.dispatch_bytes(IDX, transport="dedup", capacity=2, **kw).tolist() == [[56, 48], [0, 48]]
