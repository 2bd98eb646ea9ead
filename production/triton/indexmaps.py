"""The integer bookkeeping of pack and unpack (no host read, no data-dependent size): prefix sums
as device-generic torch ops, ranks within keys in two launches (``ranks.py``), and index maps
inverted in two launches (``inverse.py``), so the row kernels can be output-indexed."""

from __future__ import annotations

import torch

from . import inverse, ranks

__all__ = ["excl", "rank_in_key", "take", "place", "section"]


def excl(v: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum along dim 0 (integers: exact and deterministic)."""
    return v.cumsum(0) - v


def rank_in_key(key: torch.Tensor, nkeys: int) -> torch.Tensor:
    """[n] int64: each element's rank among the elements of its key, in index order (the
    canonical order of a stable sort by key). key [n] int64 in [0, nkeys] (nkeys: a key for
    "none", ranked too). Two launches (``ranks.rank_in_key``: the blocks' histograms, then each
    block's ranks), not a sort's nine ops."""
    return ranks.rank_in_key(key, nkeys)


def take(v: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``v[at]`` (``at`` in range), zeros when ``v`` is empty (a rank without tokens)."""
    return v[at] if v.numel() else torch.zeros_like(at)


def place(Q: int, q: torch.Tensor, keep: torch.Tensor, what: torch.Tensor) -> torch.Tensor:
    """[Q] int64: ``what[i]`` at ``q[i]`` for each kept ``i`` with ``q[i]`` in [0, Q), -1
    elsewhere (the inverse of a map). Kept entries name distinct slots under a consistent plan;
    should they not (a plan from another call on a GPU, where nothing raises), one of them wins
    and nothing goes out of bounds. Two launches (``inverse.place``), not a torch scatter's
    six."""
    return inverse.place(Q, q, keep, what)


def section(Q: int, rows_per: torch.Tensor, start: torch.Tensor, W_: int, R: int):
    """The rows of one section of a buffer over its R chunks: for each of the Q rows, its chunk
    d, its position in the chunk's section and its byte offset (``start[d]`` + position *
    W_); and each chunk's first row among the Q (``rows_per`` [R] int64 the section's rows per
    chunk, ``start`` [R] int64 where each chunk's section begins)."""
    base = excl(rows_per)
    q = torch.arange(Q, dtype=torch.int64, device=rows_per.device)
    d = torch.searchsorted(rows_per.cumsum(0), q, right=True).clamp(max=R - 1)
    pos = q - base[d]
    return d, pos, start[d] + pos * W_, base
