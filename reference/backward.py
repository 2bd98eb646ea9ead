"""Backward passes of dispatch and combine.

dispatch_backward
    ``grad_x_r[t]`` is combine's two-level sum (arith.py), unweighted, over the gradient rows of
    t's kept slots; padding-row gradients are ignored; cast to x's dtype. Gradient rows are
    float32 or bfloat16 (under a quantized payload the backward stays in the unquantized dtype).

combine_backward
    The gradient of row ``(s, t, k)`` of ``expert_y`` is ``cast(c_k * grad_out_s[t])`` (one
    float32 multiply, cast to y's dtype, RNE), with ``c_k`` the row's weight when weighted,
    else 1; padding rows get 0. When weighted, ``grad_topk_weights_s[t, k] =
    <grad_out_s[t], y(s, t, k)>`` (arith.weight_grad_dot: float64, rounded once; compared with
    the tolerance of docs/design.md item 6); 0 for unused or dropped slots and everywhere when
    unweighted. ``topk_idx`` gets no gradient.

Adjointness: ``<dispatch(x), g> == <x, dispatch_backward(g)>`` and
``<combine(y), g> == <y, combine_backward(g)>`` exactly whenever every value and every
partial sum is exactly representable (small integers).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from . import transports
from .arith import scaled, weight_grad_dot
from .combine import sums_back
from .records import DispatchResult
from .validate import check_results, check_rows


def dispatch_backward(grad_expert_xs: Sequence[np.ndarray], res: Sequence[DispatchResult]
                      ) -> List[np.ndarray]:
    """Gradient of dispatch with respect to x.

    Args:
        grad_expert_xs: R arrays [M_d, H] float32 or bfloat16.
        res: the R results of the dispatch.
    Returns:
        R arrays [T_r, H] in x's dtype.
    """
    check_results(res)
    gs = check_rows(grad_expert_xs, [(r.num_rows, r.group.hidden) for r in res], grad=True)
    sums = sums_back(gs, res, weighted=False)
    return [s.astype(r.group.x_dtype) for s, r in zip(sums, res)]


def combine_backward(grad_outs: Sequence[np.ndarray], expert_ys: Sequence[np.ndarray],
                     res: Sequence[DispatchResult], weighted: bool = True
                     ) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """Gradients of combine with respect to expert_y and topk_weights.

    Args:
        grad_outs: R arrays [T_r, H] float32 or bfloat16.
        expert_ys: R arrays [M_d, H] float32 or bfloat16 (the combine's input).
        res: the R results of the dispatch.
        weighted: as in the combine.
    Returns:
        (grad_expert_ys: R arrays [M_d, H] in y's dtype, grad_topk_weights: R arrays [T_r, K]
        float32).
    """
    check_results(res)
    gs = check_rows(grad_outs, [(r.source.num_tokens, r.group.hidden) for r in res], grad=True)
    ys = check_rows(expert_ys, [(r.num_rows, r.group.hidden) for r in res], grad=False)
    carried = transports.of_results(res)
    if carried is not None:
        gys, gws, _ = carried.combine_backward(res, gs, ys, weighted)
        return gys, gws
    gys = [np.zeros(y.shape, y.dtype) for y in ys]
    gws = [np.zeros((r.source.num_tokens, r.group.topk), np.float32) for r in res]
    for d, r in enumerate(res):
        for m, (s, t, k) in enumerate(r.row_src.tolist()):
            if s < 0:
                continue                                   # padding
            gys[d][m] = scaled(r.row_weight[m] if weighted else 1, gs[s][t], ys[d].dtype)
            if weighted:
                gws[s][t, k] = weight_grad_dot(gs[s][t], ys[d][m])
    return gys, gws
