"""Each element's rank among the elements of its key, in index order, in two launches: the
stable sort of pack's and unpack's index passes (a slot's place among the slots to its expert,
its rank, its local expert), across many programs.

``key`` [n] int64, keys in [0, nkeys) (any other value is the key nkeys, "none", ranked too). The rank of element i is
the number of elements before it with its key: the elements of the blocks before its own
(each block's histogram, the first launch) plus those before it in its own block (a one-hot
tile's cumulative sum, key chunk by key chunk, the second launch). Integers only: exact, and
no program reads what another of the same launch writes (the histograms cross programs
through the second launch).

The second launch sums the histograms of the blocks before each program's own, BLOCKS of
them a tile: linear in the number of blocks (a decoupled look-back would make it constant),
a few tile loads a program at a dispatch's token counts.
"""

from __future__ import annotations

import torch

from ._runtime import INTERPRETED, cdiv, launch, tl, triton

__all__ = ["rank_in_key", "BLOCK"]

BLOCK = 4096 if INTERPRETED else 128  # elements a program
KEYS = 64 if INTERPRETED else 32  # keys a step of the one-hot tiles
BLOCKS = 64 if INTERPRETED else 32  # earlier blocks' histograms a step


@triton.jit
def _key(key, i, inside, NK):
    """The keys of elements i: outside [0, NK - 1) the last key ("none")."""
    k = tl.load(key + i, mask=inside, other=0)
    return tl.where((k >= 0) & (k < NK - 1), k, NK - 1)


@triton.jit
def _weight(weight, i, inside, WEIGHTED: tl.constexpr):
    """Each element's weight: 1, or weight[i] (int64)."""
    if WEIGHTED:
        return tl.load(weight + i, mask=inside, other=0)
    else:
        return inside.to(tl.int64)


@triton.jit
def _histogram_kernel(key, weight, hist, fill, n, NK, Q, WEIGHTED: tl.constexpr,
                      BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """hist[pid, :NK] = how many of elements [pid * BLOCK, +BLOCK) have each key (WEIGHTED:
    the sum of their weights); fill [Q] = -1 over the same range (a map the caller's next
    launch writes into)."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(fill + i, tl.full([BLOCK], -1, tl.int64), mask=i < Q)
    k = tl.where(i < n, _key(key, i, i < n, NK), -1)
    wt = _weight(weight, i, i < n, WEIGHTED).to(tl.int32)  # (a block's sums fit)
    for c0 in range(0, NK, KEYS):
        c = c0 + tl.arange(0, KEYS)
        hit = tl.where(k[:, None] == c[None, :], wt[:, None], 0)
        tl.store(hist + pid.to(tl.int64) * NK + c, tl.sum(hit, 0).to(tl.int64), mask=c < NK)


@triton.jit
def _rank_kernel(key, weight, hist, rank, n, NK, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr,
                 KEYS: tl.constexpr, BLOCKS: tl.constexpr):
    """rank[i] for elements [pid * BLOCK, +BLOCK): their key's count (weight) in the blocks
    before this one (their histograms summed BLOCKS at a time), plus that of the elements of
    this block before them with their key (a one-hot tile's cumulative sum). The tiles are
    int32 (registers: int64 tiles spilled on gfx942): a rank is below 2**31, as a dispatch's
    slots per expert are and dedup's weighted ranks (at most 255 slots a token row) are."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    k = _key(key, i, inside, NK)
    wt = _weight(weight, i, inside, WEIGHTED).to(tl.int32)
    r = tl.zeros([BLOCK], tl.int64)
    for c0 in range(0, NK, KEYS):
        c = c0 + tl.arange(0, KEYS)
        earlier = tl.zeros([KEYS], tl.int32)  # this chunk's keys in the blocks before
        for b0 in range(0, pid, BLOCKS):
            b = b0 + tl.arange(0, BLOCKS)
            h = tl.load(hist + b.to(tl.int64)[:, None] * NK + c[None, :],
                        mask=(b[:, None] < pid) & (c[None, :] < NK), other=0)
            earlier += tl.sum(h, 0).to(tl.int32)
        one = (k[:, None] == c[None, :]) & inside[:, None]
        hit = tl.where(one, wt[:, None], 0)
        before = tl.cumsum(hit, 0) - hit + earlier[None, :]
        r += tl.sum(tl.where(one, before, 0), 1).to(tl.int64)
    tl.store(rank + i, r, mask=inside)


def rank_in_key(key: torch.Tensor, nkeys: int, fill: torch.Tensor | None = None,
                weight: torch.Tensor | None = None, totals: bool = False):
    """[n] int64: each element's rank among the elements of its key, in index order (module
    docstring). ``key`` [n] int64, keys in [0, nkeys) (any other value is the key ``nkeys``,
    "none", ranked too); two launches. ``fill``: an int64 tensor the first launch fills with
    -1 on the way (a map the caller scatters into next). ``weight`` [n] int64: the sum of the
    weights of the elements before, not their count (an exclusive prefix sum within each key).
    ``totals``: also return the blocks' histograms [blocks, nkeys + 1] (their column sums are
    each key's count or weight)."""
    key = key.reshape(-1).to(torch.int64).contiguous()
    n, NK = key.numel(), nkeys + 1
    Q = 0 if fill is None else fill.numel()
    w = key if weight is None else weight.reshape(-1).to(torch.int64).contiguous()
    rank = torch.empty_like(key)
    programs = cdiv(max(n, Q), BLOCK)
    hist = torch.empty((programs, NK), dtype=torch.int64, device=key.device)
    if programs:
        launch(_histogram_kernel, (programs,), key, w, hist, key if fill is None else fill, n,
               NK, Q, WEIGHTED=weight is not None, BLOCK=BLOCK, KEYS=KEYS)
    if n:
        launch(_rank_kernel, (cdiv(n, BLOCK),), key, w, hist, rank, n, NK,
               WEIGHTED=weight is not None, BLOCK=BLOCK, KEYS=KEYS, BLOCKS=BLOCKS)
    return (rank, hist) if totals else rank
