"""``plan`` on any device (cpu/plan.cpp, epkit.h plan_expert / plan_exchange): three Triton
launches, one a phase, turn the all-gathered count words [R, 8 + E + R] into the plan, word for
word the C++ kernel's, the R x E words spread over programs where no program needs another's
result: phase 0 a program per tile of experts, phase 1 one per tile of sources, phase 2 one.
As torch ops the plan is about 280 launches. Each program walks its words in 2-D tiles
(sources x experts), so the interpreter's cost (per ``tl.*`` operation, not per element)
stays at a few hundred operations at verify sizes.

Phase 0: the error (step 1 of cpu/plan.cpp: every program finds it, program 0 writes it), kept
slots (capacity: for each expert a running sum over the sources, so the tile's program walks
every source) and this rank's expert sections (step 4); it writes each source's kept slots as
prefixes *within* the expert tile into ``work`` [R, E], and each tile's dropped-any, first
corrupt count and padded rows into ``part``. Phase 1: those prefixes continued across the
expert tiles (a running sum per source, in registers) at the end of each rank's experts,
``bound`` [R, R]; its program 0 also reduces ``part`` (dropped_any, the fault word, the
padded offsets continued across the tiles). Phase 2, one program: rows per pair, uniformity
and the exchange's chunks (steps 3 and 5) from ``bound``, reductions over every pair. Why
launches and not barriers: a phase reads what other programs (or threads) wrote only in a
later launch (``tl.debug_barrier`` orders shared memory, not global memory, on AMD: its fences
are LDS-only), and each phase alone compiles without a spill on sm_90 and gfx942 (the whole
plan in one program spilled 2 to 12 SGPRs on gfx942; ``epkit kernels --compile``).

Errors travel in the plan as in the C++ kernel: a rank's own error, else the first rank whose
H, x dtype or K differs from rank 0's; then the plan holds only its header. Metadata (the words'
shape, rank, option codes) raises here with the C++ messages. The remaining option values
(align, capacity, max_tokens_per_rank) are checked, as in the C++ kernel, only when no rank's
words carry an error: when they are bad (never on epkit's path, which checks them first) the
words' headers are read on the host to decide. Words that are corrupt (a negative or absurd count,
rank 0's H or K negative, an unknown payload: never made by ``prepare``) raise off the device
path (``rowchecks.on_host``) as the C++ kernel does; on a GPU that would be a host wait, so
the kernel records them in a small ``fault`` tensor, read there only with
``EPKIT_CUDA_CHECKS=1``.
"""

from __future__ import annotations

import os

import torch

from ._runtime import launch, tl, triton
from .abi import (BLOCK_FP8_BLOCK128, BLOCK_MXFP8, DTYPE_BFLOAT16, EXCHANGE_AUTO, EXCHANGE_EQUAL,
                  EXCHANGE_LAZY, EXCHANGE_PADDED, EXCHANGE_STATIC, PAYLOAD_FP8_BLOCK128,
                  PAYLOAD_MXFP8, PLAN_ALIGN, PLAN_CAPACITY, PLAN_DROPPED_ANY, PLAN_ERR_A,
                  PLAN_ERR_B, PLAN_ERR_CODE, PLAN_ERR_RANK, PLAN_EXPERT_ROWS, PLAN_EXPERTS,
                  PLAN_HEADER, PLAN_LOCAL_EXPERTS, PLAN_MAX_CHUNK, PLAN_NONUNIFORM_RANK,
                  PLAN_PAYLOAD_BYTES, PLAN_RANKS, PLAN_RANKS_PER_NODE, PLAN_RECV_BYTES,
                  PLAN_RECV_ROWS,
                  PLAN_SEND_BYTES, PLAN_SEND_ROWS, PLAN_SLOT_CAP, PLAN_STATIC_CAP, PLAN_TOK_CAP,
                  PLAN_TOPK, PLAN_TRANSPORT, PLAN_UNIFORM, PLAN_VARIANT, REASON_DTYPE_MISMATCH,
                  REASON_HIDDEN_MISMATCH, REASON_TOPK_MISMATCH, REASON_TOPK_TOO_LARGE,
                  SCALE_BYTES_FP8_BLOCK128, DEDUP_MAX_TOPK, TRANSPORT_PAIRS,
                  SCALE_BYTES_MXFP8, SLOT_ROW_BYTES, VARIANT_EQUAL, VARIANT_PADDED, VARIANT_RAGGED,
                  VARIANT_STATIC, WORD_ERROR_A, WORD_ERROR_B, WORD_ERROR_CODE, WORD_HEADER,
                  WORD_HIDDEN, WORD_PAYLOAD, WORD_TOPK, WORD_X_DTYPE)
from ..memory import mark_host
from .rowchecks import on_host
from .rowchecks import check_experts_ranks, fail
from .wirechecks import check_plan_args
from .transports import PATHS
from epkit.reference import abi

__all__ = ["plan", "plan_words_size"]

MAX_ALIGN = (1 << 31) - 1   # checks.h kMaxAlign
MAX_TOKENS = (1 << 31) - 1  # checks.h kMaxTokens
MAX_WORD_COUNT = 1 << 48    # plan.cpp kMaxWordCount: a count beyond this overflows the sums
_EX = abi.EXCHANGE_CODES
MAX_WORD_COUNT_C = tl.constexpr(MAX_WORD_COUNT)
# the words of ``fault`` [3] (plan's docstring): rank 0's header is corrupt, the first corrupt
# slot count, the first corrupt token count
FAULT_HEADER, FAULT_COUNT, FAULT_TOKENS = (tl.constexpr(i) for i in range(3))
# the words of ``part`` a phase 0 program writes for phase 1 (its tile's): whether a slot was
# dropped, the first corrupt slot count, this rank's padded rows
PART_DROPPED, PART_BAD, PART_PADDED = (tl.constexpr(i) for i in range(3))
PART_WORDS = tl.constexpr(3)


def _c_div(a: int, b: int) -> int:
    """C++ integer division (truncates toward zero), as PlanOffsets computes L = E / R."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def plan_words_size(R: int, E: int) -> int:
    """PlanOffsets(R, E).size (epkit.h), for any E the words allow (E >= -R, error words)."""
    L = _c_div(E, R)
    return abi.PLAN_HEADER + 2 * R + 3 * L + 1 + R * L + E + 4 * R


@triton.jit
def _slots(bound_ptr, s, d, m, R):
    """Kept slots from sources ``s`` to ranks ``d`` (tensors of one shape, ``m`` their mask):
    the difference of ``bound`` [R, R] (each source's kept slots up to the end of each rank's
    experts) at d and d - 1."""
    end = tl.load(bound_ptr + s * R + d, mask=m, other=0)
    start = tl.load(bound_ptr + s * R + d - 1, mask=m & (d > 0), other=0)
    return end - start


# The plan's sections (PlanOffsets, epkit.h) after its header, as offsets into the plan: the
# send and receive counts (R each), then tokens_per_expert, dropped (L each), offsets (L + 1),
# recv_kept (R L), own_kept (E), then send and receive bytes and slots (R each).
@triton.jit
def _o_tpe(R):
    return PLAN_HEADER + 2 * R


@triton.jit
def _o_send_bytes(R, E, L):
    return _o_tpe(R) + 3 * L + 1 + R * L + E


@triton.jit(do_not_specialize=["R", "E", "L", "rank", "align", "capacity", "transport"])
def _errors_kernel(g_ptr, p_ptr, work_ptr, part_ptr, fault_ptr, R, E, L, rank, align, capacity,
                   transport, BS: tl.constexpr, BX: tl.constexpr):
    """Phase 0 (module docstring), a program per tile of BX experts (every program finds the
    error, program 0 writes it). ``g`` [R, 8 + E + R] int64 the gathered words; ``p``
    [PlanOffsets(R, E).size] int64 the plan (uninitialised on entry: the three phases write
    every word; a plan that carries an error holds only its header); ``work`` [R * E] int64
    (out: each source's kept slots, prefixes within each expert tile); ``fault`` [3] int64
    (out: rank 0's header is corrupt; the first corrupt slot count as s * E + e, -1 if none;
    the first corrupt token count, -1 here); ``part`` [PART_WORDS * programs] int64 (out: each
    program's dropped-any, first corrupt slot count and padded rows of this rank's experts,
    which phase 1 reduces). Writes the option words, the error (step 1), and, without one,
    kept slots (capacity) and this rank's expert sections (step 4; the padded offsets only
    within the program's tile: phase 1 adds the tiles before). Tiles are BS sources x BX
    experts."""
    R = R.to(tl.int64)
    E = E.to(tl.int64)
    L = L.to(tl.int64)
    zero = R * 0
    W = WORD_HEADER + E + R
    xs = tl.arange(0, BX).to(tl.int64)           # a 1-D tile
    rs = tl.arange(0, BS).to(tl.int64)[:, None]  # sources of a 2-D tile
    cs = tl.arange(0, BX).to(tl.int64)[None, :]  # its experts
    tile = tl.program_id(0).to(tl.int64)  # this program's tile of experts
    first = tile == 0  # the program that writes the plan's single words
    if first:
        tl.store(p_ptr + PLAN_RANKS, R)
        tl.store(p_ptr + PLAN_LOCAL_EXPERTS, L)
        tl.store(p_ptr + PLAN_EXPERTS, E)
        tl.store(p_ptr + PLAN_TRANSPORT, transport.to(tl.int64))
        tl.store(p_ptr + PLAN_CAPACITY, capacity.to(tl.int64))
        tl.store(p_ptr + PLAN_ALIGN, align.to(tl.int64))

    # 1. The error: the lowest rank whose own checks failed; else the lowest rank whose H,
    #    x dtype or K (in that order) differs from rank 0's.
    H0 = tl.load(g_ptr + WORD_HIDDEN)
    K0 = tl.load(g_ptr + WORD_TOPK)
    X0 = tl.load(g_ptr + WORD_X_DTYPE)
    P0 = tl.load(g_ptr + WORD_PAYLOAD)
    # Running verdicts are kept per lane (vector registers) and reduced after each loop.
    first_err = xs * 0 + R
    first_mis = xs * 0 + R
    for i in range(0, (R + BX - 1) // BX):
        s = i * BX + xs
        m = s < R
        code = tl.load(g_ptr + s * W + WORD_ERROR_CODE, mask=m, other=0)
        h = tl.load(g_ptr + s * W + WORD_HIDDEN, mask=m, other=0)
        k = tl.load(g_ptr + s * W + WORD_TOPK, mask=m, other=0)
        x = tl.load(g_ptr + s * W + WORD_X_DTYPE, mask=m, other=0)
        first_err = tl.minimum(first_err, tl.where(m & (code != 0), s, R))
        unlike = m & ((h != H0) | (x != X0) | (k != K0))
        first_mis = tl.minimum(first_mis, tl.where(unlike, s, R))
    first_err = tl.min(first_err, 0)
    first_mis = tl.min(first_mis, 0)
    # the agreed K within the transport's wire format (a slot row's k: 8 bits under dedup),
    # named for rank 0 as the reference's transport does
    too_large = (transport != TRANSPORT_PAIRS) & (K0 > DEDUP_MAX_TOPK)
    failed = (first_err < R) | (first_mis < R) | too_large
    if failed & first:
        if first_err < R:
            code = tl.load(g_ptr + first_err * W + WORD_ERROR_CODE)
            a = tl.load(g_ptr + first_err * W + WORD_ERROR_A)
            b = tl.load(g_ptr + first_err * W + WORD_ERROR_B)
            who = first_err
        elif first_mis >= R:
            code = (zero + REASON_TOPK_TOO_LARGE).to(tl.int64)
            a = K0
            b = zero + DEDUP_MAX_TOPK
            who = zero
        else:
            h = tl.load(g_ptr + first_mis * W + WORD_HIDDEN)
            k = tl.load(g_ptr + first_mis * W + WORD_TOPK)
            x = tl.load(g_ptr + first_mis * W + WORD_X_DTYPE)
            code = tl.where(h != H0, REASON_HIDDEN_MISMATCH, tl.where(
                x != X0, REASON_DTYPE_MISMATCH, REASON_TOPK_MISMATCH)).to(tl.int64)
            a = tl.where(h != H0, h, tl.where(x != X0, x, k))
            b = tl.where(h != H0, H0, tl.where(x != X0, X0, K0))
            who = first_mis
        tl.store(p_ptr + PLAN_ERR_CODE, code)
        tl.store(p_ptr + PLAN_ERR_A, a)
        tl.store(p_ptr + PLAN_ERR_B, b)
        tl.store(p_ptr + PLAN_ERR_RANK, who)
        tl.store(p_ptr + PLAN_STATIC_CAP, zero - 1)  # not static
        tl.store(fault_ptr + FAULT_HEADER, zero)
        tl.store(fault_ptr + FAULT_COUNT, zero - 1)
        tl.store(fault_ptr + FAULT_TOKENS, zero - 1)
    if not failed:
        if first:
            # no error: its words zero (the plan is not zero-filled first: every word is
            # written by one of the three phases; ranks_per_node is stamped later, 0 read as 1)
            tl.store(p_ptr + PLAN_ERR_CODE, zero)
            tl.store(p_ptr + PLAN_ERR_A, zero)
            tl.store(p_ptr + PLAN_ERR_B, zero)
            tl.store(p_ptr + PLAN_ERR_RANK, zero)
            tl.store(p_ptr + PLAN_RANKS_PER_NODE, zero)
            tl.store(p_ptr + PLAN_TOPK, K0)
            head_bad = (H0 < 0) | (K0 < 0) | (P0 < 0) | (P0 > PAYLOAD_FP8_BLOCK128)
            tl.store(fault_ptr + FAULT_HEADER, head_bad.to(tl.int64))

        # 2. Kept slots per (source, expert): capacity keeps the first C in (source, token)
        #    order. The program's expert tile, its source tiles in order: ``before`` carries
        #    the slots of the sources already seen per expert; ``work`` gets each row's prefix
        #    along the experts within the tile (phase 1 continues it across the tiles). The
        #    same pass writes this rank's sections (plan_expert): own_kept (its row), recv_kept
        #    (its experts' columns), kept / dropped totals and the padded offsets within the
        #    tile; ``part`` the tile's dropped-any, first corrupt count and padded rows.
        C = capacity.to(tl.int64)
        me = rank.to(tl.int64)
        lo = me * L  # this rank's experts: [lo, lo + L)
        o_tpe = _o_tpe(R)
        o_recv_kept = o_tpe + 3 * L + 1
        step = tl.maximum(align.to(tl.int64), 1)  # (a bad align raised on the host)
        dropped_any = xs * 0
        bad_count = xs * 0 + R * E
        e = tile * BX + cs
        before = tl.zeros([BX], dtype=tl.int64)
        kept_sum = tl.zeros([BX], dtype=tl.int64)
        for t in range(0, (R + BS - 1) // BS):
            s = t * BS + rs
            m = (s < R) & (e < E)
            c = tl.load(g_ptr + s * W + WORD_HEADER + e, mask=m, other=0)
            seen = tl.cumsum(c, 0) - c + before[None, :]
            kept = tl.where(C < 0, c, tl.minimum(tl.maximum(C - seen, 0), c))
            dropped_any = tl.maximum(dropped_any, tl.max(tl.where(m & (kept != c), 1, 0), 0))
            bad = m & ((c < 0) | (c > MAX_WORD_COUNT_C))
            bad_count = tl.minimum(bad_count, tl.min(tl.where(bad, s * E + e, R * E), 0))
            before += tl.sum(c, 0)
            kept_sum += tl.sum(kept, 0)
            tl.store(work_ptr + s * E + e, tl.cumsum(kept, 1), mask=m)  # tile-local
            mine = m & (e >= lo) & (e < lo + L)
            tl.store(p_ptr + o_recv_kept + s * L + e - lo, kept, mask=mine)
            tl.store(p_ptr + o_recv_kept + R * L + e + s * 0, kept, mask=m & (s == me))
        e1 = tile * BX + xs
        mine1 = (e1 >= lo) & (e1 < lo + L)
        tl.store(p_ptr + o_tpe + e1 - lo, kept_sum, mask=mine1)
        tl.store(p_ptr + o_tpe + L + e1 - lo, before - kept_sum, mask=mine1)  # dropped
        padded = tl.where(mine1, (kept_sum + step - 1) // step * step, 0)
        tl.store(p_ptr + o_tpe + 2 * L + e1 - lo, tl.cumsum(padded, 0) - padded, mask=mine1)
        tl.store(part_ptr + PART_WORDS * tile + PART_DROPPED, tl.max(dropped_any, 0))
        tl.store(part_ptr + PART_WORDS * tile + PART_BAD, tl.min(bad_count, 0))
        tl.store(part_ptr + PART_WORDS * tile + PART_PADDED, tl.sum(padded, 0))


@triton.jit(do_not_specialize=["R", "E", "L", "rank"])
def _bounds_kernel(p_ptr, work_ptr, part_ptr, bound_ptr, fault_ptr, R, E, L, rank,
                   BS: tl.constexpr, BX: tl.constexpr):
    """Phase 1, a program per tile of BS sources: each source's kept slots summed up to the end
    of each rank's experts, ``bound`` [R, R] int64, from phase 0's tile-local prefixes ``work``
    [R * E]: the expert tiles walked in order, so each row's running sum stays in registers.
    A program reads and writes only its own sources' rows (no order between programs).
    Program 0 also reduces phase 0's ``part`` (its expert tiles, in order): dropped_any, the
    fault's first corrupt slot count, and this rank's padded offsets continued across the
    tiles (each offset word read and rewritten once, by this program alone) with their end
    ``offsets[L]``. Nothing when phase 0 wrote an error (a word it alone writes)."""
    R = R.to(tl.int64)
    E = E.to(tl.int64)
    L = L.to(tl.int64)
    rs = tl.arange(0, BS).to(tl.int64)[:, None]
    cs = tl.arange(0, BX).to(tl.int64)[None, :]
    if tl.load(p_ptr + PLAN_ERR_CODE) == 0:
        s = tl.program_id(0).to(tl.int64) * BS + rs
        carry = tl.zeros([BS], dtype=tl.int64)
        for i in range(0, (E + BX - 1) // BX):
            e = i * BX + cs
            m = (s < R) & (e < E)
            prefix = tl.load(work_ptr + s * E + e, mask=m, other=0) + carry[:, None]
            end = m & ((e + 1) % L == 0)  # the last expert of rank (e + 1) / L - 1
            tl.store(bound_ptr + s * R + (e + 1) // L - 1, prefix, mask=end)
            last = tl.minimum(E, i * BX + BX) - 1  # the tile's last expert
            carry = tl.sum(tl.where(m & (e == last), prefix, 0), 1)
        if tl.program_id(0) == 0:
            xs = tl.arange(0, BX).to(tl.int64)
            lo = rank.to(tl.int64) * L
            o_off = _o_tpe(R) + 2 * L  # this rank's padded offsets, [L + 1]
            dropped_any = xs * 0
            bad_count = xs * 0 + R * E
            M = R * 0
            for j in range(0, (E + BX - 1) // BX):  # the expert tiles, in order
                at = part_ptr + PART_WORDS * j  # tile j's words
                dropped_any = tl.maximum(dropped_any, tl.load(at + PART_DROPPED + xs * 0))
                bad_count = tl.minimum(bad_count, tl.load(at + PART_BAD + xs * 0))
                e1 = j * BX + xs
                mine1 = (e1 >= lo) & (e1 < lo + L)
                w = o_off + e1 - lo
                tl.store(p_ptr + w, tl.load(p_ptr + w, mask=mine1, other=0) + M, mask=mine1)
                M += tl.load(at + PART_PADDED)
            tl.store(p_ptr + o_off + L, M)  # offsets[L]
            tl.store(p_ptr + PLAN_DROPPED_ANY, tl.max(dropped_any, 0))
            bad_count = tl.min(bad_count, 0)
            tl.store(fault_ptr + FAULT_COUNT, tl.where(bad_count < R * E, bad_count, -1))


@triton.jit(do_not_specialize=["R", "E", "L", "rank", "align", "token_rows", "meta_bytes",
                               "exchange", "max_tokens", "NW"])
def _exchange_kernel(g_ptr, p_ptr, bound_ptr, fault_ptr, R, E, L, rank, align, token_rows,
                     meta_bytes, exchange, max_tokens, NW, BS: tl.constexpr, BX: tl.constexpr):
    """Phase 2, one program: rows per pair, uniformity and the exchange's chunks (steps 3 and
    5) from ``bound`` [R, R]; ``fault`` [3]: the first corrupt token count as s * R + d (-1 if
    none). The transport's path gives ``token_rows`` (1: a row per (token, rank) plus slot
    rows, counted by the words' tokens per rank; 0: a row per kept slot) and ``meta_bytes`` (a
    row's bytes after the payload). When phase 0 wrote an error, the plan's NW words but the
    ones phase 0 wrote (the error, the options, static_cap) are zeroed: the plan holds only its
    header."""
    R = R.to(tl.int64)
    E = E.to(tl.int64)
    L = L.to(tl.int64)
    zero = R * 0
    W = WORD_HEADER + E + R
    xs = tl.arange(0, BX).to(tl.int64)
    rs = tl.arange(0, BS).to(tl.int64)[:, None]
    cs = tl.arange(0, BX).to(tl.int64)[None, :]
    tokens = (xs * 0 + token_rows) == 1  # tensor masks (interpreter: not splatted)
    if tl.load(p_ptr + PLAN_ERR_CODE) == 0:
        me = rank.to(tl.int64)
        o_tpe = _o_tpe(R)
        M = tl.load(p_ptr + o_tpe + 3 * L)  # offsets[L]: this rank's expert rows
        # 3. Rows (and slot rows) from s to d for every pair: uniformity (the lowest source
        #    with a pair unlike (0, 0)), the largest chunk, and the corrupt token counts.
        slots00 = tl.load(bound_ptr)
        rows00 = tl.where(token_rows == 1, tl.load(g_ptr + WORD_HEADER + E), slots00)
        first_unlike = xs * 0 + R
        maxrows = xs * 0
        maxslots = xs * 0
        bad_tpr = xs * 0 + R * R
        for t in range(0, (R + BS - 1) // BS):
            s = t * BS + rs
            for i in range(0, (R + BX - 1) // BX):
                d = i * BX + cs
                m = (s < R) & (d < R)
                sl = _slots(bound_ptr, s, d, m, R)
                tpr = tl.load(g_ptr + s * W + WORD_HEADER + E + d, mask=m, other=0)
                n = tl.where((d * 0 + token_rows) == 1, tpr, sl)
                same = (n == rows00) & ((sl == slots00) | ((d * 0 + token_rows) == 0))
                first_unlike = tl.minimum(first_unlike, tl.min(tl.where(m & ~same, s, R), 0))
                maxrows = tl.maximum(maxrows, tl.max(tl.where(m, n, 0), 0))
                maxslots = tl.maximum(maxslots, tl.max(tl.where(m, sl, 0), 0))
                bad = m & ((tpr < 0) | (tpr > MAX_WORD_COUNT_C))
                bad_tpr = tl.minimum(bad_tpr, tl.min(tl.where(bad, s * R + d, R * R), 0))
        first_unlike = tl.min(first_unlike, 0)
        maxrows = tl.max(maxrows, 0)
        maxslots = tl.max(maxslots, 0)
        bad_tpr = tl.min(bad_tpr, 0)
        uniform = first_unlike == R
        tl.store(p_ptr + PLAN_UNIFORM, uniform.to(tl.int64))
        tl.store(p_ptr + PLAN_NONUNIFORM_RANK, tl.where(uniform, zero - 1, first_unlike))
        tl.store(fault_ptr + FAULT_TOKENS, tl.where(bad_tpr < R * R, bad_tpr, -1))

        # 5. The exchange that runs and the dispatch chunks in bytes (plan_exchange). Each
        #    header word is stored as soon as it is known (fewer live scalar registers); rank
        #    0's header is read again for the same reason.
        H0 = tl.load(g_ptr + WORD_HIDDEN)
        X0 = tl.load(g_ptr + WORD_X_DTYPE)
        P0 = tl.load(g_ptr + WORD_PAYLOAD)
        per = tl.minimum(tl.load(g_ptr + WORD_TOPK), L)
        mt = max_tokens.to(tl.int64)
        is_static = (mt >= 0) | (exchange == EXCHANGE_STATIC)
        variant = tl.where(is_static, VARIANT_STATIC, tl.where(
            exchange == EXCHANGE_PADDED, VARIANT_PADDED, tl.where(
                (exchange == EXCHANGE_EQUAL)
                | (((exchange == EXCHANGE_AUTO) | (exchange == EXCHANGE_LAZY)) & uniform),
                VARIANT_EQUAL, VARIANT_RAGGED)))
        tl.store(p_ptr + PLAN_VARIANT, variant.to(tl.int64))
        slots_cap = mt * per
        cap = tl.where((token_rows == 0) | (slots_cap < mt), slots_cap, mt)
        tl.store(p_ptr + PLAN_EXPERT_ROWS, tl.where(
            is_static, R * slots_cap + L * (align.to(tl.int64) - 1), M))
        tl.store(p_ptr + PLAN_MAX_CHUNK, tl.where(is_static, 1 + cap, maxrows))
        tl.store(p_ptr + PLAN_STATIC_CAP, tl.where(is_static, cap, zero - 1))
        tokcap = tl.where(is_static, 1 + cap, tl.where(variant != VARIANT_RAGGED, maxrows,
                                                       zero - 1))
        slotcap = tl.where(is_static, 1 + slots_cap, tl.where(variant != VARIANT_RAGGED,
                                                              maxslots, zero - 1))
        tl.store(p_ptr + PLAN_TOK_CAP, tokcap)
        tl.store(p_ptr + PLAN_SLOT_CAP, tl.where(token_rows == 1, slotcap, zero - 1))
        static_rows = tl.where(is_static, R * (1 + cap), zero - 1)
        itemsize = tl.where(X0 == DTYPE_BFLOAT16, 2, 4).to(tl.int64)
        block = tl.where(P0 == PAYLOAD_MXFP8, BLOCK_MXFP8, tl.where(
            P0 == PAYLOAD_FP8_BLOCK128, BLOCK_FP8_BLOCK128, 0)).to(tl.int64)
        scale_bytes = tl.where(P0 == PAYLOAD_MXFP8, SCALE_BYTES_MXFP8, tl.where(
            P0 == PAYLOAD_FP8_BLOCK128, SCALE_BYTES_FP8_BLOCK128, 0)).to(tl.int64)
        Pb = tl.where(block != 0, H0 + scale_bytes * (H0 // tl.maximum(block, 1)),
                      H0 * itemsize)
        tl.store(p_ptr + PLAN_PAYLOAD_BYTES, Pb)
        B = Pb + meta_bytes
        fixed = (xs * 0 + tokcap) >= 0

        o_send_bytes = _o_send_bytes(R, E, L)
        S = zero
        SB = zero
        for i in range(0, (R + BX - 1) // BX):
            d = i * BX + xs
            m = d < R
            sl = _slots(bound_ptr, d * 0 + me, d, m, R)
            n = tl.where(tokens, tl.load(g_ptr + me * W + WORD_HEADER + E + d, mask=m, other=0),
                         sl)
            tl.store(p_ptr + PLAN_HEADER + d, n, mask=m)  # send_counts
            tl.store(p_ptr + o_send_bytes + 2 * R + d, sl, mask=m)  # send_slots
            nbytes = tl.where(fixed, tokcap, n) * B + tl.where(tokens, tl.where(
                fixed, slotcap, sl) * SLOT_ROW_BYTES, 0)
            tl.store(p_ptr + o_send_bytes + d, nbytes, mask=m)
            S += tl.sum(tl.where(m, n, 0), 0)
            SB += tl.sum(tl.where(m, nbytes, 0), 0)
        tl.store(p_ptr + PLAN_SEND_ROWS, tl.where(is_static, static_rows, S))
        tl.store(p_ptr + PLAN_SEND_BYTES, SB)
        N = zero
        RB = zero
        for i in range(0, (R + BX - 1) // BX):
            s = i * BX + xs
            m = s < R
            sl = _slots(bound_ptr, s, s * 0 + me, m, R)
            n = tl.where(tokens, tl.load(g_ptr + s * W + WORD_HEADER + E + me, mask=m, other=0),
                         sl)
            tl.store(p_ptr + PLAN_HEADER + R + s, n, mask=m)  # recv_counts
            tl.store(p_ptr + o_send_bytes + 3 * R + s, sl, mask=m)  # recv_slots
            nbytes = tl.where(fixed, tokcap, n) * B + tl.where(tokens, tl.where(
                fixed, slotcap, sl) * SLOT_ROW_BYTES, 0)
            tl.store(p_ptr + o_send_bytes + R + s, nbytes, mask=m)  # recv_bytes
            N += tl.sum(tl.where(m, n, 0), 0)
            RB += tl.sum(tl.where(m, nbytes, 0), 0)
        tl.store(p_ptr + PLAN_RECV_ROWS, tl.where(is_static, static_rows, N))
        tl.store(p_ptr + PLAN_RECV_BYTES, RB)
    else:
        nw = NW.to(tl.int64)
        for blk in range(0, (nw + BX - 1) // BX):
            o = blk * BX + xs
            kept = ((o <= PLAN_ERR_RANK) | ((o >= PLAN_RANKS) & (o <= PLAN_ALIGN))
                    | (o == PLAN_STATIC_CAP))
            tl.store(p_ptr + o, xs * 0, mask=(o < nw) & ~kept)


_BS, _BX = 8, 32


# ---- argument checks (checks.h check_plan_args / check_plan_options) ----------------------------
def _check_args(words, rank, E, transport, exchange):
    """checks.h check_plan_args (wirechecks.check_plan_args, which the fake kernel runs too);
    returns the transport's path."""
    check_plan_args(words, rank, E, transport, exchange)
    return PATHS[transport]


def _option_error(E, R, align, capacity, exchange, max_tokens):
    """check_plan_options' verdict as a function that raises it, or None when the options are
    good."""
    op = "epkit.plan"
    try:
        check_experts_ranks(op, E, R)
    except RuntimeError as exc:
        return exc
    if not 1 <= align <= MAX_ALIGN:
        return RuntimeError(f"{op}: align must be in [1, {MAX_ALIGN}], got {align}")
    if capacity < -1:
        return RuntimeError(f"{op}: capacity must be >= 0 (or -1: none), got {capacity}")
    if not -1 <= max_tokens <= MAX_TOKENS:
        return RuntimeError(f"{op}: max_tokens_per_rank must be in [0, {MAX_TOKENS}] (or -1), "
                            f"got {max_tokens}")
    if exchange == _EX["static"] and max_tokens < 0:
        return RuntimeError(f"{op}: the static exchange needs max_tokens_per_rank >= 0, got "
                            f"{max_tokens}")
    return None


def _words_carry_error(g: torch.Tensor) -> bool:
    """Whether the plan will carry an error (step 1 of the kernel), read on the host: only when
    the options are bad (the kernel's other steps need good ones), never on epkit's path."""
    head = g[:, :abi.WORD_HEADER].cpu()
    F = {f: i for i, f in enumerate(abi.WORD_FIELDS)}
    shape = [F["hidden"], F["topk"], F["x_dtype"]]
    unlike = (head[:, shape] != head[0, shape]).any()
    return bool((head[:, F["error_code"]] != 0).any() or unlike)


def _raise_fault(words, fault):
    """The C++ kernel's checks of corrupt words, from the kernel's ``fault`` (host memory)."""
    op = "epkit.plan"
    head, count, tpr = fault.cpu().tolist()
    R, E = words.shape[0], words.shape[1] - abi.WORD_HEADER - words.shape[0]
    words = words.cpu()
    if head:
        h, k, p = words[0, 4].item(), words[0, 5].item(), words[0, 7].item()
        fail(op, f"words of rank 0 carry hidden {h}, topk {k}, payload {p}")
    if count >= 0:
        s, e = divmod(count, E)
        fail(op, f"words of rank {s} count {words[s, abi.WORD_HEADER + e].item()} slots for "
                  f"expert {e}")
    if tpr >= 0:
        s, d = divmod(tpr, R)
        fail(op, f"words of rank {s} count {words[s, abi.WORD_HEADER + E + d].item()} tokens "
                  f"for rank {d}")


def plan(words: torch.Tensor, rank: int, num_experts: int, align: int, capacity: int,
         transport: int, exchange: int, max_tokens_per_rank: int) -> torch.Tensor:
    """This rank's plan [PlanOffsets(R, E).size] int64 from the gathered count words ``words``
    [R, 8 + E + R] int64, on their device: cpu/plan.cpp's words, errors included."""
    rank, E, align, capacity = int(rank), int(num_experts), int(align), int(capacity)
    transport, exchange, max_tokens = int(transport), int(exchange), int(max_tokens_per_rank)
    path = _check_args(words, rank, E, transport, exchange)
    g = words.contiguous()
    R = g.shape[0]
    L = _c_div(E, R)
    bad_options = _option_error(E, R, align, capacity, exchange, max_tokens)
    if bad_options is not None and not _words_carry_error(g):
        raise bad_options
    NW = plan_words_size(R, E)
    p = torch.empty(NW, dtype=torch.int64, device=g.device)  # every word written (the kernels)
    work = torch.empty(max(R * E, 1), dtype=torch.int64, device=g.device)
    tiles = max(triton.cdiv(E, _BX), 1)  # phase 0's programs
    part = torch.empty(PART_WORDS.value * tiles, dtype=torch.int64, device=g.device)
    bound = torch.empty(R * R, dtype=torch.int64, device=g.device)
    fault = torch.empty(3, dtype=torch.int64, device=g.device)
    if on_host(g):  # words in host memory (the static mirror's template): so is their fault
        mark_host(fault)
    # three launches, each reading what the ones before wrote (module docstring)
    launch(_errors_kernel, (tiles,), g, p, work, part, fault, R, E, L, rank, align, capacity,
           transport, BS=_BS, BX=_BX)
    launch(_bounds_kernel, (max(triton.cdiv(R, _BS), 1),), p, work, part, bound, fault, R, E, L,
           rank, BS=_BS, BX=_BX)
    launch(_exchange_kernel, (1,), g, p, bound, fault, R, E, L, rank, align,
           int(path.TOKEN_ROWS), path.META_BYTES, exchange, max_tokens, NW, BS=_BS, BX=_BX)
    if on_host(g) or os.environ.get("EPKIT_CUDA_CHECKS") == "1":
        _raise_fault(g, fault)  # on the device path a host read: as on CUDA, only when asked
    return p
