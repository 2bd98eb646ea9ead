"""ranks.rank_in_key (two launches) against the stable sort it replaces: each element's rank
among the elements of its key, in index order, at the interpreter's tiles and at a GPU launch's
(many programs, so the blocks' histograms carry across programs)."""

import contextlib

import numpy as np
import pytest
import torch

from epkit.triton import _runtime, ranks


def oracle(key: np.ndarray) -> np.ndarray:
    """The rank by counting: how many earlier elements share each one's key."""
    seen: dict = {}
    out = np.empty(key.size, np.int64)
    for i, k in enumerate(key.tolist()):
        out[i] = seen.get(k, 0)
        seen[k] = out[i] + 1
    return out


@pytest.mark.parametrize("gpu", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
@pytest.mark.parametrize("n,nkeys,seed", [(0, 3, 0), (1, 0, 1), (700, 2, 2), (1500, 130, 3),
                                          (257, 384, 4), (5000, 7, 5)])
def test_rank_in_key_matches_counting(n, nkeys, seed, gpu):
    rng = np.random.default_rng(seed)
    key = rng.integers(0, nkeys + 1, n)
    if n > 10:
        key[: n // 3] = nkeys  # a long run of one key across block boundaries
    want = oracle(key)
    with (_runtime.gpu_tiles() if gpu else contextlib.nullcontext()):
        if gpu and n > ranks.BLOCK:
            assert -(-n // ranks.BLOCK) > 1
        got = ranks.rank_in_key(torch.from_numpy(key), nkeys)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()



def test_keys_outside_the_range_rank_as_none_and_the_fill_rides_along():
    """Ids outside [0, nkeys) (a -1 slot, an id past the experts) rank among the key nkeys;
    the first launch fills the caller's map with -1 over its whole length."""
    key = torch.tensor([3, -1, 0, 9, 3, 4, -7, 0], dtype=torch.int64)
    fill = torch.zeros(10000, dtype=torch.int64)
    got = ranks.rank_in_key(key, 4, fill=fill)
    want = oracle(np.where((key.numpy() >= 0) & (key.numpy() < 4), key.numpy(), 4))
    assert got.tolist() == want.tolist() and bool((fill == -1).all())


@pytest.mark.parametrize("gpu", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_weighted_ranks_are_prefix_sums_within_each_key(gpu):
    """With weights, an element's rank is the sum of the weights of the earlier elements of its
    key (dedup's unpack: each token row's first slot row within its source), and the blocks'
    histograms add up to each key's total."""
    rng = np.random.default_rng(8)
    n, nkeys = 3000, 5
    key = np.sort(rng.integers(0, nkeys, n))  # sources ascending, as unpack's rows are
    weight = rng.integers(0, 9, n)
    want = np.zeros(n, np.int64)
    for k in range(nkeys):
        at = np.flatnonzero(key == k)
        want[at] = np.cumsum(weight[at]) - weight[at]
    with (_runtime.gpu_tiles() if gpu else contextlib.nullcontext()):
        got, hist = ranks.rank_in_key(torch.from_numpy(key), nkeys,
                                      weight=torch.from_numpy(weight), totals=True)
    assert got.tolist() == want.tolist()
    assert hist.sum(0)[:nkeys].tolist() == [int(weight[key == k].sum()) for k in range(nkeys)]
