"""epkit.nn's router options against the formulas docs/usage.md gives, computed independently
in float64 NumPy from the router's own logits (dense = expert-parallel is
test_moe_equivalence.py's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import epkit.nn as enn


def _logits(router, x):
    return (x.double() @ router.weight.detach().double().T).numpy()


def _expected(router, x):
    """(topk_idx, topk_weights, probs) by the documented rule, in float64, one token at a time."""
    z = _logits(router, x)
    E, K, G, M = router.num_experts, router.top_k, router.n_groups, router.topk_groups
    s = np.exp(z - z.max(1, keepdims=True)) if router.score == "softmax" else 1 / (1 + np.exp(-z))
    if router.score == "softmax":
        s /= s.sum(1, keepdims=True)
    b = 0 if router.expert_bias is None else router.expert_bias.double().numpy()
    idx, w = [], []
    for t in range(len(z)):
        choice = s[t] + b
        per = E // G
        gscore = [np.sort(choice[g * per:(g + 1) * per])[::-1][:min(2, per)].sum() for g in range(G)]
        groups = np.argsort(gscore)[::-1][:M]
        allowed = np.concatenate([np.arange(g * per, (g + 1) * per) for g in groups])
        top = allowed[np.argsort(choice[allowed])[::-1][:K]]
        idx.append(top)
        w.append(s[t, top] / s[t, top].sum() * router.route_scale)
    return np.array(idx), np.array(w), s / s.sum(1, keepdims=True)


OPTIONS = [
    {},
    dict(score="sigmoid"),
    dict(n_groups=4, topk_groups=2),
    dict(n_groups=8, topk_groups=3, score="sigmoid"),
    dict(expert_bias=True),
    dict(score="sigmoid", n_groups=4, topk_groups=1, expert_bias=True, route_scale=2.5),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_router_follows_the_formulas(opts):
    torch.manual_seed(0)
    router = enn.Router(24, 16, 4, **opts)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(64, 24)
    idx, w, probs = router.route(x)
    want_idx, want_w, want_p = _expected(router, x)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and probs.dtype == torch.float32
    assert np.array_equal(np.sort(idx.numpy(), 1), np.sort(want_idx, 1))
    order = np.argsort(idx.numpy(), 1)
    got_w = np.take_along_axis(w.detach().double().numpy(), order, 1)
    want_w = np.take_along_axis(want_w, np.argsort(want_idx, 1), 1)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs.detach().double().numpy(), want_p, rtol=1e-5, atol=1e-7)
    if router.n_groups > 1:  # every token's experts lie in at most topk_groups groups
        per = 16 // router.n_groups
        assert max(len(set(row)) for row in (idx.numpy() // per).tolist()) <= router.topk_groups


def test_default_router_is_softmax_topk_renormalised():
    """The default rule is the one epkit.nn always had: weights, idx = softmax.topk(K)."""
    torch.manual_seed(1)
    router = enn.Router(8, 6, 2)
    x = torch.randn(10, 8)
    probs = torch.nn.functional.linear(x, router.weight).softmax(-1)
    w, i = probs.topk(2, dim=-1)
    idx, weights = router(x)
    assert torch.equal(idx, i) and torch.equal(weights, w / w.sum(-1, keepdim=True))


def test_bias_selects_but_does_not_weight():
    torch.manual_seed(2)
    router = enn.Router(8, 8, 2, score="sigmoid", expert_bias=True)
    router.expert_bias[3] = 10.0   # expert 3 always chosen, weighted by its own score
    x = torch.randn(5, 8)
    idx, w = router(x)
    assert (idx == 3).any(dim=1).all()
    s = torch.nn.functional.linear(x, router.weight).sigmoid()
    assert torch.allclose(w, s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True))


def test_load_balancing_loss_formula():
    torch.manual_seed(3)
    T, E, K = 40, 8, 2
    probs = torch.rand(T, E).softmax(-1)
    idx = torch.rand(T, E).topk(K, dim=-1).indices
    counts = np.bincount(idx.numpy().ravel(), minlength=E)
    want = 0.5 * E * np.sum(counts / (T * K) * probs.double().numpy().mean(0))
    got = enn.load_balancing_loss(probs, idx, E, coef=0.5)
    assert abs(got.item() - want) <= 1e-6 * want
    # perfectly balanced: the minimum, coef
    even = torch.arange(E).repeat(T // E * K).view(-1, K)
    assert abs(enn.load_balancing_loss(torch.full((len(even), E), 1 / E), even, E, 0.5).item() - 0.5) < 1e-6


def test_layer_returns_the_loss_beside_the_output_only_when_asked():
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(9))
    torch.manual_seed(4)
    plain = enn.DenseMoE(16, 8, 4, 2)
    assert isinstance(plain(x), torch.Tensor)
    torch.manual_seed(4)
    aux = enn.DenseMoE(16, 8, 4, 2, aux_loss_coef=0.01)
    out, loss = aux(x)
    assert torch.equal(out, plain(x))
    idx, _, probs = aux.router.route(x)
    assert torch.equal(loss, enn.load_balancing_loss(probs, idx, 4, 0.01))
    loss.backward()
    assert aux.router.weight.grad.abs().max() > 0


def test_expert_load_and_bias_update():
    torch.manual_seed(5)
    m = enn.DenseMoE(16, 8, 4, 2, expert_bias=True)
    m(torch.randn(12, 16))
    assert m.expert_load.sum() == 24
    load = m.expert_load.clone()
    m.router.update_expert_bias(load, rate=0.1)
    b = m.router.expert_bias
    assert torch.equal(b, 0.1 * torch.sign(load.float().mean() - load.float()))


@pytest.mark.parametrize("kw, msg", [
    (dict(score="tanh"), "score"), (dict(n_groups=3), "n_groups"),
    (dict(n_groups=4, topk_groups=5), "topk_groups"), (dict(n_groups=4, topk_groups=1), "top_k 4"),
])
def test_router_refuses_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        enn.Router(8, 8, 4, **kw)
