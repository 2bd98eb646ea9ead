"""Assembling the expert-major arrays of one rank from its experts' rows.

Shared by the canonical dispatch and the transports, so that both lay out rows, padding and
offsets the same way (dispatch.py states the format).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .records import Group

# One row of an expert's segment: (payload row [H], its scales [H/block] or None, s, t, k, weight).


def padded(n, align: int):
    """``n`` rounded up to a multiple of ``align`` (0 stays 0); ``n`` an int or an int64 array
    (both tiers' segment lengths)."""
    return -(-n // align) * align


Row = Tuple[np.ndarray, Optional[np.ndarray], int, int, int, np.float32]


def assemble(group: Group, segments: Sequence[List[Row]]) -> Tuple[dict, List[List[int]]]:
    """Build ``expert_x, expert_scale, tokens_per_expert, expert_offsets, row_src, row_weight``.

    Args:
        segments: L lists, expert j's rows in order (s ascending, then t ascending).
    Returns:
        (fields, positions): the arrays as a dict, and for each expert the row index ``m`` that
        each of its entries got.
    """
    L, H = group.num_local_experts, group.hidden
    tokens_per_expert = np.array([len(seg) for seg in segments], np.int64).reshape(L)
    expert_offsets = np.zeros(L + 1, np.int64)
    for j in range(L):
        expert_offsets[j + 1] = expert_offsets[j] + padded(int(tokens_per_expert[j]), group.align)
    M = int(expert_offsets[L])
    expert_x = np.zeros((M, H), group.row_dtype)
    expert_scale = group.payload_of.zero_scales(M, H)
    row_src = np.full((M, 3), -1, np.int64)
    row_weight = np.zeros(M, np.float32)
    positions = []
    for j, seg in enumerate(segments):
        positions.append([])
        for i, (row, scale, s, t, k, w) in enumerate(seg):
            m = int(expert_offsets[j]) + i
            expert_x[m] = row
            if expert_scale is not None:
                expert_scale[m] = scale
            row_src[m] = (s, t, k)
            row_weight[m] = w
            positions[j].append(m)
    return dict(expert_x=expert_x, expert_scale=expert_scale, tokens_per_expert=tokens_per_expert,
                expert_offsets=expert_offsets, row_src=row_src, row_weight=row_weight), positions
