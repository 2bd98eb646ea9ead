"""A whole group of R ranks in one process, run with one set of epkit's local kernels.

count words -> plans -> pack -> the dispatch exchange as byte slicing -> unpack -> gather_rows ->
the reverse exchange as row slicing -> reduce_tokens, and every backward kernel the same way.
Run with the C++ kernels on CPU and with the Triton kernels (interpreted on CPU tensors here,
compiled on CUDA tensors on a GPU machine), every intermediate must agree bit for bit, the
combine weight gradient included. No process group is involved, so group sizes above one are
tested in one process (on a single GPU there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epkit import moves, ops, payloads
from epkit import plan as W
from epkit.collectives import dtype_code
from epkit.collectives import CODES

SL = W.plan_slices
# The real-GPU tests' mark (here, not in conftest.py: `import conftest` may find another
# directory's conftest when pytest runs several test folders).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Triton:
    """The Triton kernels as a table with the ops' names (``epkit.triton``'s functions, called
    directly: this process keeps the C++ kernels behind ``torch.ops.epkit``). An op without a
    Triton kernel is an AttributeError: every op must have one."""

    def __init__(self):
        from epkit import triton as kernels

        self._found, self.missing = kernels.implementations()

    def __getattr__(self, name):
        try:
            return self.__dict__["_found"][name]
        except KeyError:
            raise AttributeError(f"epkit.triton has no kernel for {name}") from None


CPP = ops.C  # the C++ kernels


def quantize(C, payload: str, x):
    """The payload's quantize through the table ``C`` (q, scales)."""
    return getattr(C, f"quantize_{payload}")(x.contiguous())


def make_case(R, L, K, H, Ts, dtype, seed, unused=0.2, hot=False):
    """Per rank: x [T, H], topk_idx [T, K] (distinct experts per row, some -1), weights."""
    E = R * L
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for T in Ts:
        idx = np.full((T, K), -1, np.int64)
        for t in range(T):
            experts = rng.permutation(E)[:K]
            if hot and 0 not in experts[1:]:
                experts[0] = 0
            used = rng.random(K) >= unused
            idx[t, used] = experts[used]
        xs.append(torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(dtype))
        idxs.append(torch.from_numpy(idx))
        ws.append(torch.from_numpy(rng.random((T, K)).astype(np.float32)))
    return E, xs, idxs, ws


def _chunks(buf, sizes):
    out, at = [], 0
    for n in sizes:
        out.append(buf[at: at + n])
        at += n
    return out


def _row_blocks(hp, R, E, counts):
    """(start, length) per peer of a row-space buffer: static chunks of 1 + cap rows (whole,
    header included: the static exchange moves whole chunks), else compact runs."""
    cap = int(hp[W.STATIC_CAP])
    if cap >= 0:
        return [(p * (1 + cap), 1 + cap) for p in range(R)]
    c = hp[SL(R, E)[counts]].tolist()
    starts = np.concatenate([[0], np.cumsum(c)[:-1]]).tolist() if R else []
    return list(zip(starts, c))


def _move_rows(bufs, hps, R, E, reverse):
    """The row-space exchange: source -> expert rows (combine backward's direction), or with
    ``reverse`` expert -> source rows (combine's and dispatch backward's)."""
    counts = "recv_counts" if reverse else "send_counts"
    out = []
    for me in range(R):
        parts = []
        for peer in range(R):
            a, n = _row_blocks(hps[peer], R, E, counts)[me]
            parts.append(bufs[peer][a: a + n])
        out.append(torch.cat(parts))
    return out


def _dispatch(C, case, align, capacity, transport, exchange, max_tokens, device, payload=None):
    """The dispatch half on `device`: words, plans, pack, the byte exchange, unpack. Returns
    (out, inputs, hps): out holds the intermediates, inputs (xs, idxs, ws) on the device."""
    E, xs, idxs, ws = case
    R = len(xs)
    dev = torch.device(device)
    xs = [x.to(dev) for x in xs]
    idxs = [i.to(dev) for i in idxs]
    ws = [w.to(dev) for w in ws]
    tr = W.TRANSPORTS[transport]
    cap = -1 if capacity is None else capacity
    H, K = xs[0].shape[1], idxs[0].shape[1]
    if exchange == "static" and max_tokens < 0:
        max_tokens = max(x.shape[0] for x in xs)
    out = {}
    rows, dtype, width = xs, xs[0].dtype, H
    pl = payloads.TABLE[payload]
    if pl.quantized:  # rows travel as bytes: H E4M3 elements, then the H / block scales
        q = [quantize(C, payload, x) for x in xs]
        out["q"], out["codes"] = [a for a, _ in q], [b for _, b in q]
        # the wire rows (Payload.to_rows, from the table's own quantizer)
        rows = [torch.cat([a.view(torch.uint8), b.contiguous().view(torch.uint8)], dim=1)
                for a, b in q]
        dtype, width = torch.uint8, pl.row_bytes(H, 1)
    words = torch.stack([C.prepare(x, i, w, E, R, [0, 0, 0, dtype_code(x.dtype), max_tokens],
                                   pl.code) for x, i, w in zip(xs, idxs, ws)])
    plans = [C.plan(words, r, E, align, cap, tr, CODES[exchange], max_tokens) for r in range(R)]
    if tr == W.DEDUP and int(plans[0].cpu()[W.DROPPED_ANY]):
        # count_exchange's second all-gather: every rank's kept token rows, and the plans again
        words = words.clone()
        words[:, W.WORD_HEADER + E:] = torch.stack(
            [moves.kept_token_rows(idxs[r], plans[r], W.host_words(plans[r]))
             for r in range(R)])
        plans = [C.plan(words, r, E, align, cap, tr, CODES[exchange], max_tokens)
                 for r in range(R)]
    hps = [p.cpu() for p in plans]
    out["words"], out["plans"] = words, plans
    packed = [C.pack(rows[r], idxs[r], ws[r], plans[r], tr, R, int(hps[r][W.SEND_BYTES]))
              for r in range(R)]
    out["send"] = [p[0] for p in packed]
    out["send_map"] = [p[1] for p in packed]
    recvs = [torch.cat([_chunks(out["send"][s], hps[s][SL(R, E)["send_bytes"]].tolist())[d]
                        for s in range(R)]) for d in range(R)]
    ups = [C.unpack(recvs[d], plans[d], tr, width, dtype, K, int(hps[d][W.RECV_ROWS]),
                    int(hps[d][W.EXPERT_ROWS])) for d in range(R)]
    for n, name in enumerate(("expert_x", "row_src", "row_weight", "recv_map")):
        out[name] = [u[n] for u in ups]
    return out, (xs, idxs, ws), hps


def _to_cpu(out: dict) -> dict:
    return {k: ([t.cpu() for t in v] if isinstance(v, list) else
                tuple([t.cpu() for t in part] for part in v) if isinstance(v, tuple) else v.cpu())
            for k, v in out.items()}


def run(case, *, align=1, capacity=None, transport="dedup", exchange="ragged",
        max_tokens=-1, weighted=True, y_dtype=torch.float32, device="cpu", seed=0, C=CPP):
    """Every intermediate of a dispatch -> combine -> backward round with the kernels ``C``,
    as CPU tensors."""
    E = case[0]
    R = len(case[1])
    tr = W.TRANSPORTS[transport]
    out, (xs, idxs, ws), hps = _dispatch(C, case, align, capacity, transport, exchange,
                                         max_tokens, device)
    dev = xs[0].device
    smaps = out["send_map"]
    ups = list(zip(out["expert_x"], out["row_src"], out["row_weight"], out["recv_map"]))

    # Expert outputs and gradients: deterministic on either device (NaN on padding rows).
    g = torch.Generator().manual_seed(seed)
    ys, gexs = [], []
    for u in ups:
        pad = (u[1][:, 0] < 0).unsqueeze(1)
        y = torch.where(pad, torch.tensor(float("nan"), device=dev), u[0].float() * 2.0)
        ys.append(y.to(y_dtype))
        ge = torch.randn(u[0].shape, generator=g).to(xs[0].dtype).to(dev)
        gexs.append(torch.where(pad, torch.tensor(float("nan"), device=dev).to(ge.dtype), ge))
    gouts = [torch.randn(x.shape, generator=g).to(x.dtype).to(dev) for x in xs]
    gws = [torch.randn(u[0].shape[0], generator=g).to(dev) for u in ups]

    # combine. dedup: every token row's 4H bytes travel whole here (the op moves only the
    # rows it uses, epkit.moves.move_back); reduce_tokens reads them in y's dtype with the kept
    # routing.
    def back_of(b, dtype):
        return b if tr == W.PAIRS else b.view(dtype)

    kidx = [idxs[s] if tr == W.PAIRS else moves.kept_routing(idxs[s], out["plans"][s], hps[s])
            for s in range(R)]
    rows = [C.gather_rows(ys[d], ups[d][3], ups[d][2], tr, weighted) for d in range(R)]
    backs = _move_rows(rows, hps, R, E, True)
    out["gather_rows"] = rows
    out["combine"] = [C.reduce_tokens(back_of(backs[s], y_dtype), smaps[s], kidx[s], ws[s], E,
                                      R, tr, weighted, xs[s].dtype) for s in range(R)]
    # dispatch backward: gradient rows, then the weight gradient per slot
    empty = torch.zeros(0, device=dev)
    grows = [C.gather_rows(gexs[d], ups[d][3], empty, tr, False) for d in range(R)]
    gbacks = _move_rows(grows, hps, R, E, True)
    out["grad_x"] = [C.reduce_tokens(back_of(gbacks[s], gexs[s].dtype), smaps[s], kidx[s],
                                     empty, E, R, tr, False, xs[s].dtype) for s in range(R)]
    # (one float32 per kept slot, placed by moves.slot_places: both sides from their own maps)
    at = [moves.slot_places(hps[r], ups[r][3], smaps[r], kidx[r], tr) for r in range(R)]
    vals = [C.gather_slot_values(gws[d], ups[d][3], at[d].first, at[d].rows) for d in range(R)]
    out["slot_values"] = vals
    vbacks = [torch.cat([_chunks(vals[d], at[d].send)[s] for d in range(R)]) for s in range(R)]
    out["grad_w_dispatch"] = [C.scatter_slot_values(vbacks[s], smaps[s], kidx[s], at[s].first_src,
                                                    E, R, tr) for s in range(R)]
    # combine backward
    srows = [C.scatter_rows(gouts[s], smaps[s], int(hps[s][W.SEND_ROWS])) for s in range(R)]
    out["scatter_rows"] = srows
    frows = _move_rows(srows, hps, R, E, False)
    cb = [C.combine_backward_dest(frows[d], ups[d][3], ups[d][2], ys[d], weighted)
          for d in range(R)]
    out["grad_y"] = [c[0] for c in cb]
    out["grad_w_combine"] = [c[1] for c in cb]
    return _to_cpu(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (NaN payloads and signed zeros included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: dict, b: dict, skip=()):
    for name in a:
        if name in skip:
            continue
        for r, (x, y) in enumerate(zip(a[name], b[name])):
            assert x.dtype == y.dtype and x.shape == y.shape, (name, r, x.shape, y.shape)
            if not torch.equal(bits(x), bits(y)):
                diff = (bits(x) != bits(y)).nonzero()[:5].flatten().tolist()
                raise AssertionError(f"{name} of rank {r} differs (first differing bytes {diff})")


def run_payload(case, payload, *, align=1, capacity=None, transport="dedup", exchange="ragged",
                max_tokens=-1, device="cpu", C=CPP):
    """A quantized payload: quantize, pack the (E4M3 | scales) byte rows, unpack, with the
    kernels ``C``; as CPU tensors."""
    out, _, _ = _dispatch(C, case, align, capacity, transport, exchange, max_tokens, device,
                          payload=payload)
    return _to_cpu(out)
