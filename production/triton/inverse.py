"""The inverse of an index map in two launches: which entry names each of Q slots.

The output-indexed row kernels (``byterows._rows_kernel``, ``backward._dest_kernel``) need, for
each output row, the entry of a map that names it (send_map's for ``scatter_rows``, recv_map's
for ``combine_backward_dest``). As torch ops that is a fill, a mask, a where and a scatter (six
to eight launches with the offsets); here one program per block of slots writes the fill (and,
for the byte rows, each slot's own offset), then one program per block of entries writes each
named slot. Two launches, so no program reads or writes what another of the same launch writes;
under a consistent plan the named slots are distinct (otherwise one entry wins, as the torch
scatter's does, and nothing goes out of bounds).
"""

from __future__ import annotations

import torch

from ._runtime import INTERPRETED, cdiv, launch, tl, triton

__all__ = ["invert"]

BLOCK = 4096 if INTERPRETED else 1024


@triton.jit
def _fill_kernel(inv, own, Q, SCALE, OWN: tl.constexpr, BLOCK: tl.constexpr):
    """inv [Q] = -1; with OWN, own [Q] = q * SCALE (a slot's own byte offset)."""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = q < Q
    tl.store(inv + q, tl.full([BLOCK], -1, tl.int64), mask=m)
    if OWN:
        tl.store(own + q, q * SCALE, mask=m)


@triton.jit
def _invert_kernel(map, inv, N, Q, DIV, SCALE, BLOCK: tl.constexpr):
    """inv[map[i]] = (i // DIV) * SCALE for the entries i of map [N] in [0, Q)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    q = tl.load(map + i, mask=m, other=-1)
    ok = m & (q >= 0) & (q < Q)
    tl.store(inv + q, (i // DIV) * SCALE, mask=ok)


def invert(index_map: torch.Tensor, Q: int, div: int = 1, scale: int = 1, own: bool = False):
    """``[Q] int64``: for each slot q, ``(i // div) * scale`` of the entry i of ``index_map``
    (flattened, int64) that names it, -1 where none does; with ``own``, also ``[Q] int64`` of
    ``q * scale`` (``(inverse, own offsets)``)."""
    m = index_map.reshape(-1).contiguous()
    inv = torch.empty(Q, dtype=torch.int64, device=m.device)
    offs = torch.empty(Q if own else 0, dtype=torch.int64, device=m.device)
    if Q:
        launch(_fill_kernel, (cdiv(Q, BLOCK),), inv, offs if own else inv, Q, scale, OWN=own,
               BLOCK=BLOCK)
    if Q and m.numel():
        launch(_invert_kernel, (cdiv(m.numel(), BLOCK),), m, inv, m.numel(), Q, max(div, 1),
               scale, BLOCK=BLOCK)
    return (inv, offs) if own else inv
