"""``plan`` on any device (cpu/plan.cpp, epkit.h plan_expert / plan_exchange): one
single-program Triton kernel, launched for its three phases, turns the all-gathered count words
[R, 8 + E + R] into the plan, word for word the C++ kernel's.

Why one program: the plan is small (R x E words) and every block of it reads running sums of
the ones before; as torch ops it is about 280 launches. The program walks the words in 2-D
tiles (sources x experts), so the interpreter's cost (per ``tl.*`` operation, not per element)
stays at a few hundred operations at verify sizes, and a GPU keeps one CTA's threads busy.

Phase 0: the error (step 1 of cpu/plan.cpp), kept slots (capacity: a running sum over the
sources, in registers) and this rank's expert sections (step 4); it writes each source's kept
slots as prefixes *within* each expert tile into ``work`` [R, E]. Phase 1: those prefixes
continued across the tiles (a running sum per source, in registers) at the end of each rank's
experts, ``bound`` [R, R]. Phase 2: rows per pair, uniformity and the exchange's chunks (steps
3 and 5) from ``bound``. Why launches and not barriers: a phase reads what other threads wrote
only in a later launch (``tl.debug_barrier`` orders shared memory, not global memory, on AMD:
its fences are LDS-only), and each phase alone compiles without a spill on sm_90 and gfx942
(the whole plan in one program spilled 2 to 12 SGPRs on gfx942; ``epkit kernels --compile``).

Errors travel in the plan as in the C++ kernel: a rank's own error, else the first rank whose
H, x dtype or K differs from rank 0's; then the plan holds only its header. Metadata (the words'
shape, rank, option codes) raises here with the C++ messages. The remaining option values
(align, capacity, max_tokens_per_rank) are checked, as in the C++ kernel, only when no rank's
words carry an error: when they are bad (never on epkit's path, which checks them first) the
words' headers are read on the host to decide. Words that are corrupt (a negative or absurd count,
rank 0's H or K negative, an unknown payload: never made by ``prepare``) raise off the device
path (``rowchecks.on_host``) as the C++ kernel does; on a GPU that would be a host wait, so the kernel records them in a small
``fault`` tensor, read there only with ``EPKIT_CUDA_CHECKS=1``.
"""

from __future__ import annotations

import os

import torch

from ._runtime import launch, specialization, tl, triton
from ..memory import mark_host
from .rowchecks import on_host
from .layout import MAX_EXPERTS, MAX_RANKS, _fail, check_dim, check_experts_ranks, dtype_name
from .transports import path_of
from epkit.reference import abi

__all__ = ["plan", "plan_words_size"]

MAX_ALIGN = (1 << 31) - 1   # checks.h kMaxAlign
MAX_TOKENS = (1 << 31) - 1  # checks.h kMaxTokens
MAX_WORD_COUNT = 1 << 48    # plan.cpp kMaxWordCount: a count beyond this overflows the sums
_EX = abi.EXCHANGE_CODES
_H = {name: i for i, name in enumerate(abi.PLAN_FIELDS)}


def _c_div(a: int, b: int) -> int:
    """C++ integer division (truncates toward zero), as PlanOffsets computes L = E / R."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def plan_words_size(R: int, E: int) -> int:
    """PlanOffsets(R, E).size (epkit.h), for any E the words allow (E >= -R, error words)."""
    L = _c_div(E, R)
    return abi.PLAN_HEADER + 2 * R + 3 * L + 1 + R * L + E + 4 * R


# The header words (abi.PLAN_FIELDS) as kernel constants.
_ERR_CODE, _ERR_A, _ERR_B, _ERR_RANK = 0, 1, 2, 3
assert [abi.PLAN_FIELDS[i] for i in range(4)] == ["err_code", "err_a", "err_b", "err_rank"]


@triton.jit
def _slots(bound_ptr, s, d, m, R):
    """Kept slots from sources ``s`` to ranks ``d`` (tensors of one shape, ``m`` their mask):
    the difference of ``bound`` [R, R] (each source's kept slots up to the end of each rank's
    experts) at d and d - 1."""
    end = tl.load(bound_ptr + s * R + d, mask=m, other=0)
    start = tl.load(bound_ptr + s * R + d - 1, mask=m & (d > 0), other=0)
    return end - start


@triton.jit(do_not_specialize=["R", "E", "L", "rank", "align", "capacity", "transport",
                               "token_rows", "meta_bytes", "exchange", "max_tokens"])
def _plan_kernel(g_ptr, p_ptr, work_ptr, bound_ptr, fault_ptr, R, E, L, rank, align, capacity,
                 transport, token_rows, meta_bytes, exchange, max_tokens, PHASE: tl.constexpr,
                 BS: tl.constexpr, BX: tl.constexpr):
    """One program: ``g`` [R, 8 + E + R] int64 the gathered words, ``p`` [PlanOffsets(R, E).size]
    int64 the plan (zeros on entry: a plan that carries an error holds only its header),
    ``work`` [R * E] and ``bound`` [R * R] int64 scratch between the phases (module comment),
    ``fault`` [3] int64 (out: rank 0's header is corrupt; the first corrupt slot count as
    s * E + e, -1 if none; the first corrupt token count as s * R + d, -1 if none). PHASE:
    0, 1 or 2, launched in that order. Tiles are BS sources x BX experts (or ranks). The
    transport's path gives ``token_rows`` (1: a row per (token, rank) plus slot rows, counted
    by the words' tokens per rank; 0: a row per kept slot) and ``meta_bytes`` (a row's bytes
    after the payload); ``transport`` itself is only stored."""
    R = R.to(tl.int64)
    E = E.to(tl.int64)
    L = L.to(tl.int64)
    zero = R * 0
    W = 8 + E + R
    xs = tl.arange(0, BX).to(tl.int64)           # a 1-D tile
    rs = tl.arange(0, BS).to(tl.int64)[:, None]  # sources of a 2-D tile
    cs = tl.arange(0, BX).to(tl.int64)[None, :]  # its experts (or ranks)
    tokens = (xs * 0 + token_rows) == 1          # tensor masks (interpreter: not splatted)

    if PHASE == 0:
        tl.store(p_ptr + 9, R)
        tl.store(p_ptr + 10, L)
        tl.store(p_ptr + 11, E)
        tl.store(p_ptr + 12, transport.to(tl.int64))
        tl.store(p_ptr + 13, capacity.to(tl.int64))
        tl.store(p_ptr + 14, align.to(tl.int64))

        # 1. The error: the lowest rank whose own checks failed; else the lowest rank whose H,
        #    x dtype or K (in that order) differs from rank 0's.
        H0 = tl.load(g_ptr + 4)
        K0 = tl.load(g_ptr + 5)
        X0 = tl.load(g_ptr + 6)
        P0 = tl.load(g_ptr + 7)
        # Running verdicts are kept per lane (vector registers) and reduced after each loop.
        first_err = xs * 0 + R
        first_mis = xs * 0 + R
        for i in range(0, (R + BX - 1) // BX):
            s = i * BX + xs
            m = s < R
            code = tl.load(g_ptr + s * W, mask=m, other=0)
            h = tl.load(g_ptr + s * W + 4, mask=m, other=0)
            k = tl.load(g_ptr + s * W + 5, mask=m, other=0)
            x = tl.load(g_ptr + s * W + 6, mask=m, other=0)
            first_err = tl.minimum(first_err, tl.where(m & (code != 0), s, R))
            unlike = m & ((h != H0) | (x != X0) | (k != K0))
            first_mis = tl.minimum(first_mis, tl.where(unlike, s, R))
        first_err = tl.min(first_err, 0)
        first_mis = tl.min(first_mis, 0)
        failed = (first_err < R) | (first_mis < R)
        if failed:
            if first_err < R:
                code = tl.load(g_ptr + first_err * W)
                a = tl.load(g_ptr + first_err * W + 1)
                b = tl.load(g_ptr + first_err * W + 2)
                who = first_err
            else:
                h = tl.load(g_ptr + first_mis * W + 4)
                k = tl.load(g_ptr + first_mis * W + 5)
                x = tl.load(g_ptr + first_mis * W + 6)
                code = tl.where(h != H0, 7, tl.where(x != X0, 8, 9)).to(tl.int64)
                a = tl.where(h != H0, h, tl.where(x != X0, x, k))
                b = tl.where(h != H0, H0, tl.where(x != X0, X0, K0))
                who = first_mis
            tl.store(p_ptr + 0, code)
            tl.store(p_ptr + 1, a)
            tl.store(p_ptr + 2, b)
            tl.store(p_ptr + 3, who)
            tl.store(p_ptr + 16, zero - 1)  # static_cap: not static
            tl.store(fault_ptr + 0, zero)
            tl.store(fault_ptr + 1, zero - 1)
            tl.store(fault_ptr + 2, zero - 1)
        else:
            tl.store(p_ptr + 15, K0)
            head_bad = (H0 < 0) | (K0 < 0) | (P0 < 0) | (P0 > 2)
            tl.store(fault_ptr + 0, head_bad.to(tl.int64))

            # 2. Kept slots per (source, expert): capacity keeps the first C in (source, token)
            #    order. Expert tiles outer, source tiles inner: ``before`` carries the slots of
            #    the sources already seen per expert; ``work`` gets each row's prefix along the
            #    experts within the tile (phase 1 continues it across the tiles). The same
            #    pass writes this rank's sections (plan_expert): own_kept (its row), recv_kept
            #    (its experts' columns), kept / dropped totals and the padded offsets,
            #    whose running sum M crosses the tiles in expert order. PlanOffsets (epkit.h):
            #    tokens_per_expert at 26 + 2R, then dropped, offsets (L + 1), recv_kept (R L),
            #    own_kept (E).
            C = capacity.to(tl.int64)
            me = rank.to(tl.int64)
            lo = me * L  # this rank's experts: [lo, lo + L)
            o_tpe = 26 + 2 * R
            step = tl.maximum(align.to(tl.int64), 1)  # (a bad align raised on the host)
            dropped_any = xs * 0
            bad_count = xs * 0 + R * E
            M = zero
            for i in range(0, (E + BX - 1) // BX):
                e = i * BX + cs
                before = tl.zeros([BX], dtype=tl.int64)
                kept_sum = tl.zeros([BX], dtype=tl.int64)
                for t in range(0, (R + BS - 1) // BS):
                    s = t * BS + rs
                    m = (s < R) & (e < E)
                    c = tl.load(g_ptr + s * W + 8 + e, mask=m, other=0)
                    seen = tl.cumsum(c, 0) - c + before[None, :]
                    kept = tl.where(C < 0, c, tl.minimum(tl.maximum(C - seen, 0), c))
                    dropped_any = tl.maximum(dropped_any,
                                             tl.max(tl.where(m & (kept != c), 1, 0), 0))
                    bad = m & ((c < 0) | (c > 281474976710656))  # 2**48: MAX_WORD_COUNT
                    bad_count = tl.minimum(bad_count, tl.min(tl.where(bad, s * E + e, R * E), 0))
                    before += tl.sum(c, 0)
                    kept_sum += tl.sum(kept, 0)
                    tl.store(work_ptr + s * E + e, tl.cumsum(kept, 1), mask=m)  # tile-local
                    mine = m & (e >= lo) & (e < lo + L)
                    tl.store(p_ptr + o_tpe + 3 * L + 1 + s * L + e - lo, kept, mask=mine)
                    tl.store(p_ptr + o_tpe + 3 * L + 1 + R * L + e + s * 0, kept,
                             mask=m & (s == me))
                e1 = i * BX + xs
                mine1 = (e1 >= lo) & (e1 < lo + L)
                tl.store(p_ptr + o_tpe + e1 - lo, kept_sum, mask=mine1)
                tl.store(p_ptr + o_tpe + L + e1 - lo, before - kept_sum, mask=mine1)  # dropped
                padded = tl.where(mine1, (kept_sum + step - 1) // step * step, 0)
                tl.store(p_ptr + o_tpe + 2 * L + e1 - lo, tl.cumsum(padded, 0) - padded + M,
                         mask=mine1)
                M += tl.sum(padded, 0)
            tl.store(p_ptr + o_tpe + 3 * L, M)  # offsets[L]
            tl.store(p_ptr + 24, tl.max(dropped_any, 0))
            bad_count = tl.min(bad_count, 0)
            tl.store(fault_ptr + 1, tl.where(bad_count < R * E, bad_count, -1))

    elif PHASE == 1:
        # Phase 1: each source's kept slots summed up to the end of each rank's experts,
        #    ``bound`` [R, R], from phase 0's tile-local prefixes: the sources outer, the
        #    expert tiles inner, so each row's running sum stays in registers.
        if tl.load(p_ptr + 0) == 0:
            for t in range(0, (R + BS - 1) // BS):
                s = t * BS + rs
                carry = tl.zeros([BS], dtype=tl.int64)
                for i in range(0, (E + BX - 1) // BX):
                    e = i * BX + cs
                    m = (s < R) & (e < E)
                    prefix = tl.load(work_ptr + s * E + e, mask=m, other=0) + carry[:, None]
                    end = m & ((e + 1) % L == 0)  # the last expert of rank (e + 1) / L - 1
                    tl.store(bound_ptr + s * R + (e + 1) // L - 1, prefix, mask=end)
                    last = tl.minimum(E, i * BX + BX) - 1  # the tile's last expert
                    carry = tl.sum(tl.where(m & (e == last), prefix, 0), 1)
    else:
        # Phase 2: steps 3 and 5, unless phase 0 wrote an error (a word it alone writes).
        if tl.load(p_ptr + 0) == 0:
            me = rank.to(tl.int64)
            o_tpe = 26 + 2 * R
            M = tl.load(p_ptr + o_tpe + 3 * L)  # offsets[L]: this rank's expert rows
            # 3. Rows (and slot rows) from s to d for every pair: uniformity (the lowest source
            #    with a pair unlike (0, 0)), the largest chunk, and the corrupt token counts.
            slots00 = tl.load(bound_ptr)
            rows00 = tl.where(token_rows == 1, tl.load(g_ptr + 8 + E), slots00)
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
                    tpr = tl.load(g_ptr + s * W + 8 + E + d, mask=m, other=0)
                    n = tl.where((d * 0 + token_rows) == 1, tpr, sl)
                    same = (n == rows00) & ((sl == slots00) | ((d * 0 + token_rows) == 0))
                    first_unlike = tl.minimum(first_unlike, tl.min(tl.where(m & ~same, s, R), 0))
                    maxrows = tl.maximum(maxrows, tl.max(tl.where(m, n, 0), 0))
                    maxslots = tl.maximum(maxslots, tl.max(tl.where(m, sl, 0), 0))
                    bad = m & ((tpr < 0) | (tpr > 281474976710656))
                    bad_tpr = tl.minimum(bad_tpr, tl.min(tl.where(bad, s * R + d, R * R), 0))
            first_unlike = tl.min(first_unlike, 0)
            maxrows = tl.max(maxrows, 0)
            maxslots = tl.max(maxslots, 0)
            bad_tpr = tl.min(bad_tpr, 0)
            uniform = first_unlike == R
            tl.store(p_ptr + 7, uniform.to(tl.int64))
            tl.store(p_ptr + 23, tl.where(uniform, zero - 1, first_unlike))
            tl.store(fault_ptr + 2, tl.where(bad_tpr < R * R, bad_tpr, -1))

            # 5. The exchange that runs and the dispatch chunks in bytes (plan_exchange). Each
            #    header word is stored as soon as it is known (fewer live scalar registers); rank
            #    0's header is read again for the same reason.
            H0 = tl.load(g_ptr + 4)
            X0 = tl.load(g_ptr + 6)
            P0 = tl.load(g_ptr + 7)
            per = tl.minimum(tl.load(g_ptr + 5), L)
            mt = max_tokens.to(tl.int64)
            is_static = (mt >= 0) | (exchange == 5)
            variant = tl.where(is_static, 3, tl.where(exchange == 1, 1, tl.where(
                (exchange == 2) | (((exchange == 3) | (exchange == 4)) & uniform), 2, 0)))
            tl.store(p_ptr + 17, variant.to(tl.int64))
            slots_cap = mt * per
            cap = tl.where((token_rows == 0) | (slots_cap < mt), slots_cap, mt)
            tl.store(p_ptr + 6, tl.where(is_static,
                                         R * slots_cap + L * (align.to(tl.int64) - 1), M))
            tl.store(p_ptr + 8, tl.where(is_static, 1 + cap, maxrows))
            tl.store(p_ptr + 16, tl.where(is_static, cap, zero - 1))
            tokcap = tl.where(is_static, 1 + cap, tl.where(variant != 0, maxrows, zero - 1))
            slotcap = tl.where(is_static, 1 + slots_cap, tl.where(variant != 0, maxslots, zero - 1))
            tl.store(p_ptr + 19, tokcap)
            tl.store(p_ptr + 20, tl.where(token_rows == 1, slotcap, zero - 1))
            static_rows = tl.where(is_static, R * (1 + cap), zero - 1)
            itemsize = tl.where(X0 == 2, 2, 4).to(tl.int64)  # dtype code 2: bfloat16
            block = tl.where(P0 == 1, 32, tl.where(P0 == 2, 128, 0)).to(tl.int64)
            scale_bytes = tl.where(P0 == 1, 1, tl.where(P0 == 2, 4, 0)).to(tl.int64)
            Pb = tl.where(block != 0, H0 + scale_bytes * (H0 // tl.maximum(block, 1)),
                          H0 * itemsize)
            tl.store(p_ptr + 18, Pb)
            B = Pb + meta_bytes
            fixed = (xs * 0 + tokcap) >= 0

            o_send_bytes = o_tpe + 3 * L + 1 + R * L + E
            S = zero
            SB = zero
            for i in range(0, (R + BX - 1) // BX):
                d = i * BX + xs
                m = d < R
                sl = _slots(bound_ptr, d * 0 + me, d, m, R)
                n = tl.where(tokens, tl.load(g_ptr + me * W + 8 + E + d, mask=m, other=0), sl)
                tl.store(p_ptr + 26 + d, n, mask=m)  # send_counts
                tl.store(p_ptr + o_send_bytes + 2 * R + d, sl, mask=m)  # send_slots
                nbytes = tl.where(fixed, tokcap, n) * B + tl.where(tokens, tl.where(
                    fixed, slotcap, sl) * 8, 0)
                tl.store(p_ptr + o_send_bytes + d, nbytes, mask=m)
                S += tl.sum(tl.where(m, n, 0), 0)
                SB += tl.sum(tl.where(m, nbytes, 0), 0)
            tl.store(p_ptr + 4, tl.where(is_static, static_rows, S))
            tl.store(p_ptr + 21, SB)
            N = zero
            RB = zero
            for i in range(0, (R + BX - 1) // BX):
                s = i * BX + xs
                m = s < R
                sl = _slots(bound_ptr, s, s * 0 + me, m, R)
                n = tl.where(tokens, tl.load(g_ptr + s * W + 8 + E + me, mask=m, other=0), sl)
                tl.store(p_ptr + 26 + R + s, n, mask=m)  # recv_counts
                tl.store(p_ptr + o_send_bytes + 3 * R + s, sl, mask=m)  # recv_slots
                nbytes = tl.where(fixed, tokcap, n) * B + tl.where(tokens, tl.where(
                    fixed, slotcap, sl) * 8, 0)
                tl.store(p_ptr + o_send_bytes + R + s, nbytes, mask=m)  # recv_bytes
                N += tl.sum(tl.where(m, n, 0), 0)
                RB += tl.sum(tl.where(m, nbytes, 0), 0)
            tl.store(p_ptr + 5, tl.where(is_static, static_rows, N))
            tl.store(p_ptr + 22, RB)


_BS, _BX = 8, 32
_SCALARS = ("R", "E", "L", "rank", "align", "capacity", "transport", "token_rows", "meta_bytes",
            "exchange", "max_tokens")
for _phase in (0, 1, 2):
    specialization(f"plan_phase{_phase}", _plan_kernel,
                   {"g_ptr": "*i64", "p_ptr": "*i64", "work_ptr": "*i64", "bound_ptr": "*i64",
                    "fault_ptr": "*i64",
                    **{s: "i32" for s in _SCALARS}, "PHASE": "constexpr", "BS": "constexpr",
                    "BX": "constexpr"},
                   {"PHASE": _phase, "BS": _BS, "BX": _BX})


# ---- argument checks (checks.h check_plan_args / check_plan_options) ----------------------------
def _check_args(words, rank, E, transport, exchange):
    """checks.h check_plan_args; returns the transport's path."""
    op = "epkit.plan"
    check_dim(op, "words", words, 2)
    if words.dtype != torch.int64:
        _fail(op, f"words must be Long, got {dtype_name(words.dtype)}")
    R = words.shape[0]
    if not 1 <= R <= MAX_RANKS:
        _fail(op, f"words must have one row per rank (1 to {MAX_RANKS}), got {R}")
    if not (-R <= E <= MAX_EXPERTS and words.shape[1] == abi.WORD_HEADER + E + R):
        _fail(op, f"words must be [R, 8 + E + R] for R = {R} and num_experts {E}, got "
                  f"{list(words.shape)}")
    if not 0 <= rank < R:
        _fail(op, f"rank {rank} outside [0, {R})")
    path = path_of(op, transport)
    if not _EX["ragged"] <= exchange <= _EX["static"]:
        _fail(op, f"exchange code {exchange} outside [0, 5]")
    return path


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
    unlike = (head[:, [4, 5, 6]] != head[0, [4, 5, 6]]).any()
    return bool((head[:, 0] != 0).any() or unlike)


def _raise_fault(words, fault):
    """The C++ kernel's checks of corrupt words, from the kernel's ``fault`` (host memory)."""
    op = "epkit.plan"
    head, count, tpr = fault.cpu().tolist()
    R, E = words.shape[0], words.shape[1] - abi.WORD_HEADER - words.shape[0]
    words = words.cpu()
    if head:
        h, k, p = words[0, 4].item(), words[0, 5].item(), words[0, 7].item()
        _fail(op, f"words of rank 0 carry hidden {h}, topk {k}, payload {p}")
    if count >= 0:
        s, e = divmod(count, E)
        _fail(op, f"words of rank {s} count {words[s, abi.WORD_HEADER + e].item()} slots for "
                  f"expert {e}")
    if tpr >= 0:
        s, d = divmod(tpr, R)
        _fail(op, f"words of rank {s} count {words[s, abi.WORD_HEADER + E + d].item()} tokens "
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
    p = torch.zeros(plan_words_size(R, E), dtype=torch.int64, device=g.device)
    work = torch.empty(max(R * E, 1), dtype=torch.int64, device=g.device)
    bound = torch.empty(R * R, dtype=torch.int64, device=g.device)
    fault = torch.empty(3, dtype=torch.int64, device=g.device)
    if on_host(g):  # words in host memory (the static mirror's template): so is their fault
        mark_host(fault)
    for phase in (0, 1, 2):  # each reads what the ones before wrote (module comment)
        launch(_plan_kernel, (1,), g, p, work, bound, fault, R, E, L, rank, align, capacity,
               transport, int(path.TOKEN_ROWS), path.META_BYTES, exchange, max_tokens,
               PHASE=phase, BS=_BS, BX=_BX)
    if on_host(g) or os.environ.get("EPKIT_CUDA_CHECKS") == "1":
        _raise_fault(g, fault)  # on the device path a host read: as on CUDA, only when asked
    return p
