"""Groups of R ranks in one process for the row-movement tests (pack, unpack): routing, the
count words and the plans from the C++ ops (``torch.ops.epkit.prepare`` / ``plan``), the
dispatch exchange as byte slicing. The payload rows are what travels (x itself, or a quantized
payload's wire rows from the C++ quantizer)."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from epkit import moves, payloads
from epkit import plan as W
from epkit.collectives import CODES, dtype_code

SL = W.plan_slices


@dataclasses.dataclass
class Group:
    R: int
    E: int
    K: int
    transport: int
    rows: list      # per rank: the payload rows pack moves [T, W] (x, or wire bytes)
    idxs: list
    ws: list
    plans: list
    hps: list       # host words (lists)

    def word(self, r, name):
        return self.hps[r][getattr(W, name)]

    def section(self, r, name):
        return self.hps[r][SL(self.R, self.E)[name]]

    def recv(self, sends):
        """The dispatch exchange: rank d receives chunk d of every rank's send buffer."""
        out = []
        for d in range(self.R):
            parts = []
            for s in range(self.R):
                nb = self.section(s, "send_bytes")
                at = sum(nb[:d])
                parts.append(sends[s][at: at + nb[d]])
            out.append(torch.cat(parts))
        return out


def routing(R, L, K, Ts, seed, unused=0.2, hot=False, dup=False):
    """Per rank topk_idx [T, K] (distinct experts, some -1; ``hot``: expert 0 in every row, for
    capacity drops; ``dup``: a row may name an expert twice) and weights [T, K] float32."""
    E = R * L
    rng = np.random.default_rng(seed)
    idxs, ws = [], []
    for T in Ts:
        idx = np.full((T, K), -1, np.int64)
        for t in range(T):
            ex = rng.permutation(max(E, K))[:K] % E if K > E else rng.permutation(E)[:K]
            if hot and K and 0 not in ex[1:]:
                ex[0] = 0
            if dup and K > 1 and rng.random() < 0.3:
                ex[1] = ex[0]
            used = rng.random(K) >= unused
            idx[t, used] = ex[used]
        idxs.append(torch.from_numpy(idx))
        ws.append(torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32)))
    return E, idxs, ws


def make_group(C, R, L, K, Ts, H, transport="pairs", exchange="ragged", capacity=None,
               payload=None, dtype=torch.bfloat16, align=1, seed=0, hot=False, unused=0.2,
               dup=False, idx_dtype=torch.int64):
    E, idxs, ws = routing(R, L, K, Ts, seed, unused=unused, hot=hot, dup=dup)
    idxs = [i.to(idx_dtype) for i in idxs]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=g).to(dtype) for T in Ts]
    tr = W.TRANSPORTS[transport]
    cap = -1 if capacity is None else capacity
    max_tokens = max(Ts) if exchange == "static" else -1
    pl = payloads.TABLE[payload]
    rows = xs
    if pl.quantized:  # the wire rows: H E4M3 bytes, then the H / block scales
        q = [getattr(C, f"quantize_{payload}")(x.float().contiguous()) for x in xs]
        rows = [torch.cat([a.view(torch.uint8), b.contiguous().view(torch.uint8)], dim=1)
                for a, b in q]
    xdt = torch.float32 if pl.quantized else dtype
    words = torch.stack([C.prepare(x.to(xdt), i, w, E, R, [0, 0, 0, dtype_code(xdt), max_tokens],
                                   pl.code) for x, i, w in zip(xs, idxs, ws)])
    plans = [C.plan(words, r, E, align, cap, tr, CODES[exchange], max_tokens) for r in range(R)]
    if tr == W.DEDUP and int(plans[0][W.DROPPED_ANY]):
        words = words.clone()  # the count exchange's second all-gather, then the plans again
        words[:, W.WORD_HEADER + E:] = torch.stack(
            [moves.kept_token_rows(idxs[r], plans[r], W.host_words(plans[r]))
             for r in range(R)])
        plans = [C.plan(words, r, E, align, cap, tr, CODES[exchange], max_tokens)
                 for r in range(R)]
    for p in plans:
        assert int(p[W.ERR_CODE]) == 0, p[:4]
    return Group(R, E, K, tr, rows, idxs, ws, plans, [p.tolist() for p in plans])


@contextlib.contextmanager
def _disjoint_rows(kernel, grid, args, constexprs):
    """A launch hook: the row writer's output rows never overlap (one writer per byte), and
    it reads nothing it writes (source and output are different memory)."""
    from epkit.triton import byterows

    if kernel is byterows._rows_kernel:
        out, src, out_off, P, U = args[0], args[1], args[2], args[7], constexprs["U"]
        width = P * U + 4 * constexprs["NW"]  # bytes of a row
        starts = torch.sort(out_off[out_off >= 0]).values
        assert bool((starts.diff() >= width).all()), "two rows of one launch overlap"
        if out.numel() and src.numel():
            o0, s0 = out.data_ptr(), src.data_ptr()
            o1, s1 = o0 + out.numel() * out.element_size(), s0 + src.numel() * src.element_size()
            assert o1 <= s0 or s1 <= o0, "the writer reads the memory it writes"
    yield


def check_launches():
    """Install :func:`_disjoint_rows` for a test (a fixture's body)."""
    from epkit.triton import _runtime

    _runtime.LAUNCH_HOOKS.append(_disjoint_rows)
    return lambda: _runtime.LAUNCH_HOOKS.remove(_disjoint_rows)
