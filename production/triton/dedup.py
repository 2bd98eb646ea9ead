"""The dedup path of the Triton kernels (transport code 1): a token travels once per destination
rank as a token row ``payload | int32 t | int32 n``, its n kept slots there as slot rows
``int32 (k << 24 | j) | float32 w`` in the chunk's slot section; on the return path a token row
comes back as its n rows of expert_y when n <= per = 4 / itemsize(y), else as its float32
partial (per units of H elements of y's dtype), at unit first[r] of a [units, H] buffer, or at
r * per of rows of 4H bytes without first (docs/design.md).

One module per transport path, as DeepEP splits its kernels into intranode and internode ones:
what pack, unpack, combine and the backward passes do differently for dedup is here, behind the
interface pairs.py has too (transports.py lists it); the per-op modules hold what both paths
share and ask the path ``transports.path_of`` resolved for the rest.
"""

from __future__ import annotations

import torch

from epkit.reference import abi

from ..transports.dedup import DEDUP as ROW
from . import byterows, ranks
from . import rowchecks as ck
from .abi import PLAN_ERR_CODE, SLOT_K_SHIFT, SLOT_ROW_BYTES
from ._runtime import INTERPRETED, cdiv, launch, tl, triton
from .byterows import int_at
from .rowspace import any_bit
from .sections import SLOT_ROW, TOKEN_ROW, excl_at, section_rows
from .wirechecks import ST_EXPERT_ROW, ST_EXPERT_TOTAL, ST_SHAPE, ST_SLOT_ROW, ST_SLOTS

# The transport's facts are its row's (production/transports/dedup.py), not retyped here.
NAME, CODE, META_BYTES = ROW.name, ROW.code, ROW.meta_bytes
TOKEN_ROWS = ROW.rows_hold_many_slots  # True: a row per (token, rank), its slots in slot rows
send_map_cols, recv_map_cols, back_dtype = ROW.send_map_cols, ROW.recv_map_cols, ROW.back_dtype
SLOT_SECTIONS = 1    # each chunk ends in its slot section
ROW_SLOT = False     # a row's slots travel in slot rows (unpack_slots finds their expert rows)
MAX_TOPK = ROW.max_topk    # a slot row's k: 8 bits
MAX_LOCAL = ROW.max_local  # a slot row's j: 24 bits
SLOT = abi.SLOT_ROW_BYTES
SEND_MAP = "dedup: one column per rank"
# what cpu/combine.cpp raises for a slot whose row does not match its routing
UNMATCHED_SLOT = "a kept slot whose token row send_map does not name"


def units_per_row(itemsize: int) -> int:
    """per: units of H elements of y's dtype in a 4H-byte row (a float32 partial)."""
    return 4 // itemsize


# ---- argument checks (checks.h, where it asks the transport) ---------------------------------
def check_pack_topk(op, K: int) -> None:
    if K > MAX_TOPK:
        ck.fail(op, f"dedup carries k in 8 bits: topk {K} > {MAX_TOPK}")


def check_local_experts(op, L: int) -> None:
    if L > MAX_LOCAL:
        ck.fail(op, f"dedup carries the local expert in 24 bits: {L} local experts")


def check_gather(op, y, recv_map, row_weight, weighted) -> None:
    """gather_rows / gather_units after the transport: y float (the partials' sums), the row
    weights when weighted (applied at the expert side)."""
    ck.check_float_dtype(op, "expert_y", y.dtype)
    if weighted:
        ck.check_weights_1d(op, row_weight, y)


def check_units(op, recv_map, first, out, y) -> None:
    """gather_units' placement: every token row's units at first."""
    if first is None:
        ck.fail(op, "dedup places its units by first")
    check_first(op, first, recv_map.shape[0], "rows of recv_map", y.device)


def check_first(op, first, rows, what, dev) -> None:
    """The return path's unit places: first [rows] int64 on dev (rows < 0: any length)."""
    if first is None:
        return
    ck.check_map(op, "first", first, 1)
    ck.check_device(op, "first", first, dev)
    if rows >= 0:
        ck.check_size(op, "first", first, 0, rows, what)


def check_back(op, back, first) -> None:
    """Without first, back holds a 4H-byte row per token row."""
    if first is None and back.shape[1] % (4 // back.element_size()):
        ck.fail(op, f"dedup's back must be [S, 4 H / itemsize] (a float32 row per token row), "
                    f"got {list(back.shape)} of {back.dtype}")


# ---- pack ------------------------------------------------------------------------------------
@triton.jit
def _open_kernel(idx, rank, plan, keys, nopen, TK, K, E, L, R, o_own, BLOCK: tl.constexpr):
    """Slots q [pid * BLOCK, +BLOCK) of the flattened routing (slot k of token t = q // K):
    whether each is sent (it names an expert e, its rank among this rank's slots to e is below
    own_kept[e], the plan carries no error) and whether it opens its token's row to rank
    d = e // L (no earlier slot k' < k of the token is sent to d). Writes the two rank keys:
    keys[q] = d for an opening slot (token rows: a token's place among the tokens opening on
    d), keys[TK + q] = R + d for a sent slot (slot rows: its place among d's slots), 2 R
    (none) otherwise; and nopen[q] = the token's sent slots to d (a token row's n)."""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < TK
    ok = (tl.zeros([BLOCK], tl.int64) + tl.load(plan + PLAN_ERR_CODE)) == 0  # a tile (interpreter)
    kept, d = _sent(idx, rank, plan, q, inq, ok, E, L, o_own)
    t = q // K
    n = tl.zeros([BLOCK], tl.int64)
    earlier = q < 0
    for k2 in range(K):  # the token's slots: a walk of K cached loads each
        q2 = t * K + k2
        kept2, d2 = _sent(idx, rank, plan, q2, inq, ok, E, L, o_own)
        same = kept & kept2 & (d2 == d)
        n += same.to(tl.int64)
        earlier = earlier | (same & (q2 < q))
    tl.store(keys + q, tl.where(kept & ~earlier, d, 2 * R), mask=inq)
    tl.store(keys + TK + q, tl.where(kept, R + d, 2 * R), mask=inq)
    tl.store(nopen + q, n, mask=inq)


@triton.jit
def _sent(idx, rank, plan, q, inq, ok, E, L, o_own):
    """(sent, destination rank) of slots q: it names an expert e in [0, E), its rank among
    this rank's slots to e is below own_kept[e] and the plan carries no error."""
    e = tl.load(idx + q, mask=inq, other=-1)
    valid = inq & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    r = tl.load(rank + q, mask=inq, other=0)
    return valid & ok & (r < tl.load(plan + o_own + e, mask=valid, other=0)), e // L


@triton.jit
def _places_kernel(keys, rank2, plan, send_map, srcA, srcB, TK, K, R, CAP, TOKCAP, SLOTCAP, QA,
                   QB, o_counts, o_nslots, BLOCK: tl.constexpr):
    """Slots q [pid * BLOCK, +BLOCK): an opening slot's token row, its place tok = rank2[q]
    among the tokens opening on d, is sent when tok < send_counts[d]: send_map[t, d] its row in
    the row space (static d * (1 + cap) + 1 + tok, ragged the rows of the chunks before plus
    tok), srcA[its first-section row] = q; a sent slot's slot row, its place u = rank2[TK + q]
    among d's slots, is sent when u < send_slots[d]: srcB[its slot-section row] = q. (send_map,
    srcA and srcB filled with -1 by the ranks' launch.)"""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < TK
    ka = tl.load(keys + q, mask=inq, other=2 * R)
    kb = tl.load(keys + TK + q, mask=inq, other=2 * R)
    static = ((tl.zeros([BLOCK], tl.int64) + CAP) >= 0).to(tl.int64)
    # the token row
    opening = inq & (ka < R)
    d = tl.where(opening, ka, 0)
    tok = tl.load(rank2 + q, mask=opening, other=0)
    opening = opening & (tok < tl.load(plan + o_counts + d, mask=opening, other=0))
    before = excl_at(plan, o_counts, R, d, opening)  # rows of the chunks before d
    row = tl.where(static != 0, d * (1 + CAP) + 1 + tok, before + tok)
    tl.store(send_map + (q // K) * R + d, row, mask=opening)
    at = tl.where(TOKCAP >= 0, d * TOKCAP, before) + static + tok
    tl.store(srcA + at, q, mask=opening & (at >= 0) & (at < QA))
    # the slot row
    sent = inq & (kb >= R) & (kb < 2 * R)
    d = tl.where(sent, kb - R, 0)
    u = tl.load(rank2 + TK + q, mask=sent, other=0)
    sent = sent & (u < tl.load(plan + o_nslots + d, mask=sent, other=0))
    at = tl.where(SLOTCAP >= 0, d * SLOTCAP, excl_at(plan, o_nslots, R, d, sent)) + static + u
    tl.store(srcB + at, q, mask=sent & (at >= 0) & (at < QB))


PACK_BLOCK = 4096 if INTERPRETED else 256  # slots a program of pack's slot launches


def pack_rows(ix):
    """The first section's token rows, from pack's index pass ``ix`` (pack.Slots): each slot
    sent or not and whether it opens its token's row to its rank (``_open_kernel``), the
    token rows' and the slot rows' places (one ``ranks.rank_in_key`` over both keys, two
    launches), send_map and the two sections' row maps (``_places_kernel``), then the token
    rows' words (sections.py). Returns (send_map [T, R] int64, the rows' byte offsets [QA],
    their payloads' source offsets [QA], meta [QA, 2] int32, the header values or None); the
    slot section's row map waits on ``ix`` for :func:`pack_slots`. send_map is a view of the
    buffer that holds the two row maps too (one -1 fill for the three)."""
    idx, pv, buf = ix.routing.idx, ix.plan, ix.buffer
    T, K, R, TK = ix.routing.tokens, max(ix.routing.topk, 1), pv.ranks, idx.numel()
    QA, QB = buf.first_rows, buf.slot_rows
    i64 = dict(dtype=torch.int64, device=idx.device)
    maps = torch.empty(T * R + QA + QB, **i64)
    send_map, srcA, srcB = maps[: T * R], maps[T * R: T * R + QA], maps[T * R + QA:]
    keys, nopen = torch.empty(2 * TK, **i64), torch.empty(TK, **i64)
    if TK:
        launch(_open_kernel, (cdiv(TK, PACK_BLOCK),), idx, ix.slot_rank, pv.tensor, keys, nopen,
               TK, K, pv.experts, pv.local_experts, R, pv.start("own_kept"), BLOCK=PACK_BLOCK)
    rank2 = ranks.rank_in_key(keys, 2 * R, fill=maps)
    if TK:
        launch(_places_kernel, (cdiv(TK, PACK_BLOCK),), keys, rank2, pv.tensor, send_map, srcA,
               srcB, TK, K, R, pv.static_cap, pv.token_cap, pv.slot_cap, QA, QB,
               pv.start("send_counts"), pv.start("send_slots"), BLOCK=PACK_BLOCK)
    ix.slot_src = srcB
    rows = section_rows(ix, TOKEN_ROW, srcA, QA, buf.row_bytes, "send_counts", pv.token_cap,
                        aux=nopen)
    return (send_map.view(T, R), *rows)


def pack_slots(ix) -> None:
    """The slot rows: chunk d's sent slots in (t, k) order, after its token section (their
    map made by :func:`pack_rows`), their words (sections.py) and the row writer."""
    buf = ix.buffer
    offB, src_off, meta, hdrB = section_rows(ix, SLOT_ROW, ix.slot_src, buf.slot_rows, SLOT,
                                             "send_slots", ix.plan.slot_cap)
    byterows.write_rows(buf.send, offB, SLOT, ix.routing.x, src_off, 0, meta, hdrB,
                        align=buf.align)


# ---- unpack ----------------------------------------------------------------------------------
@triton.jit
def _tokens_kernel(recv, at, data, nn_o, words, N, NB, P, K, BLOCK: tl.constexpr):
    """Token rows [pid * BLOCK, +BLOCK): each one's slot count n (0 off the data rows, a
    negative n as 0: ST_SLOTS; more than K: ST_EXPERT_ROW) into nn_o, this block's bits into
    words[pid]."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inr = r < N
    dv = inr & (tl.load(data + r, mask=inr, other=0) != 0)
    n = int_at(recv, tl.load(at + r, mask=inr, other=0) + P + _META_N, dv, NB, 4)
    nn = tl.where(dv, tl.maximum(n, 0), 0)
    tl.store(nn_o + r, nn, mask=inr)
    tl.store(words + pid, any_bit(dv & (n < 0), _ST_SLOTS) | any_bit(nn > K, _ST_EXPERT_ROW))


@triton.jit
def _slot_rows_kernel(recv, plan, s, data, nn, before, hist, kk_o, jj_o, wb_o, sv_o, key_o,
                      words, NQ, NB, K, L, R, B, TOKCAP, HDR, NBLK, o_counts, o_bytes,
                      o_nslots, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Slots q = n * K + c [pid * BLOCK, +BLOCK) (slot c of token row n): token row n's c-th
    slot row, if it has one (c < its n), read from its chunk's slot section (after the chunk's
    token section and, static, its header row; the rows of earlier token rows from the same
    source, ``before``, ahead of it): k, local expert j (clamped to L - 1), the weight's bits,
    whether it is a slot (sv) and its rank key (j, or L: none). Program 0 also checks each
    source's slot rows against the plan's (the blocks' weighted histograms ``hist`` of the
    token rows' n by source) and, static, the slot sections' in-band counts."""
    pid = tl.program_id(0)
    q = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < NQ
    n = q // K
    c = q % K
    dv = inq & (tl.load(data + n, mask=inq, other=0) != 0)
    sv = dv & (c < tl.minimum(tl.load(nn + n, mask=inq, other=0), K))
    src = tl.load(s + n, mask=inq, other=0)
    sec = excl_at(plan, o_bytes, R, src, inq)  # the source's chunk's first byte (then its
    # token section and the slot rows of the token rows before)
    tok = tl.where(TOKCAP >= 0, TOKCAP, tl.load(plan + o_counts + src, mask=inq, other=0))
    slot_rows = HDR + tl.load(before + n, mask=inq, other=0) + c
    so = sec + tok * B + slot_rows * SLOT_ROW_BYTES
    bits = any_bit(sv & ((so < 0) | (so + SLOT_ROW_BYTES > NB)), _ST_SHAPE)
    sv = sv & (so >= 0) & (so + SLOT_ROW_BYTES <= NB)
    word = int_at(recv, so, sv, NB, 4)
    kk = (word & 0xFFFFFFFF) >> SLOT_K_SHIFT
    jj = word & _J_MASK
    bad = sv & ((jj >= L) | (kk >= K))
    bits |= any_bit(bad, _ST_SLOT_ROW)
    sv = sv & ~bad
    tl.store(kk_o + q, kk, mask=inq)
    tl.store(jj_o + q, tl.minimum(jj, L - 1), mask=inq)
    tl.store(wb_o + q, int_at(recv, so + 4, sv, NB, 4), mask=inq)
    tl.store(sv_o + q, sv.to(tl.uint8), mask=inq)
    tl.store(key_o + q, tl.where(sv, jj, L), mask=inq)
    if pid == 0:
        v = tl.arange(0, VEC)
        ok = (tl.zeros([VEC], tl.int64) + tl.load(plan + PLAN_ERR_CODE)) == 0  # (interpreter)
        done = tl.zeros([VEC], tl.int64)  # the bytes of the chunks before
        for d0 in range(0, R, VEC):
            d = d0 + v
            tot = tl.zeros([VEC], tl.int64)
            for blk in range(NBLK):
                tot += tl.load(hist + blk * (R + 1) + d, mask=d < R, other=0)
            nsl = tl.load(plan + o_nslots + d, mask=d < R, other=0)
            bits |= any_bit((d < R) & (tot != nsl), _ST_SLOTS)
            nb = tl.load(plan + o_bytes + d, mask=d < R, other=0)
            first = tl.sum(done, 0) + tl.cumsum(nb, 0) - nb
            tk = tl.where(TOKCAP >= 0, TOKCAP, tl.load(plan + o_counts + d, mask=d < R, other=0))
            hdr = (tl.zeros([VEC], tl.int64) + HDR) != 0  # a tile (interpreter)
            head = int_at(recv, first + tk * B, (d < R) & ok & hdr, NB, 8)
            bits |= any_bit((d < R) & hdr & (head != nsl), _ST_SLOTS)
            done += nb
    tl.store(words + pid, bits)


@triton.jit
def _slot_places_kernel(plan, jj, kk, sv, rank, hist, m_o, live_o, rk_o, words, NQ, K, L, M,
                        NBLK, o_offsets, o_tpe, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Slots q [pid * BLOCK, +BLOCK): each slot's expert row m = offsets[j] + its rank among
    the slots to local expert j (in received order), live when inside expert_rows, its
    recv_map entry n * K + k; bits: a row past its expert's segment or expert_rows, two slots
    of one token row naming one k (ST_EXPERT_ROW); program 0: the slots per local expert (the
    blocks' histograms) against the plan's tokens_per_expert (ST_EXPERT_TOTAL)."""
    pid = tl.program_id(0)
    q = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inq = q < NQ
    v = inq & (tl.load(sv + q, mask=inq, other=0) != 0)
    j = tl.load(jj + q, mask=inq, other=0)
    m = tl.load(plan + o_offsets + j, mask=inq, other=0) + tl.load(rank + q, mask=inq, other=0)
    hi = tl.load(plan + o_offsets + j + 1, mask=inq, other=0)
    bits = any_bit(v & ((m >= hi) | (m >= M)), _ST_EXPERT_ROW)
    k = tl.load(kk + q, mask=inq, other=0)
    n = q // K
    twice = inq & (q < 0)
    for c in range(K):
        q2 = n * K + c
        v2 = inq & (tl.load(sv + q2, mask=inq, other=0) != 0)
        twice = twice | (v & v2 & (q2 != q) & (tl.load(kk + q2, mask=inq, other=-1) == k))
    bits |= any_bit(twice, _ST_EXPERT_ROW)
    tl.store(m_o + q, m, mask=inq)
    tl.store(live_o + q, (v & (m < M)).to(tl.uint8), mask=inq)
    tl.store(rk_o + q, n * K + k, mask=inq)
    if pid == 0:
        for j0 in range(0, L, VEC):
            jv = j0 + tl.arange(0, VEC)
            cnt = tl.zeros([VEC], tl.int64)
            for blk in range(NBLK):
                cnt += tl.load(hist + blk * (L + 1) + jv, mask=jv < L, other=0)
            tpe = tl.load(plan + o_tpe + jv, mask=jv < L, other=0)
            bits |= any_bit((jv < L) & (cnt != tpe), _ST_EXPERT_TOTAL)
    tl.store(words + pid, bits)


_META_N = tl.constexpr(4 * abi.DEDUP_TOKEN_META.index("n"))
_J_MASK = tl.constexpr((1 << abi.SLOT_K_SHIFT) - 1)
_ST_SHAPE = tl.constexpr(ST_SHAPE)
_ST_SLOTS = tl.constexpr(ST_SLOTS)
_ST_SLOT_ROW = tl.constexpr(ST_SLOT_ROW)
_ST_EXPERT_ROW = tl.constexpr(ST_EXPERT_ROW)
_ST_EXPERT_TOTAL = tl.constexpr(ST_EXPERT_TOTAL)
BLOCK = 4096 if INTERPRETED else 256  # token rows or slots a program of unpack's slot launches
VEC = 64  # ranks or local experts a step of program 0's checks


def unpack_slots(rs):
    """Each received token row's n slots, from unpack's row space ``rs`` (unpack.RowSpace):
    its slot rows (the chunk's slot section, the rows' n in order), each slot's expert row its
    place among its local expert's slots (in received order) after the expert's offset. Seven
    launches: the token rows' n, their prefix within each source (ranks, weighted), the slot
    rows, their ranks within local experts (ranks), the expert rows. Returns per slot
    [N * K]: (expert row m, live, its recv_map entry's flat place, k, the weight's bits) and
    the launches' status words (int32)."""
    got, pv, rows = rs.received, rs.plan, rs.rows
    recv, K, N, M, NB = got.recv, got.topk, got.recv_rows, got.expert_rows, got.nbytes
    R, L = pv.ranks, pv.local_experts
    dev = recv.device
    i64 = dict(dtype=torch.int64, device=dev)
    NQ = N * K
    nb_tok, nb_slot = cdiv(max(N, 1), BLOCK), cdiv(max(NQ, 1), BLOCK)
    words = torch.empty(nb_tok + 2 * nb_slot, dtype=torch.int32, device=dev)
    data = rows.data.view(torch.uint8)
    nn = torch.empty(N, **i64)
    launch(_tokens_kernel, (nb_tok,), recv, rows.offset, data, nn, words, N, NB,
           got.payload_bytes, K, BLOCK=BLOCK)
    before, by_source = ranks.rank_in_key(rows.source, R, weight=nn, totals=True)
    kk, jj, wbits, key = (torch.empty(NQ, **i64) for _ in range(4))
    sv = torch.empty(NQ, dtype=torch.bool, device=dev)
    launch(_slot_rows_kernel, (nb_slot,), recv, pv.tensor, rows.source, data, nn, before,
           by_source, kk, jj, wbits, sv.view(torch.uint8), key, words[nb_tok:], NQ, NB,
           max(K, 1), L, R, got.row_bytes, pv.token_cap, pv.header_rows, by_source.shape[0],
           pv.start("recv_counts"), pv.start("recv_bytes"), pv.start("recv_slots"),
           BLOCK=BLOCK, VEC=VEC)
    rank, by_expert = ranks.rank_in_key(key, L, totals=True)
    m, rk = torch.empty(NQ, **i64), torch.empty(NQ, **i64)
    live = torch.empty(NQ, dtype=torch.bool, device=dev)
    launch(_slot_places_kernel, (nb_slot,), pv.tensor, jj, kk, sv.view(torch.uint8), rank,
           by_expert, m, live.view(torch.uint8), rk, words[nb_tok + nb_slot:], NQ, max(K, 1),
           L, M, by_expert.shape[0], pv.start("offsets"), pv.start("tokens_per_expert"),
           BLOCK=BLOCK, VEC=VEC)
    return m, live, rk, kk, wbits, words


# ---- combine and the backward passes ---------------------------------------------------------
def _unit_map(recv_map, M, per, first, U):
    """umap [U] for combine's units kernel, whether each token row's units fit (first set),
    and each row's unit count."""
    N, C = recv_map.shape
    dev = recv_map.device
    kept = (recv_map >= 0) & (recv_map < M)
    cnt = kept.sum(1)
    u = cnt.clamp(max=per)
    n = torch.arange(N, device=dev)
    base = first if first is not None else n * per
    fits = (u == 0) | ((base >= 0) & (base + u <= U))
    umap = torch.full((U + 1,), -1, dtype=torch.int64, device=dev)  # [U]: a sink for the rest
    raw = kept & ((cnt <= per) & fits)[:, None]  # unit base + (its place among the kept)
    at = torch.where(raw, base[:, None] + kept.cumsum(1) - 1, U)
    umap.scatter_(0, at.reshape(-1), torch.where(raw, recv_map, -1).reshape(-1))
    partial = (cnt > per) & fits
    j = torch.arange(per, device=dev)
    at = torch.where(partial[:, None], base[:, None] + j, U)
    umap.scatter_(0, at.reshape(-1), (-2 - (n[:, None] * per + j)).reshape(-1))
    return umap[:U], fits, u


def unit_map(op, recv_map, M: int, per: int, first, U: int) -> torch.Tensor:
    """The expert side's units [U]: token row n's min(n, per) units at first[n] (n * per
    without first), its kept rows of y (m >= 0) when they fit in per units, else its float32
    partial (-2 - (n * per + j): unit j of it); -1 elsewhere (zeros)."""
    umap, fits, u = _unit_map(recv_map, M, per, first, U)
    if ck.on_host(recv_map):
        if first is not None:
            bad = ck.first_bad(~fits)
            if bad >= 0:
                ck.fail(op, f"first[{bad}] = {int(first[bad])} puts its {int(u[bad])} unit(s) "
                            f"outside the {U} units")
        ck.check_map_range(op, "recv_map", recv_map, M, "rows of expert_y")
    return umap


def slot_rows(send_map, d, R: int) -> torch.Tensor:
    """The row each slot [T, K] went out in: its token's row to its destination d."""
    return torch.gather(send_map, 1, d.clamp(max=R - 1))


def bad_rows(idx, ok_e, ok_r, r, send_map) -> torch.Tensor:
    """The slots cpu/combine.cpp raises for besides an expert >= E: a used slot whose token
    row is -1 or outside [0, S)."""
    return ok_e & ~ok_r


def reduce_units(rows, on, start, last, i, first, per: int, S: int, U: int):
    """The source side's steps from each slot's token row ``rows`` [T, K] (in the token's
    (rank, k) order, ``on``: used; a group of slots to one rank shares it): a group of n <= per
    adds its n units, one a slot; a larger one reads its float32 partial (its first slot),
    once. Returns (unit, add, part, bad_first) [T, K], bad_first: units outside back's U."""
    K = i.shape[1]
    q = i - torch.where(start, i, 0).cummax(1).values  # place in the group
    end = torch.where(last, i, K).flip(1).cummin(1).values.flip(1)
    cnt = end - (i - q) + 1
    r0 = rows.clamp(0, max(S - 1, 0))
    if first is None:
        at0 = r0 * per
    else:  # (S = 0: no slot is used, and first has nothing to index)
        at0 = first[r0] if S > 0 else torch.zeros_like(r0)
    fits = (at0 >= 0) & (at0 + cnt.clamp(max=per) <= U)
    partial = on & fits & (cnt > per)
    add = on & fits & (cnt <= per)
    return torch.where(add, at0 + q, at0), add, partial & (q == 0), on & ~fits


def slot_places(d) -> torch.Tensor:
    """Each slot's place after its token row's first value (scatter_slot_values): its place
    among the token's kept slots on d, k ascending (from a stable sort by d)."""
    T, K = d.shape
    ds, order = torch.sort(d, dim=1, stable=True)
    i = torch.arange(K, device=d.device).expand(T, K)
    prev = torch.cat([torch.full_like(ds[:, :1], -1), ds[:, :-1]], 1)
    q = i - torch.where(ds != prev, i, 0).cummax(1).values  # place among t's slots on d
    return torch.empty_like(q).scatter_(1, order, q)


def send_map_entry(t: int, k: int, e: int, L: int, K: int, C: int) -> int:
    """The flat send_map entry slot (t, k) to expert e went out by (for messages)."""
    return t * C + e // L
