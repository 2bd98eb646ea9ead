"""epkit.topk_from_routing_map: Megatron / torchtitan's dense routing map to epkit's top-k."""

import pytest
import torch

import epkit


def random_map(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    idx = scores.topk(K, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    routing_map[0] = False                      # a token routed nowhere
    routing_map[1, :] = False
    routing_map[1, 3] = True                    # a token with one expert
    probs = torch.softmax(scores, dim=1)
    return routing_map, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(dtype):
    routing_map, probs = random_map(9, 8, 3, seed=1)
    probs = probs.to(dtype)
    idx, w = epkit.topk_from_routing_map(routing_map, probs)
    assert idx.shape == (9, 3) and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert (idx[0] == -1).all() and (w[0] == 0).all()
    assert idx[1].tolist() == [3, -1, -1]
    for row in idx:  # routed experts first, ascending; then the unused slots
        n = int((row >= 0).sum())
        assert (row[n:] == -1).all() and torch.equal(row[:n], row[:n].sort().values), row
    back_map, back_probs = epkit.routing_map_from_topk(idx, w, 8)
    assert torch.equal(back_map, routing_map)
    assert torch.equal(back_probs, torch.where(routing_map, probs.float(), 0.0))


def test_fixed_topk_and_errors():
    routing_map, probs = random_map(5, 6, 2, seed=2)
    idx, w = epkit.topk_from_routing_map(routing_map, probs, topk=4)
    assert idx.shape == (5, 4) and (idx[:, 2:] == -1).all() and (w[:, 2:] == 0).all()
    with pytest.raises(ValueError, match="more than topk=1"):
        epkit.topk_from_routing_map(routing_map, probs, topk=1)
    with pytest.raises(ValueError, match="routing_map"):
        epkit.topk_from_routing_map(routing_map, probs[:, :3])
    with pytest.raises(TypeError, match="torch.from_numpy"):
        epkit.topk_from_routing_map(routing_map.numpy(), probs)


def test_combine_weights_match_the_dense_formula():
    """sum_e probs[t, e] * y_e over the routed experts == sum_k w_k * y_idx_k."""
    routing_map, probs = random_map(7, 8, 3, seed=3)
    idx, w = epkit.topk_from_routing_map(routing_map, probs)
    y = torch.randn(8, 4, dtype=torch.float64)  # one output row per expert
    dense = (torch.where(routing_map, probs, 0.0).double() @ y)
    sparse = (w.double().unsqueeze(-1) * y[idx.clamp(min=0)] * (idx >= 0).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-12)
