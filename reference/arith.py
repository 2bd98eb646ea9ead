"""The exact arithmetic of combine and the backward passes, in one place.

Every operation is float32 and rounded on its own (NumPy never fuses a multiply and an add):

    partial_sum   P_d(t) = (((+0.0 + c_0 * y_0) + c_1 * y_1) + ...)    over the slots of t on d,
                  k ascending; each c * y one float32 multiply, each + one float32 add, with y
                  widened to float32 first (exact for bfloat16)
    total_sum     out(t) = (((+0.0 + P_0) + P_1) + ...)                over d = 0..R-1 ascending
    grouped_total_sum  with ``ranks_per_node = G > 1``: out(t) = +0.0 + N_0 + N_1 + ... over
                  nodes ascending, N_n = +0.0 + P_{nG} + ... + P_{nG+G-1} (the node partial);
                  for G = 1 bitwise equal to total_sum
    cast          to x's dtype, round to nearest even (ml_dtypes)

Skipping a rank that holds none of t's slots (its P_d is +0.0) cannot change a bit: a sum that
starts at +0.0 is never -0.0 under round-to-nearest, and ``v + (+0.0) == v`` for every other
float32 ``v``. The dedup transport therefore sends only the partials of ranks a token visits.

Never use np.sum / np.dot / np.add.reduce for these sums: NumPy sums pairwise, which changes
bits. The weight gradient is the exception (a stated tolerance, docs/design.md item 6): it is
accumulated in float64, h ascending, and rounded once to float32.
"""

from __future__ import annotations

from typing import Iterable, Tuple

import numpy as np

F32 = np.float32


def partial_sum(terms: Iterable[Tuple[np.float32, np.ndarray]], hidden: int) -> np.ndarray:
    """``+0.0 + c_0*y_0 + c_1*y_1 + ...`` in float32, left to right.

    Args: terms: ``(c, y)`` pairs in k order, c float32, y [H] float32 or bfloat16.
    Returns: [H] float32.
    """
    acc = np.zeros(hidden, F32)
    for c, y in terms:
        acc = acc + F32(c) * y.astype(F32)
    return acc


def total_sum(partials: Iterable[np.ndarray], hidden: int) -> np.ndarray:
    """``+0.0 + P_0 + P_1 + ...`` in float32, left to right (partials in rank order)."""
    acc = np.zeros(hidden, F32)
    for p in partials:
        acc = acc + p
    return acc


def grouped_total_sum(partials: Iterable[Tuple[int, np.ndarray]], ranks_per_node: int,
                      hidden: int) -> np.ndarray:
    """The total over nodes: ``out(t) = +0.0 + N_0 + N_1 + ...`` over nodes ``n`` ascending, with
    the node partial ``N_n = +0.0 + P_{nG} + P_{nG+1} + ...`` over node n's ranks ascending
    (``G = ranks_per_node``; rank d is on node ``d // G``), every sum float32, left to right.

    Args: partials: ``(d, P_d)`` pairs, d strictly ascending, P_d [H] float32; a rank left out
    counts as ``P_d = +0.0`` and a node with none as ``N_n = +0.0`` (exact: adding +0.0 to a sum
    that started at +0.0 changes no bit). Returns: [H] float32.

    With ``G = 1`` this is :func:`total_sum` bit for bit: ``N_d = +0.0 + P_d`` differs from P_d
    only for ``P_d = -0.0`` (it becomes +0.0), and the running total, which starts at +0.0 and
    is never -0.0, is unchanged by adding either zero.
    """
    nodes: dict = {}
    last = -1
    for d, p in partials:
        assert d > last, "partials in ascending rank order"
        last = d
        nodes.setdefault(d // ranks_per_node, []).append(p)
    return total_sum((total_sum(ps, hidden) for _, ps in sorted(nodes.items())), hidden)


def scaled(c, g: np.ndarray, dtype) -> np.ndarray:
    """Gradient of one expert_y row: ``cast(c * g)``, one float32 multiply, cast to y's dtype."""
    return (F32(c) * np.asarray(g).astype(F32)).astype(dtype)


def weight_grad_dot(g: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``<g, y>`` per row, accumulated in float64 over h ascending, rounded to float32.

    Args: g, y: [n, H] float32 or bfloat16 (or [H]). Returns [n] float32 (or a float32 scalar).
    Products of float32 values are exact in float64; the error is in the sum only.
    """
    g = np.asarray(g).astype(np.float64)
    y = np.asarray(y).astype(np.float64)
    acc = np.zeros(g.shape[:-1], np.float64)
    for h in range(g.shape[-1]):
        acc = acc + g[..., h] * y[..., h]
    return acc.astype(F32)
