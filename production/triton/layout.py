"""``layout`` and ``prepare`` on any device (cpu/layout.cpp): the routing's counts and the count
words this rank contributes to the count exchange.

``prepare`` (the dispatch's path) is two launches and no host read: the scan (one program per
block of tokens) finds its block's verdicts (the first id out of range and that id, the first
row naming an expert twice and its smallest such expert, the first non-finite weight row, the
first non-finite payload row: each "first" within the block) and its counts (slots per expert,
tokens per rank); one program then takes each verdict from the first block that has one (the
blocks are in token order), picks the error in cpu/layout.cpp's order (index range, duplicate
expert, non-finite weight, H % block, non-finite payload, static overflow), adds up the blocks'
counts and writes the words, which the group agrees on after the all-gather. Only metadata
(shapes, dtypes, option values) raises here, as the C++ checks (checks.h) do. Floats are
judged by their bits (an all-ones exponent), so no float is converted.

``layout`` is a standalone query (not on the dispatch path), written as device-generic torch
ops: it *raises* on an expert id outside [-1, E) (as the C++ op does), its one host read (the
first bad position and its id, read together). Counting uses integer scatters
(``scatter_add_``; integer sums do not depend on their order).
"""

from __future__ import annotations

import torch

from ._runtime import INTERPRETED, launch, tl, triton
from .abi import (REASON_DUPLICATE_EXPERT, REASON_HIDDEN_NOT_MULT32, REASON_INDEX_OUT_OF_RANGE,
                  REASON_NONFINITE_PAYLOAD, REASON_NONFINITE_WEIGHT, REASON_STATIC_OVERFLOW,
                  WORD_ERROR_A, WORD_ERROR_B, WORD_ERROR_CODE, WORD_HEADER, WORD_HIDDEN,
                  WORD_PAYLOAD, WORD_TOKENS, WORD_TOPK, WORD_X_DTYPE)
from epkit.reference import abi

from .rowchecks import check_layout_args, fail
from .wirechecks import BLOCKS as _BLOCKS
from .wirechecks import PRE as _PRE
from .wirechecks import check_prepare_args

__all__ = ["layout", "prepare", "counts"]



# ---- device-generic pieces ----------------------------------------------------------------------
def _first(mask: torch.Tensor) -> torch.Tensor:
    """The first True of the 1-D ``mask`` as a 0-d int64 tensor, -1 if none (argmax returns the
    first maximum; no host read)."""
    if mask.numel() == 0:
        return torch.full((), -1, dtype=torch.int64, device=mask.device)
    return torch.where(mask.any(), mask.to(torch.uint8).argmax(), -1)


def _at(values: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``values[i]`` for a 0-d index tensor (clamped: a -1 "none" reads entry 0, unused), read on
    the device (a 0-d tensor index would be turned into a Python int, a host read)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=values.device)
    return values.gather(0, i.clamp(min=0).view(1)).view(())


def counts(idx: torch.Tensor, E: int, R: int, with_slots: bool = False):
    """Used-slot counts of ``idx`` [T, K] int64 (ids in [-1, E)): ``(tokens_per_expert [E],
    tokens_per_rank [R], slots_per_rank [R] or None, is_token_in_rank [T, R] bool)``. Entries
    outside [0, E) count nowhere (they land in a spare bin that is cut off)."""
    T, K = idx.shape
    L = E // R
    valid = (idx >= 0) & (idx < E)
    ones = torch.ones_like(idx)
    tpe = idx.new_zeros(E + 1).scatter_add_(0, torch.where(valid, idx, E).view(-1), ones.view(-1))
    dest = torch.where(valid, idx.div(L, rounding_mode="floor"), R)  # [T, K], R: no rank
    # One writer value (1) per (token, rank): a scatter of equal values is order-free.
    in_rank = torch.zeros((T, R + 1), dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, dest, True)
    in_rank = in_rank[:, :R].contiguous()
    tpr = in_rank.sum(0, dtype=torch.int64)
    spr = None
    if with_slots:
        spr = idx.new_zeros(R + 1).scatter_add_(0, dest.view(-1), ones.view(-1))[:R]
    return tpe[:E], tpr, spr, in_rank


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(tokens_per_expert [E], tokens_per_rank [R], slots_per_rank [R], is_token_in_rank
    [T, R] bool)`` of ``topk_idx`` [T, K] (any integer dtype; -1: an unused slot), all int64 but
    the last. Raises for an id outside [-1, E), the first in (t, k) order, as cpu/layout.cpp."""
    op = "epkit.layout"
    E, R = int(num_experts), int(num_ranks)
    check_layout_args(topk_idx, E, R)
    idx = topk_idx.to(torch.int64).contiguous()
    T, K = idx.shape
    flat = idx.view(-1)
    bad = _first((flat < -1) | (flat >= E))
    # The standalone op raises like the C++ one: its one host read (the dispatch uses prepare,
    # which carries the error in its words instead).
    i, e = torch.stack([bad, _at(flat, bad)]).tolist()
    if i >= 0:
        fail(op, f"topk_idx[{i // K}, {i % K}] = {e} outside [-1, {E})")
    tpe, tpr, spr, in_rank = counts(idx, E, R, with_slots=True)
    return tpe, tpr, spr, in_rank


# ---- prepare ----------------------------------------------------------------------------------
# found: [6] int64, the value checks' verdicts (-1: none): flat index of the first id out of
# range, that id, first row naming an expert twice, that row's smallest such expert, first row
# with a non-finite weight, first row with a non-finite payload value.
_F_RANGE = tl.constexpr(0)
_F_RANGE_VALUE = tl.constexpr(1)
_F_DUP = tl.constexpr(2)
_F_DUP_EXPERT = tl.constexpr(3)
_F_WEIGHT = tl.constexpr(4)
_F_PAYLOAD = tl.constexpr(5)
_F_WORDS = tl.constexpr(6)  # a block's verdict words
_NONE = tl.constexpr(1 << 62)  # above every flat index: "not found" inside a min


@triton.jit
def _nonfinite(bits, XBITS: tl.constexpr):
    """Whether the float of these bits (int16: bfloat16, int32: float32) is NaN or infinite:
    its exponent is all ones (read from the bits: no float conversion)."""
    if XBITS == 16:
        return (bits.to(tl.int32) & 0x7F80) == 0x7F80
    else:
        return (bits & 0x7F800000) == 0x7F800000


@triton.jit
def _scan_kernel(idx, w, x, found, counts, T, K, E, L, R, H, CHECK_X: tl.constexpr,
                 XBITS: tl.constexpr, TB: tl.constexpr, KC: tl.constexpr, VB: tl.constexpr):
    """Tokens [pid * TB, +TB): this block's verdicts found[pid] [6] int64 (the first id out of
    [-1, E) by flat index t * K + k and that id; the first row naming an expert twice and its
    smallest such expert; the first row with a non-finite weight; with CHECK_X the first with a
    non-finite payload value: -1 where none) and its counts counts[pid] [E + R] int64 (slots per
    expert, tokens with a slot on each rank). idx [T, K] int64, w [T, K] float32 and x [T, H]
    as integer bits. Tiles of TB tokens x KC slots (or VB values): the top-k is walked in
    chunks, so no tile grows with it."""
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * TB + tl.arange(0, TB)
    tm = t < T
    kc = tl.arange(0, KC)
    no = tm & (t < 0)
    first_k = tl.zeros([TB], tl.int64) + K  # each row's first slot out of range (K: none)
    first_v = tl.zeros([TB], tl.int64)
    dup_row = no
    dup_min = tl.zeros([TB], tl.int64) + E
    bad_w = no
    for k0 in range(0, K, KC):
        k = k0 + kc
        m2 = tm[:, None] & (k[None, :] < K)
        ids = tl.load(idx + t[:, None] * K + k[None, :], mask=m2, other=-1)
        bad = m2 & ((ids < -1) | (ids >= E))
        fk = tl.min(tl.where(bad, k[None, :], K), 1)
        take = (first_k == K) & (fk < K)
        first_v = tl.where(take, tl.sum(tl.where(bad & (k[None, :] == fk[:, None]), ids, 0), 1),
                           first_v)
        first_k = tl.where(take, fk, first_k)
        wb = tl.load(w + t[:, None] * K + k[None, :], mask=m2, other=0)
        bad_w = bad_w | (tl.max((m2 & _nonfinite(wb, 32)).to(tl.int32), 1) > 0)
        # a row names an expert twice: a later slot repeats slot k1's id (not -1)
        for k1 in range(0, tl.minimum(k0 + KC, K)):
            col = tl.load(idx + t * K + k1, mask=tm, other=-1)
            again = m2 & (k[None, :] > k1) & (ids == col[:, None]) & (col[:, None] >= 0)
            hit = tl.max(again.to(tl.int32), 1) > 0
            dup_row = dup_row | hit
            dup_min = tl.where(hit, tl.minimum(dup_min, col), dup_min)
    f_range = tl.min(tl.where(first_k < K, t * K + first_k, _NONE), 0)
    v_range = tl.sum(tl.where((first_k < K) & (t * K + first_k == f_range), first_v, 0), 0)
    f_dup = tl.min(tl.where(dup_row, t, _NONE), 0)
    v_dup = tl.sum(tl.where(dup_row & (t == f_dup), dup_min, 0), 0)
    f_weight = tl.min(tl.where(bad_w, t, _NONE), 0)
    f_payload = tl.full([], _NONE, tl.int64)
    if CHECK_X:
        bad_x = no
        for h0 in range(0, H, VB):
            h = h0 + tl.arange(0, VB)
            mx = tm[:, None] & (h[None, :] < H)
            xb = tl.load(x + t[:, None] * H + h[None, :], mask=mx, other=0)
            bad_x = bad_x | (tl.max((mx & _nonfinite(xb, XBITS)).to(tl.int32), 1) > 0)
        f_payload = tl.min(tl.where(bad_x, t, _NONE), 0)
    out = found + pid.to(tl.int64) * _F_WORDS
    tl.store(out + _F_RANGE, tl.where(f_range == _NONE, -1, f_range))
    tl.store(out + _F_RANGE_VALUE, v_range)
    tl.store(out + _F_DUP, tl.where(f_dup == _NONE, -1, f_dup))
    tl.store(out + _F_DUP_EXPERT, v_dup)
    tl.store(out + _F_WEIGHT, tl.where(f_weight == _NONE, -1, f_weight))
    tl.store(out + _F_PAYLOAD, tl.where(f_payload == _NONE, -1, f_payload))
    # the counts: slots per expert (ids in [0, E)), tokens with a slot on each rank
    row = counts + pid.to(tl.int64) * (E + R)
    for v0 in range(0, E, VB):
        v = v0 + tl.arange(0, VB)
        n = tl.zeros([VB], tl.int64)
        for k1 in range(K):
            col = tl.load(idx + t * K + k1, mask=tm, other=-1)
            n += tl.sum((tm[:, None] & (col[:, None] == v[None, :])).to(tl.int64), 0)
        tl.store(row + v, n, mask=v < E)
    for v0 in range(0, R, VB):
        v = v0 + tl.arange(0, VB)
        on = (t[:, None] < 0) & (v[None, :] < 0)
        for k1 in range(K):
            col = tl.load(idx + t * K + k1, mask=tm, other=-1)
            d = tl.where((col >= 0) & (col < E), col // L, R)
            on = on | (tm[:, None] & (d[:, None] == v[None, :]))
        tl.store(row + E + v, tl.sum(on.to(tl.int64), 0), mask=v < R)


@triton.jit
def _first_found(found_ptr, NBLK, F: tl.constexpr, V: tl.constexpr):
    """(verdict F, word V) of the first block whose verdict F is not -1 (the
    blocks are in token order, so it is the first in the routing), (-1, 0) if none."""
    at = tl.full([], -1, tl.int64)
    value = tl.zeros([], tl.int64)
    for blk in range(NBLK):
        i = tl.load(found_ptr + blk * _F_WORDS + F)
        v = tl.load(found_ptr + blk * _F_WORDS + V)
        take = (at < 0) & (i >= 0)
        value = tl.where(take, v, value)
        at = tl.where(take, i, at)
    return at, value


@triton.jit(do_not_specialize=["E", "R", "T", "H", "K", "x_dtype", "payload", "pre_code",
                               "pre_a", "pre_b", "hidden_bad", "max_tokens", "NBLK"])
def _words_kernel(found_ptr, counts_ptr, words_ptr, E, R, T, H, K, x_dtype, payload,
                  pre_code, pre_a, pre_b, hidden_bad, max_tokens, NBLK, CHECK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program writes the whole word vector ``words`` [8 + E + R] int64: the header (the
    error in cpu/layout.cpp's order, then tokens, hidden, topk, x dtype, payload) and the counts
    (tokens per expert [E], tokens per rank [R]: the sums of the scan's blocks' ``counts``
    [NBLK, E + R] int64; zeros when there is an error). ``found`` [NBLK, 6] int64: each block's
    verdicts (_scan_kernel), of which the first block's that found one wins; read only when
    CHECK (pre_code == 0)."""
    E = E.to(tl.int64)
    R = R.to(tl.int64)
    code = pre_code.to(tl.int64)
    a = pre_a.to(tl.int64)
    b = pre_b.to(tl.int64)
    zero = E * 0
    if CHECK:
        i_range, range_value = _first_found(found_ptr, NBLK, _F_RANGE, _F_RANGE_VALUE)
        i_dup, dup_expert = _first_found(found_ptr, NBLK, _F_DUP, _F_DUP_EXPERT)
        i_weight, _w = _first_found(found_ptr, NBLK, _F_WEIGHT, _F_WEIGHT)
        i_payload, _p = _first_found(found_ptr, NBLK, _F_PAYLOAD, _F_PAYLOAD)
        # Latest check first, so the earliest failing check is the one left standing.
        code = tl.where((max_tokens >= 0) & (T > max_tokens), REASON_STATIC_OVERFLOW, zero)
        a = tl.where(code != 0, T.to(tl.int64), zero)
        b = tl.where(code != 0, max_tokens.to(tl.int64), zero)
        pc = tl.where(i_payload >= 0, REASON_NONFINITE_PAYLOAD, code)
        a = tl.where(i_payload >= 0, i_payload, a)
        b = tl.where(i_payload >= 0, payload.to(tl.int64), b)
        code = pc
        hc = tl.where(hidden_bad != 0, REASON_HIDDEN_NOT_MULT32, code)
        a = tl.where(hidden_bad != 0, H.to(tl.int64), a)
        b = tl.where(hidden_bad != 0, payload.to(tl.int64), b)
        code = hc
        wc = tl.where(i_weight >= 0, REASON_NONFINITE_WEIGHT, code)
        a = tl.where(i_weight >= 0, i_weight, a)
        b = tl.where(i_weight >= 0, zero, b)
        code = wc
        dc = tl.where(i_dup >= 0, REASON_DUPLICATE_EXPERT, code)
        a = tl.where(i_dup >= 0, i_dup, a)
        b = tl.where(i_dup >= 0, dup_expert, b)
        code = dc
        rc = tl.where(i_range >= 0, REASON_INDEX_OUT_OF_RANGE, code)
        a = tl.where(i_range >= 0, range_value, a)
        b = tl.where(i_range >= 0, E, b)
        code = rc
        tl.store(words_ptr + WORD_TOKENS, T.to(tl.int64))
        tl.store(words_ptr + WORD_HIDDEN, H.to(tl.int64))
        tl.store(words_ptr + WORD_TOPK, K.to(tl.int64))
    else:
        tl.store(words_ptr + WORD_TOKENS, zero)
        tl.store(words_ptr + WORD_HIDDEN, zero)
        tl.store(words_ptr + WORD_TOPK, zero)
    tl.store(words_ptr + WORD_ERROR_CODE, code)
    tl.store(words_ptr + WORD_ERROR_A, a)
    tl.store(words_ptr + WORD_ERROR_B, b)
    tl.store(words_ptr + WORD_X_DTYPE, x_dtype.to(tl.int64))
    tl.store(words_ptr + WORD_PAYLOAD, payload.to(tl.int64))
    # The counts, or zeros when this rank's words carry an error.
    offs = tl.arange(0, BLOCK).to(tl.int64)
    keep = (offs * 0 + code) == 0  # a tensor mask (the interpreter mistypes splatted scalars)
    n = E + R
    for i in range(0, tl.cdiv(n, BLOCK)):
        o = i * BLOCK + offs
        inside = o < n
        v = o * 0
        if CHECK:
            for blk in range(NBLK):
                v += tl.load(counts_ptr + blk * n + o, mask=inside & keep, other=0)
        tl.store(words_ptr + WORD_HEADER + o, v, mask=inside)


_BLOCK = 128
SCAN_TB = 1024 if INTERPRETED else 32  # tokens a program of the scan
SCAN_KC = 16                           # slots a step
SCAN_VB = 64                           # experts, ranks or payload values a step
def prepare(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            num_experts: int, num_ranks: int, pre_error: list, payload: int) -> torch.Tensor:
    """The count words ``[8 + E + R]`` int64 of this rank (abi.WORD_FIELDS, then tokens per
    expert, tokens per rank), on ``topk_idx``'s device. ``x`` [T, H] float32 / bfloat16,
    ``topk_idx`` [T, K] any integer dtype, ``topk_weights`` [T, K] float32; ``pre_error`` =
    [code, a, b(, x dtype code(, max_tokens_per_rank))]: a nonzero code is the caller's own
    verdict, which travels as is (the tensors are then not looked at)."""
    E, R, payload = int(num_experts), int(num_ranks), int(payload)
    pre = [int(v) for v in pre_error]
    check_prepare_args(x, topk_idx, topk_weights, E, R, pre, payload)
    dev = topk_idx.device
    words = torch.empty(abi.WORD_HEADER + E + R, dtype=torch.int64, device=dev)
    x_dtype = pre[_PRE["x_dtype"]] if len(pre) > _PRE["x_dtype"] else 0
    max_tokens = pre[_PRE["max_tokens"]] if len(pre) > _PRE["max_tokens"] else -1
    if pre[0] != 0:
        launch(_words_kernel, (1,), words, words, words, E, R, 0, 0, 0, x_dtype, payload,
               pre[0], pre[1], pre[2], 0, -1, 0, CHECK=False, BLOCK=_BLOCK)
        return words
    # Two launches: the scan's blocks find their verdicts and counts, one program adds them up
    # and writes the words (no host read, nothing sized by the data).
    idx = topk_idx.to(torch.int64).contiguous()
    T, K = idx.shape
    H = x.shape[1]
    block = _BLOCKS[payload]
    xbits = x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)
    wbits = topk_weights.contiguous().view(torch.int32)
    nblk = max(1, -(-T // SCAN_TB))
    found = torch.empty((nblk, _F_WORDS.value), dtype=torch.int64, device=dev)
    sums = torch.empty((nblk, E + R), dtype=torch.int64, device=dev)
    launch(_scan_kernel, (nblk,), idx, wbits, xbits, found, sums, T, K, E, E // R, R, H,
           CHECK_X=bool(block) and H % block == 0 and x.numel() > 0, XBITS=8 * x.element_size(),
           TB=SCAN_TB, KC=SCAN_KC, VB=SCAN_VB)
    launch(_words_kernel, (1,), found, sums, words, E, R, T, H, K, x_dtype, payload, 0, 0, 0,
           int(bool(block) and H % block != 0), max_tokens, nblk, CHECK=True, BLOCK=_BLOCK)
    return words
