"""The integer bookkeeping of pack and unpack (no host read, no data-dependent size): prefix sums
and ranks within keys by a stable sort as device-generic torch ops, and index maps inverted in
two launches (``inverse.py``), so the row kernels can be output-indexed."""

from __future__ import annotations

import torch

from . import inverse

__all__ = ["excl", "rank_in_key", "take", "place", "section"]


def excl(v: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum along dim 0 (integers: exact and deterministic)."""
    return v.cumsum(0) - v


def rank_in_key(key: torch.Tensor, nkeys: int) -> torch.Tensor:
    """[n] int64: each element's rank among the elements of its key, in index order. A stable
    sort by key gives the canonical order; rank = position minus the exclusive cumsum of the
    key counts. key [n] int64 in [0, nkeys] (nkeys: a key for "none", ranked too)."""
    n = key.numel()
    order = torch.argsort(key, stable=True)
    cnt = torch.zeros(nkeys + 1, dtype=torch.int64, device=key.device)
    cnt.scatter_add_(0, key, torch.ones_like(key))
    pos = torch.arange(n, dtype=torch.int64, device=key.device) - excl(cnt)[key[order]]
    return torch.empty_like(key).scatter_(0, order, pos)


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
