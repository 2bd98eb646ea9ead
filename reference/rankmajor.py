"""Rank-major output: the dedup transport's receive buffer, computed directly.

On rank ``d`` the rows are the tokens (s, t) with a *kept* slot on d (``is_token_in_rank_s[t,
d]`` without capacity; a token whose slots on d were all dropped does not appear: it never
travels there), ordered by s then t:

    recv_x            [N, H] x dtype (E4M3 under a quantized payload)   x_s[t]
    recv_scale        [N, H/block] or None                the payload's scales of x_s[t]
    recv_topk_idx     [N, K] int64     local expert id of slot k if used, kept and on d; else -1
    recv_topk_weights [N, K] float32   topk_weights_s[t, k] where the id is >= 0; else 0.0
    recv_src          [N, 2] int64     (s, t)

The dedup transport produces exactly these arrays on the wire (transports/dedup.py); the pairs
transport has no such buffer, so a pairs run computes them with this module.
"""

from __future__ import annotations

import numpy as np

from .records import Group


def rank_major_fields(group: Group, d: int, rows, scales, idx, ws, kept) -> dict:
    """Rank-major fields of rank d: a dict recv_x, recv_scale, recv_topk_idx, recv_topk_weights,
    recv_src (module docstring). ``rows``/``scales`` as payloads.wire_rows returns them."""
    L, K = group.num_local_experts, group.topk
    src, ids, wts = [], [], []
    for s in range(group.num_ranks):
        for t in range(idx[s].shape[0]):
            on_d = [int(e) >= 0 and int(e) // L == d for e in idx[s][t]]
            local = [int(idx[s][t, k]) - d * L if on_d[k] and kept[s][t, k] else -1 for k in range(K)]
            if max(local, default=-1) < 0:
                continue                                  # no kept slot on d: no row
            src.append((s, t))
            ids.append(local)
            wts.append([ws[s][t, k] if local[k] >= 0 else 0.0 for k in range(K)])
    N = len(src)
    recv_x = np.zeros((N, group.hidden), group.row_dtype)
    recv_scale = group.payload_of.zero_scales(N, group.hidden)
    for n, (s, t) in enumerate(src):
        recv_x[n] = rows[s][t]
        if scales is not None:
            recv_scale[n] = scales[s][t]
    return dict(recv_x=recv_x, recv_scale=recv_scale,
                recv_topk_idx=np.array(ids, np.int64).reshape(N, K),
                recv_topk_weights=np.array(wts, np.float32).reshape(N, K),
                recv_src=np.array(src, np.int64).reshape(N, 2))
