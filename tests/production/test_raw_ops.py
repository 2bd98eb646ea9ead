"""The raw ops (``torch.ops.epkit.*``) on malformed arguments: a clear error, never a crash.

Every case calls one op twice: with valid arguments (it must succeed, so a check that rejects
everything fails here) and with one argument malformed (it must raise RuntimeError, ValueError
or IndexError whose message starts ``epkit.<op>:``). The cases run in child processes, one case
at a time with a marker before each, so a signal or a sanitizer abort is pinned on its case and
the remaining cases run in a fresh child.

Also a command: ``python tests/production/test_raw_ops.py [--lib SO]`` runs every case and prints
a summary; ``--lib`` loads that kernel library instead of building epkit (the cases use the raw
ops only), and the children inherit the caller's environment: scripts/asan_raw_ops.sh runs it
against an AddressSanitizer build with libasan preloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

from epkit.reference import abi

HERE = os.path.dirname(os.path.abspath(__file__))
ERRORS = ("RuntimeError", "ValueError", "IndexError")

# ---- the valid arguments every case starts from (raw ops only: no epkit import needed) -----

# Plan layout (csrc/epkit.h): header words and the offsets of the per-rank sections.
SEND_ROWS, RECV_ROWS, EXPERT_ROWS = 4, 5, 6
RANKS, LOCAL_EXPERTS, EXPERTS, TRANSPORT, CAPACITY, ALIGN = 9, 10, 11, 12, 13, 14
SEND_BYTES = 21


def offsets(R: int, E: int) -> dict[str, int]:
    L, at, out = E // R, abi.PLAN_HEADER, {}
    for name, n in (("send_counts", R), ("recv_counts", R), ("tokens_per_expert", L),
                    ("dropped", L), ("offsets", L + 1), ("recv_kept", R * L), ("own_kept", E),
                    ("send_bytes", R), ("recv_bytes", R), ("send_slots", R), ("recv_slots", R)):
        out[name], at = at, at + n
    out["size"] = at
    return out


class Ctx:
    """One rank's valid data (R = 1, so what it sends is what it receives), for both transports,
    ragged and static; and count words of two ranks for the plan."""

    T, H, K, E = 6, 8, 2, 4

    def __init__(self):
        import torch

        self.torch = torch
        C = self.C = torch.ops.epkit
        torch.manual_seed(0)
        T, H, K, E = self.T, self.H, self.K, self.E
        self.x = torch.randn(T, H)
        self.idx = torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1], [-1, -1], [1, 2]])
        self.w = torch.rand(T, K)
        self.words = C.prepare(self.x, self.idx, self.w, E, 1, [0, 0, 0, 1], 0).view(1, -1)
        w2 = [C.prepare(self.x, self.idx, self.w, E, 2, [0, 0, 0, 1], 0) for _ in range(2)]
        self.words2 = torch.stack(w2)
        self.chains = {(tr, st): self._chain(tr, st) for tr in (0, 1) for st in (False, True)}

    def _chain(self, tr, static, n=None):
        C, torch = self.C, self.torch
        x, idx, w = (a[:n] for a in (self.x, self.idx, self.w))
        mt = self.T if static else -1
        words = C.prepare(x, idx, w, self.E, 1, [0, 0, 0, 1, mt], 0)
        plan = C.plan(words.view(1, -1), 0, self.E, 2, -1, tr, 5 if static else 0, mt)
        SB, S, N, M = plan[[SEND_BYTES, SEND_ROWS, RECV_ROWS, EXPERT_ROWS]].tolist()
        send, send_map = C.pack(x, idx, w, plan, tr, 1, SB)
        ex, src, rw, recv_map = C.unpack(send, plan, tr, self.H, x.dtype, self.K, N, M)
        y = torch.randn(M, self.H)
        rows = C.gather_rows(y, recv_map, rw, tr, True)  # R = 1: the rows come straight back
        # the weight gradients' places (epkit.moves.move_slot_values), R = 1 ragged: one per kept
        # slot, compact; the received rows are the sent ones, so both sides' firsts are the same
        u = (recv_map >= 0).sum(1)
        first = torch.arange(N) if tr == 0 else torch.where(u > 0, torch.cumsum(u, 0) - u, -1)
        slots = N if tr == 0 else int(u.sum())
        vals = C.gather_slot_values(rw, recv_map, first, slots)
        grad_rows = C.scatter_rows(x, send_map, S)
        # the return path's units (epkit.moves): dedup, min(n, per) a token row, compact; pairs a
        # row per row, no places
        un = u.clamp(max=4 // y.element_size())
        ufirst = None if tr == 0 else torch.where(un > 0, torch.cumsum(un, 0) - un, -1)
        units = N if tr == 0 else int(un.sum())
        return dict(tr=tr, plan=plan, SB=SB, S=S, N=N, M=M, send=send, send_map=send_map,
                    rw=rw, recv_map=recv_map, y=y, rows=rows, vals=vals, grad_rows=grad_rows,
                    first=first, slots=slots, o=offsets(1, self.E), ufirst=ufirst, units=units)

    def chain(self, tr, static=False):
        return self.chains[(tr, static)]

    def small_plan(self, tr):
        """The plan of a call with fewer tokens (the first two)."""
        return self._chain(tr, False, n=2)["plan"]


def tampered(t, index, value=None, add=None):
    t = t.clone()
    t.view(-1)[index] = value if add is None else t.view(-1)[index] + add
    return t


# ---- the cases ------------------------------------------------------------------------------
# CASES: (op, name, fn); fn(c, bad) makes the valid call (bad=False) or the malformed one.

CASES: list = []


def case(op, name, transports=(None,)):
    def register(fn):
        for tr in transports:
            label = name if tr is None else f"{name}[{('pairs', 'dedup')[tr]}]"
            CASES.append((op, label, (lambda c, bad, fn=fn, tr=tr: fn(c, bad) if tr is None
                                      else fn(c, bad, tr))))
        return fn
    return register


def simple(op, name, good, bad_fn, transports=(None,)):
    """A case whose valid and malformed calls are two lambdas of (c[, tr])."""
    if transports == (None,):
        case(op, name)(lambda c, bad: (bad_fn if bad else good)(c))
    else:
        case(op, name, transports)(lambda c, bad, tr: (bad_fn if bad else good)(c, tr))


BOTH = (0, 1)
BIG = 2 ** 40

# layout(topk_idx, num_experts, num_ranks)
L_OK = lambda c: c.C.layout(c.idx, c.E, 1)  # noqa: E731
for name, bad in [
    ("topk_idx_1d", lambda c: c.C.layout(c.idx.view(-1), c.E, 1)),
    ("topk_idx_float", lambda c: c.C.layout(c.idx.float(), c.E, 1)),
    ("topk_idx_bool", lambda c: c.C.layout(c.idx > 0, c.E, 1)),
    ("zero_ranks", lambda c: c.C.layout(c.idx, c.E, 0)),
    ("negative_ranks", lambda c: c.C.layout(c.idx, c.E, -2)),
    ("experts_not_multiple", lambda c: c.C.layout(c.idx, 3, 2)),
    ("experts_below_ranks", lambda c: c.C.layout(c.idx, 1, 2)),
    ("negative_experts", lambda c: c.C.layout(c.idx, -4, 1)),
    ("absurd_experts", lambda c: c.C.layout(c.idx, BIG, 1)),
    ("absurd_ranks", lambda c: c.C.layout(c.idx, BIG, BIG)),
    ("index_equal_E", lambda c: c.C.layout(tampered(c.idx, 3, c.E), c.E, 1)),
    ("index_below_minus_one", lambda c: c.C.layout(tampered(c.idx, 3, -2), c.E, 1)),
]:
    simple("layout", name, L_OK, bad)

# prepare(x, topk_idx, topk_weights, num_experts, num_ranks, pre_error, payload)
P_OK = lambda c: c.C.prepare(c.x, c.idx, c.w, c.E, 1, [0, 0, 0, 1], 0)  # noqa: E731
for name, bad in [
    ("empty_pre_error", lambda c: c.C.prepare(c.x, c.idx, c.w, c.E, 1, [], 0)),
    ("short_pre_error", lambda c: c.C.prepare(c.x, c.idx, c.w, c.E, 1, [0, 0], 0)),
    ("negative_experts", lambda c: c.C.prepare(c.x, c.idx, c.w, -4, 1, [0, 0, 0, 1], 0)),
    ("negative_experts_in_header_range", lambda c: c.C.prepare(c.x, c.idx, c.w, -8, 4,
                                                               [0, 0, 0, 1], 0)),
    ("negative_experts_past_header", lambda c: c.C.prepare(c.x, c.idx, c.w, -9, 4,
                                                           [22, -9, 0, 1], 0)),
    ("zero_ranks", lambda c: c.C.prepare(c.x, c.idx, c.w, c.E, 0, [0, 0, 0, 1], 0)),
    ("absurd_experts", lambda c: c.C.prepare(c.x, c.idx, c.w, BIG, 1, [0, 0, 0, 1], 0)),
    ("absurd_experts_on_error", lambda c: c.C.prepare(c.x, c.idx, c.w, BIG, 1, [22, 0, 0, 1], 0)),
    ("experts_not_multiple", lambda c: c.C.prepare(c.x, c.idx, c.w, 3, 2, [0, 0, 0, 1], 0)),
    ("x_1d", lambda c: c.C.prepare(c.x.view(-1), c.idx, c.w, c.E, 1, [0, 0, 0, 1], 0)),
    ("x_int", lambda c: c.C.prepare(c.x.int(), c.idx, c.w, c.E, 1, [0, 0, 0, 1], 0)),
    ("idx_rows", lambda c: c.C.prepare(c.x, c.idx[:3], c.w[:3], c.E, 1, [0, 0, 0, 1], 0)),
    ("idx_float", lambda c: c.C.prepare(c.x, c.idx.float(), c.w, c.E, 1, [0, 0, 0, 1], 0)),
    ("weights_shape", lambda c: c.C.prepare(c.x, c.idx, c.w[:, :1], c.E, 1, [0, 0, 0, 1], 0)),
    ("weights_empty", lambda c: c.C.prepare(c.x, c.idx, c.w.new_zeros(0), c.E, 1, [0, 0, 0, 1], 0)),
    ("weights_double", lambda c: c.C.prepare(c.x, c.idx, c.w.double(), c.E, 1, [0, 0, 0, 1], 0)),
    ("payload_code", lambda c: c.C.prepare(c.x, c.idx, c.w, c.E, 1, [0, 0, 0, 1], 3)),  # valid: 0..2
    ("max_tokens", lambda c: c.C.prepare(c.x, c.idx, c.w, c.E, 1, [0, 0, 0, 1, -7], 0)),
]:
    simple("prepare", name, P_OK, bad)


@case("prepare", "error_code_travels_with_small_experts")
def _(c, bad):
    # A nonzero pre_error code is the caller's verdict: words of 8 + E + R entries are still made
    # for E down to -R (the collective InputError path), and only below that it raises.
    E = -5 if bad else -4
    words = c.C.prepare(c.x, c.idx, c.w, E, 4, [22, E, 0, 1], 0)
    assert words.shape == (8 + E + 4,) and int(words[0]) == 22


# plan(words, rank, num_experts, align, capacity, transport, exchange, max_tokens_per_rank)
def plan_ok(c, words=None, rank=0, E=None, align=2, cap=-1, tr=1, ex=0, mt=-1):
    return c.C.plan(c.words if words is None else words, rank, c.E if E is None else E, align,
                    cap, tr, ex, mt)


for name, bad in [
    ("rank_equal_R", lambda c: plan_ok(c, rank=1)),
    ("rank_negative", lambda c: plan_ok(c, rank=-1)),
    ("rank_past_two_ranks", lambda c: plan_ok(c, words=c.words2, rank=2)),
    ("zero_ranks", lambda c: plan_ok(c, words=c.words[:0])),
    ("align_zero", lambda c: plan_ok(c, align=0)),
    ("align_negative", lambda c: plan_ok(c, align=-3)),
    ("align_absurd", lambda c: plan_ok(c, align=BIG)),
    ("capacity_negative", lambda c: plan_ok(c, cap=-5)),
    ("transport", lambda c: plan_ok(c, tr=2)),
    ("exchange", lambda c: plan_ok(c, ex=9)),
    ("static_without_max_tokens", lambda c: plan_ok(c, ex=5, mt=-1)),
    ("max_tokens_absurd", lambda c: plan_ok(c, ex=5, mt=BIG)),
    ("words_1d", lambda c: plan_ok(c, words=c.words.view(-1))),
    ("words_float", lambda c: plan_ok(c, words=c.words.float())),
    ("words_width", lambda c: plan_ok(c, words=c.words[:, :-1])),
    ("experts_disagree_with_words", lambda c: plan_ok(c, E=c.E + 1)),
    ("experts_not_multiple", lambda c: plan_ok(c, words=c.words2[:, :-1], E=c.E - 1)),
    ("negative_experts", lambda c: plan_ok(c, words=c.words[:, :8], E=-1)),
    ("absurd_experts", lambda c: plan_ok(c, E=BIG)),
    ("negative_count", lambda c: plan_ok(c, words=tampered(c.words, 8, -3))),
    ("negative_hidden", lambda c: plan_ok(c, words=tampered(c.words, 4, -1))),
]:
    simple("plan", name, plan_ok, bad)


@case("plan", "error_words_skip_the_option_checks")
def _(c, bad):
    # Words that carry an error make a plan carrying it, whatever align is (the collective
    # InputError path); with clean words the same align raises.
    words = c.words if bad else tampered(c.words, 0, 11)
    plan = plan_ok(c, words=words, align=0)
    assert int(plan[0]) == 11


# pack(x, topk_idx, topk_weights, plan, transport, num_ranks, send_bytes)
def pack(c, tr, x=None, idx=None, w=None, plan=None, tr_arg=None, R=1, SB=None, static=False):
    ch = c.chain(tr, static)
    return c.C.pack(c.x if x is None else x, c.idx if idx is None else idx,
                    c.w if w is None else w, ch["plan"] if plan is None else plan,
                    tr if tr_arg is None else tr_arg, R, ch["SB"] if SB is None else SB)


def pack_tampered(c, tr, word, value=None, add=None, static=False):
    ch = c.chain(tr, static)
    return pack(c, tr, plan=tampered(ch["plan"], word, value, add), static=static)


def pack_small_plan(c, tr):
    plan = c.small_plan(tr)
    return pack(c, tr, plan=plan, SB=int(plan[SEND_BYTES]))


o1 = offsets(1, Ctx.E)
for name, bad in [
    ("plan_from_a_smaller_call", pack_small_plan),
    ("plan_truncated", lambda c, tr: pack(c, tr, plan=c.chain(tr)["plan"][:-1])),
    ("plan_header_only", lambda c, tr: pack(c, tr, plan=c.chain(tr)["plan"][:abi.PLAN_HEADER])),
    ("plan_too_short", lambda c, tr: pack(c, tr, plan=c.chain(tr)["plan"][:5])),
    ("plan_float", lambda c, tr: pack(c, tr, plan=c.chain(tr)["plan"].double())),
    ("plan_2d", lambda c, tr: pack(c, tr, plan=c.chain(tr)["plan"].view(1, -1))),
    ("plan_zero_ranks", lambda c, tr: pack_tampered(c, tr, RANKS, 0)),
    ("plan_experts_not_multiple", lambda c, tr: pack_tampered(c, tr, RANKS, 3)),
    ("plan_local_experts", lambda c, tr: pack_tampered(c, tr, LOCAL_EXPERTS, 0)),
    ("plan_experts_absurd", lambda c, tr: pack_tampered(c, tr, EXPERTS, BIG)),
    ("plan_align_zero", lambda c, tr: pack_tampered(c, tr, ALIGN, 0)),
    ("plan_transport", lambda c, tr: pack_tampered(c, tr, TRANSPORT, 7)),
    ("plan_error_code", lambda c, tr: pack_tampered(c, tr, 0, 3)),
    ("plan_send_bytes", lambda c, tr: pack_tampered(c, tr, o1["send_bytes"], add=-1)),
    ("plan_send_counts", lambda c, tr: pack_tampered(c, tr, o1["send_counts"], 10 ** 6)),
    ("plan_send_counts_absurd", lambda c, tr: pack_tampered(c, tr, o1["send_counts"], 2 ** 62)),
    ("plan_own_kept", lambda c, tr: pack_tampered(c, tr, o1["own_kept"], add=2)),
    ("plan_own_kept_negative", lambda c, tr: pack_tampered(c, tr, o1["own_kept"], -5)),
    ("plan_static_cap", lambda c, tr: pack_tampered(c, tr, 16, 2 ** 61, static=True)),
    ("num_ranks", lambda c, tr: pack(c, tr, R=2)),
    ("transport_disagrees", lambda c, tr: pack(c, tr, tr_arg=1 - tr)),
    ("transport_code", lambda c, tr: pack(c, tr, tr_arg=3)),
    ("send_bytes", lambda c, tr: pack(c, tr, SB=c.chain(tr)["SB"] + 1)),
    ("send_bytes_negative", lambda c, tr: pack(c, tr, SB=-1)),
    ("send_bytes_absurd", lambda c, tr: pack(c, tr, SB=BIG)),
    ("index_equal_E", lambda c, tr: pack(c, tr, idx=tampered(c.idx, 4, c.E))),
    ("index_below_minus_one", lambda c, tr: pack(c, tr, idx=tampered(c.idx, 3, -2))),
    ("index_float", lambda c, tr: pack(c, tr, idx=c.idx.float())),
    ("hidden", lambda c, tr: pack(c, tr, x=c.x[:, :4])),
    ("x_rows", lambda c, tr: pack(c, tr, x=c.x[:3])),
    ("x_1d", lambda c, tr: pack(c, tr, x=c.x.view(-1))),
    ("weights_shape", lambda c, tr: pack(c, tr, w=c.w[:, :1])),
    ("weights_dtype", lambda c, tr: pack(c, tr, w=c.w.double())),
]:
    simple("pack", name, lambda c, tr: pack(c, tr), bad, BOTH)
simple("pack", "plan_send_slots", lambda c, tr: pack(c, tr),
       lambda c, tr: pack_tampered(c, tr, o1["send_slots"], add=5), (1,))
simple("pack", "static_plan_send_counts", lambda c, tr: pack(c, tr, static=True),
       lambda c, tr: pack_tampered(c, tr, o1["send_counts"], add=c.T * c.K, static=True), BOTH)


# unpack(recv, plan, transport, hidden, dtype, topk, recv_rows, expert_rows)
def unpack(c, tr, recv=None, plan=None, tr_arg=None, H=None, dtype=None, K=None, N=None, M=None,
           static=False):
    ch = c.chain(tr, static)
    return c.C.unpack(ch["send"] if recv is None else recv, ch["plan"] if plan is None else plan,
                      tr if tr_arg is None else tr_arg, c.H if H is None else H,
                      c.torch.float32 if dtype is None else dtype, c.K if K is None else K,
                      ch["N"] if N is None else N, ch["M"] if M is None else M)


def unpack_tampered(c, tr, word, value=None, add=None, static=False):
    return unpack(c, tr, plan=tampered(c.chain(tr, static)["plan"], word, value, add),
                  static=static)


def unpack_corrupt(c, tr, byte, value, static=False):
    """The received bytes with byte `byte` of the first row's meta (after H * 4 payload bytes,
    static: after the header row) set to `value`."""
    ch = c.chain(tr, static)
    B = c.H * 4 + (16 if tr == 0 else 8)
    recv = tampered(ch["send"], (B if static else 0) + c.H * 4 + byte, value)
    return unpack(c, tr, recv=recv, static=static)


def unpack_small_plan(c, tr):
    plan = c.small_plan(tr)
    return unpack(c, tr, plan=plan, N=int(plan[RECV_ROWS]), M=int(plan[EXPERT_ROWS]))


for name, bad in [
    ("plan_from_a_smaller_call", unpack_small_plan),
    ("recv_truncated", lambda c, tr: unpack(c, tr, recv=c.chain(tr)["send"][:-1])),
    ("recv_float", lambda c, tr: unpack(c, tr, recv=c.chain(tr)["send"].float())),
    ("recv_2d", lambda c, tr: unpack(c, tr, recv=c.chain(tr)["send"].view(1, -1))),
    ("plan_truncated", lambda c, tr: unpack(c, tr, plan=c.chain(tr)["plan"][:-2])),
    ("plan_zero_ranks", lambda c, tr: unpack_tampered(c, tr, RANKS, 0)),
    ("plan_transport", lambda c, tr: unpack_tampered(c, tr, TRANSPORT, -1)),
    ("plan_recv_counts", lambda c, tr: unpack_tampered(c, tr, o1["recv_counts"], 10 ** 9)),
    ("plan_recv_bytes", lambda c, tr: unpack_tampered(c, tr, o1["recv_bytes"], add=8)),
    ("plan_offsets", lambda c, tr: unpack_tampered(c, tr, o1["offsets"] + 1, -4)),
    ("plan_offsets_past_rows", lambda c, tr: unpack_tampered(c, tr, o1["offsets"], 10 ** 6)),
    ("plan_static_cap", lambda c, tr: unpack_tampered(c, tr, 16, 2 ** 61, static=True)),
    ("plan_recv_rows_small", lambda c, tr: unpack(c, tr, plan=tampered(c.chain(tr)["plan"],
                                                                       RECV_ROWS, 1), N=1)),
    ("transport_disagrees", lambda c, tr: unpack(c, tr, tr_arg=1 - tr)),
    ("hidden", lambda c, tr: unpack(c, tr, H=c.H + 1)),
    ("hidden_negative", lambda c, tr: unpack(c, tr, H=-8)),
    ("dtype", lambda c, tr: unpack(c, tr, dtype=c.torch.bfloat16)),
    ("topk_negative", lambda c, tr: unpack(c, tr, K=-1)),  # K = 0 is valid (empty routing)
    ("topk_absurd", lambda c, tr: unpack(c, tr, K=BIG)),
    ("recv_rows", lambda c, tr: unpack(c, tr, N=c.chain(tr)["N"] + 1)),
    ("expert_rows", lambda c, tr: unpack(c, tr, M=c.chain(tr)["M"] - 1)),
    ("expert_rows_negative", lambda c, tr: unpack(c, tr, M=-1)),
    ("static_inband_count", lambda c, tr: unpack(c, tr, recv=tampered(
        c.chain(tr, True)["send"], 0, 99), static=True)),
]:
    simple("unpack", name, lambda c, tr: unpack(c, tr), bad, BOTH)
simple("unpack", "plan_recv_kept", lambda c, tr: unpack(c, tr),
       lambda c, tr: unpack_tampered(c, tr, o1["recv_kept"], add=3), (0,))
simple("unpack", "plan_recv_slots", lambda c, tr: unpack(c, tr),
       lambda c, tr: unpack_tampered(c, tr, o1["recv_slots"], add=1), (1,))
for name, byte, value in [("slot_count", 4, 100), ("slot_count_negative", 7, 255)]:
    simple("unpack", f"corrupt_{name}", lambda c, tr: unpack(c, tr),
           lambda c, tr, byte=byte, value=value: unpack_corrupt(c, tr, byte, value), (1,))
simple("unpack", "corrupt_slot_word_k", lambda c, tr: unpack(c, tr),
       lambda c, tr: unpack(c, tr, recv=tampered(c.chain(tr)["send"],
                                                 c.chain(tr)["send"].numel() - 5, 0x7F)), (1,))


# gather_rows(expert_y, recv_map, row_weight, transport, weighted)
def gather(c, tr, y=None, rmap=None, rw=None, tr_arg=None, weighted=True):
    ch = c.chain(tr)
    return c.C.gather_rows(ch["y"] if y is None else y, ch["recv_map"] if rmap is None else rmap,
                           ch["rw"] if rw is None else rw, tr if tr_arg is None else tr_arg,
                           weighted)


def map_entry(c, tr, key, value, at=None):
    m = c.chain(tr)[key]
    if at is None:  # the first entry that names a row
        at = int((m.view(-1) >= 0).nonzero()[0])
    return tampered(m, at, value)


for name, bad in [
    ("map_one_past_the_end", lambda c, tr: gather(c, tr, rmap=map_entry(c, tr, "recv_map",
                                                                        c.chain(tr)["M"]))),
    ("map_absurd", lambda c, tr: gather(c, tr, rmap=map_entry(c, tr, "recv_map", BIG))),
    ("map_below_minus_one", lambda c, tr: gather(c, tr, rmap=map_entry(c, tr, "recv_map", -2))),
    ("map_int32", lambda c, tr: gather(c, tr, rmap=c.chain(tr)["recv_map"].int())),
    ("map_1d", lambda c, tr: gather(c, tr, rmap=c.chain(tr)["recv_map"].view(-1))),
    ("y_1d", lambda c, tr: gather(c, tr, y=c.chain(tr)["y"].view(-1))),
    ("transport_code", lambda c, tr: gather(c, tr, tr_arg=2)),
]:
    simple("gather_rows", name, lambda c, tr: gather(c, tr), bad, BOTH)
for name, bad in [
    ("row_weight_empty", lambda c, tr: gather(c, tr, rw=c.chain(tr)["rw"][:0])),
    ("row_weight_short", lambda c, tr: gather(c, tr, rw=c.chain(tr)["rw"][:-1])),
    ("row_weight_double", lambda c, tr: gather(c, tr, rw=c.chain(tr)["rw"].double())),
    ("y_int", lambda c, tr: gather(c, tr, y=c.chain(tr)["y"].int())),
]:
    simple("gather_rows", name, lambda c, tr: gather(c, tr), bad, (1,))
simple("gather_rows", "pairs_map_two_columns", lambda c, tr: gather(c, tr),
       lambda c, tr: gather(c, tr, rmap=c.chain(tr)["recv_map"].repeat(1, 2)), (0,))


@case("gather_rows", "map_expanded", BOTH)
def _(c, bad, tr):
    # A broadcast map reads like its contiguous copy (never past its storage); one whose one
    # stored row is out of range raises.
    ch = c.chain(tr)
    row = map_entry(c, tr, "recv_map", ch["M"] if bad else 0)[:1]
    got = gather(c, tr, rmap=row.expand(ch["N"], -1))
    assert c.torch.equal(got, gather(c, tr, rmap=row.expand(ch["N"], -1).contiguous()))


# gather_units(expert_y, recv_map, row_weight, transport, weighted, first, out)
def gunits(c, tr, y=None, rmap=None, first="same", out=None, tr_arg=None):
    ch = c.chain(tr)
    y = ch["y"] if y is None else y
    out = c.torch.empty((ch["units"], y.shape[1]), dtype=y.dtype) if out is None else out
    c.C.gather_units(y, ch["recv_map"] if rmap is None else rmap, ch["rw"],
                     tr if tr_arg is None else tr_arg, True,
                     ch["ufirst"] if isinstance(first, str) else first, out)
    return out


for name, bad in [
    ("map_one_past_the_end", lambda c, tr: gunits(c, tr, rmap=map_entry(c, tr, "recv_map",
                                                                        c.chain(tr)["M"]))),
    ("map_absurd", lambda c, tr: gunits(c, tr, rmap=map_entry(c, tr, "recv_map", BIG))),
    ("out_dtype", lambda c, tr: gunits(c, tr, out=c.torch.empty(
        (c.chain(tr)["units"], c.H), dtype=c.torch.bfloat16))),
    ("out_1d", lambda c, tr: gunits(c, tr, out=c.torch.empty(c.chain(tr)["units"] * c.H))),
    ("out_hidden", lambda c, tr: gunits(c, tr, out=c.torch.empty((c.chain(tr)["units"], c.H + 1)))),
    ("out_strided", lambda c, tr: gunits(c, tr, out=c.torch.empty(
        (c.chain(tr)["units"], 2 * c.H))[:, ::2])),
    ("out_short", lambda c, tr: gunits(c, tr, out=c.torch.empty(
        (c.chain(tr)["units"] - 1, c.H)))),
    ("transport_code", lambda c, tr: gunits(c, tr, tr_arg=2)),
]:
    simple("gather_units", name, lambda c, tr: gunits(c, tr), bad, BOTH)
for name, bad in [
    ("first_missing", lambda c, tr: gunits(c, tr, first=None)),
    ("first_int32", lambda c, tr: gunits(c, tr, first=c.chain(tr)["ufirst"].int())),
    ("first_short", lambda c, tr: gunits(c, tr, first=c.chain(tr)["ufirst"][:-1])),
    ("first_2d", lambda c, tr: gunits(c, tr, first=c.chain(tr)["ufirst"].view(1, -1))),
    ("first_negative", lambda c, tr: gunits(c, tr, first=tampered(c.chain(tr)["ufirst"], 0, -5))),
    ("first_past_out", lambda c, tr: gunits(c, tr, first=tampered(c.chain(tr)["ufirst"], 0,
                                                                  c.chain(tr)["units"]))),
]:
    simple("gather_units", name, lambda c, tr: gunits(c, tr), bad, (1,))
simple("gather_units", "pairs_with_first", lambda c, tr: gunits(c, tr),
       lambda c, tr: gunits(c, tr, first=c.torch.zeros(c.chain(tr)["N"], dtype=c.torch.int64)),
       (0,))


# pack_into(x, topk_idx, topk_weights, plan, transport, num_ranks, send): pack's arguments
# (their cases are pack's), and the buffer it writes
def pack_into(c, tr, send=None):
    ch = c.chain(tr)
    send = c.torch.empty(ch["SB"], dtype=c.torch.uint8) if send is None else send
    return c.C.pack_into(c.x, c.idx, c.w, ch["plan"], tr, 1, send)


for name, bad in [
    ("send_int64", lambda c, tr: pack_into(c, tr, send=c.torch.empty(
        -(-c.chain(tr)["SB"] // 8), dtype=c.torch.int64))),
    ("send_2d", lambda c, tr: pack_into(c, tr, send=c.torch.empty(
        (1, c.chain(tr)["SB"]), dtype=c.torch.uint8))),
    ("send_strided", lambda c, tr: pack_into(c, tr, send=c.torch.empty(
        2 * c.chain(tr)["SB"], dtype=c.torch.uint8)[::2])),
    ("transport_code", lambda c, tr: c.C.pack_into(c.x, c.idx, c.w, c.chain(tr)["plan"], 3, 1,
                                                   c.torch.empty(c.chain(tr)["SB"],
                                                                 dtype=c.torch.uint8))),
]:
    simple("pack_into", name, lambda c, tr: pack_into(c, tr), bad, BOTH)


# scatter_rows_into(src, send_map, out)
def srows_into(c, tr, src=None, smap=None, out=None):
    ch = c.chain(tr)
    out = c.torch.empty((ch["S"], c.H)) if out is None else out
    c.C.scatter_rows_into(c.x if src is None else src, ch["send_map"] if smap is None else smap,
                          out)
    return out


for name, bad in [
    ("out_dtype", lambda c, tr: srows_into(c, tr, out=c.torch.empty(
        (c.chain(tr)["S"], c.H), dtype=c.torch.bfloat16))),
    ("out_hidden", lambda c, tr: srows_into(c, tr, out=c.torch.empty((c.chain(tr)["S"], c.H + 1)))),
    ("out_1d", lambda c, tr: srows_into(c, tr, out=c.torch.empty(c.chain(tr)["S"] * c.H))),
    ("out_strided", lambda c, tr: srows_into(c, tr, out=c.torch.empty(
        (c.chain(tr)["S"], 2 * c.H))[:, ::2])),
    ("out_short", lambda c, tr: srows_into(c, tr, out=c.torch.empty(
        (c.chain(tr)["S"] - 1, c.H)))),
    ("map_rows", lambda c, tr: srows_into(c, tr, smap=c.chain(tr)["send_map"][:-1])),
]:
    simple("scatter_rows_into", name, lambda c, tr: srows_into(c, tr), bad, BOTH)


# empty_large(like, size, dtype)
for name, bad in [
    ("negative_size", lambda c: c.C.empty_large(c.x, [-1, 4], c.torch.float32)),
]:
    simple("empty_large", name, lambda c: c.C.empty_large(c.x, [3, 4], c.torch.float32), bad)


# reduce_tokens(back, send_map, topk_idx, topk_weights, E, R, transport, weighted, out_dtype)
def reduce(c, tr, back=None, smap=None, idx=None, w=None, E=None, R=1, tr_arg=None, weighted=True,
           dtype=None):
    ch = c.chain(tr)
    return c.C.reduce_tokens(ch["rows"] if back is None else back,
                             ch["send_map"] if smap is None else smap, c.idx if idx is None else idx,
                             c.w if w is None else w, c.E if E is None else E, R,
                             tr if tr_arg is None else tr_arg, weighted,
                             c.torch.float32 if dtype is None else dtype)


for name, bad in [
    ("experts_below_ranks", lambda c, tr: reduce(c, tr, E=1, R=2)),
    ("zero_ranks", lambda c, tr: reduce(c, tr, R=0)),
    ("experts_not_multiple", lambda c, tr: reduce(c, tr, E=5, R=2)),
    ("negative_experts", lambda c, tr: reduce(c, tr, E=-4)),
    ("map_equal_rows", lambda c, tr: reduce(c, tr, smap=map_entry(c, tr, "send_map",
                                                                 c.chain(tr)["S"]))),
    ("map_absurd", lambda c, tr: reduce(c, tr, smap=map_entry(c, tr, "send_map", -BIG))),
    ("map_int32", lambda c, tr: reduce(c, tr, smap=c.chain(tr)["send_map"].int())),
    ("map_columns", lambda c, tr: reduce(c, tr, smap=c.chain(tr)["send_map"][:, :1].repeat(1, 3))),
    ("idx_rows", lambda c, tr: reduce(c, tr, idx=c.idx[:2])),
    ("back_1d", lambda c, tr: reduce(c, tr, back=c.chain(tr)["rows"].view(-1))),
    ("back_int", lambda c, tr: reduce(c, tr, back=c.chain(tr)["rows"].int())),
    ("out_dtype", lambda c, tr: reduce(c, tr, dtype=c.torch.int32)),
    ("transport_code", lambda c, tr: reduce(c, tr, tr_arg=5)),
]:
    simple("reduce_tokens", name, lambda c, tr: reduce(c, tr), bad, BOTH)
for name, bad in [
    ("used_slot_without_expert", lambda c, tr: reduce(c, tr, idx=tampered(c.idx, 0, -1))),
    ("expert_past_E", lambda c, tr: reduce(c, tr, idx=tampered(c.idx, 0, c.E))),
    ("weights_empty", lambda c, tr: reduce(c, tr, w=c.w.new_zeros(0))),
    ("weights_shape", lambda c, tr: reduce(c, tr, w=c.w[:, :1])),
]:
    simple("reduce_tokens", name, lambda c, tr: reduce(c, tr), bad, (0,))


# scatter_rows(src, send_map, send_rows)
def scatter(c, tr, src=None, smap=None, S=None):
    ch = c.chain(tr)
    return c.C.scatter_rows(c.x if src is None else src, ch["send_map"] if smap is None else smap,
                            ch["S"] if S is None else S)


for name, bad in [
    ("index_equal_send_rows", lambda c, tr: scatter(c, tr, smap=map_entry(c, tr, "send_map",
                                                                         c.chain(tr)["S"]))),
    ("index_absurd", lambda c, tr: scatter(c, tr, smap=map_entry(c, tr, "send_map", BIG))),
    ("index_below_minus_one", lambda c, tr: scatter(c, tr, smap=map_entry(c, tr, "send_map", -3))),
    ("send_rows_small", lambda c, tr: scatter(c, tr, S=1)),
    ("send_rows_negative", lambda c, tr: scatter(c, tr, S=-1)),
    ("map_rows", lambda c, tr: scatter(c, tr, smap=c.chain(tr)["send_map"][:2])),
    ("map_float", lambda c, tr: scatter(c, tr, smap=c.chain(tr)["send_map"].double())),
    ("src_1d", lambda c, tr: scatter(c, tr, src=c.x.view(-1))),
]:
    simple("scatter_rows", name, lambda c, tr: scatter(c, tr), bad, BOTH)


# combine_backward_dest(recv, recv_map, row_weight, expert_y, weighted)
def cbd(c, tr, recv=None, rmap=None, rw=None, y=None, weighted=True):
    ch = c.chain(tr)
    return c.C.combine_backward_dest(ch["grad_rows"] if recv is None else recv,
                                     ch["recv_map"] if rmap is None else rmap,
                                     ch["rw"] if rw is None else rw, ch["y"] if y is None else y,
                                     weighted)


for name, bad in [
    ("map_one_past_the_end", lambda c, tr: cbd(c, tr, rmap=map_entry(c, tr, "recv_map",
                                                                     c.chain(tr)["M"]))),
    ("map_negative", lambda c, tr: cbd(c, tr, rmap=map_entry(c, tr, "recv_map", -BIG))),
    ("map_int32", lambda c, tr: cbd(c, tr, rmap=c.chain(tr)["recv_map"].int())),
    ("recv_rows", lambda c, tr: cbd(c, tr, recv=c.chain(tr)["grad_rows"][:1])),
    ("recv_hidden", lambda c, tr: cbd(c, tr, recv=c.chain(tr)["grad_rows"][:, :3])),
    ("recv_int", lambda c, tr: cbd(c, tr, recv=c.chain(tr)["grad_rows"].int())),
    ("row_weight_empty", lambda c, tr: cbd(c, tr, rw=c.chain(tr)["rw"][:0])),
    ("row_weight_2d", lambda c, tr: cbd(c, tr, rw=c.chain(tr)["rw"].view(1, -1))),
    ("y_1d", lambda c, tr: cbd(c, tr, y=c.chain(tr)["y"].view(-1))),
    ("y_double", lambda c, tr: cbd(c, tr, y=c.chain(tr)["y"].double())),
]:
    simple("combine_backward_dest", name, lambda c, tr: cbd(c, tr), bad, BOTH)

# quantize_mxfp8(x)
Q_OK = lambda c: c.C.quantize_mxfp8(c.torch.randn(3, 64))  # noqa: E731
for name, bad in [
    ("hidden_not_multiple_of_32", lambda c: c.C.quantize_mxfp8(c.torch.randn(3, 48))),
    ("x_1d", lambda c: c.C.quantize_mxfp8(c.torch.randn(64))),
    ("x_int", lambda c: c.C.quantize_mxfp8(c.torch.ones(3, 64, dtype=c.torch.int32))),
    ("x_double", lambda c: c.C.quantize_mxfp8(c.torch.randn(3, 64, dtype=c.torch.float64))),
]:
    simple("quantize_mxfp8", name, Q_OK, bad)

# quantize_fp8_block128(x)
QB_OK = lambda c: c.C.quantize_fp8_block128(c.torch.randn(3, 256))  # noqa: E731
for name, bad in [
    ("hidden_not_multiple_of_128", lambda c: c.C.quantize_fp8_block128(c.torch.randn(3, 96))),
    ("x_1d", lambda c: c.C.quantize_fp8_block128(c.torch.randn(128))),
    ("x_int", lambda c: c.C.quantize_fp8_block128(c.torch.ones(3, 128, dtype=c.torch.int32))),
    ("x_double", lambda c: c.C.quantize_fp8_block128(c.torch.randn(3, 128, dtype=c.torch.float64))),
]:
    simple("quantize_fp8_block128", name, QB_OK, bad)


# gather_slot_values(values, recv_map, first, out_rows)
def gsv(c, tr, vals=None, rmap=None, first=None, rows=None):
    ch = c.chain(tr)
    return c.C.gather_slot_values(ch["rw"] if vals is None else vals,
                                  ch["recv_map"] if rmap is None else rmap,
                                  ch["first"] if first is None else first,
                                  ch["slots"] if rows is None else rows)


for name, bad in [
    ("map_one_past_the_end", lambda c, tr: gsv(c, tr, rmap=map_entry(c, tr, "recv_map",
                                                                     c.chain(tr)["M"]))),
    ("map_below_minus_one", lambda c, tr: gsv(c, tr, rmap=map_entry(c, tr, "recv_map", -3))),
    ("values_empty", lambda c, tr: gsv(c, tr, vals=c.chain(tr)["rw"][:0])),
    ("values_2d", lambda c, tr: gsv(c, tr, vals=c.chain(tr)["rw"].view(1, -1))),
    ("values_double", lambda c, tr: gsv(c, tr, vals=c.chain(tr)["rw"].double())),
    ("map_int32", lambda c, tr: gsv(c, tr, rmap=c.chain(tr)["recv_map"].int())),
    ("first_int32", lambda c, tr: gsv(c, tr, first=c.chain(tr)["first"].int())),
    ("first_2d", lambda c, tr: gsv(c, tr, first=c.chain(tr)["first"].view(1, -1))),
    ("first_rows", lambda c, tr: gsv(c, tr, first=c.chain(tr)["first"][:-1])),
    ("first_past_out_rows", lambda c, tr: gsv(c, tr, first=tampered(c.chain(tr)["first"], 0,
                                                                    c.chain(tr)["slots"]))),
    ("first_none_for_a_named_row", lambda c, tr: gsv(c, tr, first=tampered(
        c.chain(tr)["first"], 0, -1))),
    ("out_rows_short", lambda c, tr: gsv(c, tr, rows=c.chain(tr)["slots"] - 1)),
    ("out_rows_negative", lambda c, tr: gsv(c, tr, rows=-1)),
]:
    simple("gather_slot_values", name, lambda c, tr: gsv(c, tr), bad, BOTH)


# scatter_slot_values(back, send_map, topk_idx, first, E, R, transport)
def ssv(c, tr, back=None, smap=None, idx=None, E=None, R=1, tr_arg=None, first=None):
    ch = c.chain(tr)
    return c.C.scatter_slot_values(ch["vals"] if back is None else back,
                                   ch["send_map"] if smap is None else smap,
                                   c.idx if idx is None else idx,
                                   ch["first"] if first is None else first,
                                   c.E if E is None else E, R, tr if tr_arg is None else tr_arg)


for name, bad in [
    ("experts_below_ranks", lambda c, tr: ssv(c, tr, E=1, R=2)),
    ("zero_ranks", lambda c, tr: ssv(c, tr, R=0)),
    ("experts_not_multiple", lambda c, tr: ssv(c, tr, E=6, R=4)),
    ("map_equal_rows", lambda c, tr: ssv(c, tr, smap=map_entry(c, tr, "send_map",
                                                              c.chain(tr)["first"].shape[0]))),
    ("map_below_minus_one", lambda c, tr: ssv(c, tr, smap=map_entry(c, tr, "send_map", -2))),
    ("index_equal_E", lambda c, tr: ssv(c, tr, idx=tampered(c.idx, 0, c.E))),
    ("index_below_minus_one", lambda c, tr: ssv(c, tr, idx=tampered(c.idx, 0, -5))),
    ("map_columns", lambda c, tr: ssv(c, tr, smap=c.chain(tr)["send_map"][:, :1].repeat(1, 3))),
    ("map_rows", lambda c, tr: ssv(c, tr, smap=c.chain(tr)["send_map"][:2])),
    ("back_2d", lambda c, tr: ssv(c, tr, back=c.chain(tr)["vals"].view(-1, 1))),
    ("back_short", lambda c, tr: ssv(c, tr, back=c.chain(tr)["vals"][:-1])),
    ("back_double", lambda c, tr: ssv(c, tr, back=c.chain(tr)["vals"].double())),
    ("first_int32", lambda c, tr: ssv(c, tr, first=c.chain(tr)["first"].int())),
    ("first_2d", lambda c, tr: ssv(c, tr, first=c.chain(tr)["first"].view(1, -1))),
    ("first_none_for_a_sent_row", lambda c, tr: ssv(c, tr, first=tampered(
        c.chain(tr)["first"], 0, -1))),
    ("first_past_back", lambda c, tr: ssv(c, tr, first=tampered(c.chain(tr)["first"], 0,
                                                                c.chain(tr)["slots"]))),
    ("transport_code", lambda c, tr: ssv(c, tr, tr_arg=-1)),
]:
    simple("scatter_slot_values", name, lambda c, tr: ssv(c, tr), bad, BOTH)

OPS = ("layout", "prepare", "plan", "pack", "pack_into", "unpack", "gather_rows", "gather_units",
       "reduce_tokens", "scatter_rows_into", "empty_large",
       "scatter_rows", "combine_backward_dest", "quantize_mxfp8", "quantize_fp8_block128",
       "gather_slot_values", "scatter_slot_values")


# ---- running the cases in children ----------------------------------------------------------

def _load(lib):
    if lib:
        import torch

        torch.ops.load_library(lib)
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        from epkit import _build

        _build.load()


def _child(lib, ids):
    """Run cases `ids`; before each call a START line (so a crash is pinned on its case and
    call), after each case its result as JSON: {"valid": error or None, "bad": [type, message]
    or None}."""
    _load(lib)
    import torch

    torch.set_num_threads(1)
    c = Ctx()
    for i in ids:
        op, name, fn = CASES[i]
        res = {}
        for bad in (False, True):
            print(f"START {i} {int(bad)}", flush=True)
            try:
                fn(c, bad)
                res["bad" if bad else "valid"] = None
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                msg = str(exc).split("\n")[0]
                res["bad" if bad else "valid"] = [type(exc).__name__, msg] if bad else \
                    f"{type(exc).__name__}: {msg}\n{traceback.format_exc()}"
        print(f"RESULT {i} {json.dumps(res)}", flush=True)
    print("END", flush=True)


def run_cases(ids=None, lib=None, timeout=600):
    """Every case in children: {id: result}; a result is the child's JSON, or
    {"crash": description} for the case a child died in (the rest go on in a fresh child)."""
    todo = list(range(len(CASES)) if ids is None else ids)
    results = {}
    while todo:
        code = (f"import sys; sys.path.insert(0, {HERE!r}); import test_raw_ops as t; "
                f"t._child({lib!r}, {todo!r})")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=os.environ.copy())
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started, call = (int(v) for v in line.split()[1:])
            elif line.startswith("RESULT "):
                _, i, js = line.split(" ", 2)
                results[int(i)] = json.loads(js)
                started = None
        done = set(results)
        if "END" in proc.stdout.splitlines() and proc.returncode == 0:
            break
        tail = proc.stderr[-3000:]
        if started is None:  # died before its first case (or after its last): not a case's fault
            raise RuntimeError(f"raw-ops child failed outside any case (rc {proc.returncode}):\n"
                               f"{tail}")
        sig = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        asan = "ERROR: AddressSanitizer" in proc.stderr
        results[started] = {"crash": f"{sig}{' (AddressSanitizer report)' if asan else ''} in "
                                     f"the {('valid', 'malformed')[call]} call", "stderr": tail}
        done.add(started)
        todo = [i for i in todo if i not in done]
    return results


def verdict(i, res):
    """None if case i passed, else why not."""
    op, name, _ = CASES[i]
    if "crash" in res:
        return f"CRASH: {res['crash']}:\n{res['stderr']}"
    if res["valid"] is not None:
        return f"the valid call raised: {res['valid']}"
    if res["bad"] is None:
        return "the malformed call did not raise"
    kind, msg = res["bad"]
    if kind not in ERRORS:
        return f"the malformed call raised {kind}, not one of {ERRORS}: {msg}"
    if not msg.startswith(f"epkit.{op}:"):
        return f"the message does not start 'epkit.{op}:': {msg}"
    return None


# ---- pytest -------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # the command needs no pytest
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def results():
        return run_cases()

    @pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{o}-{n}" for o, n, _ in CASES])
    def test_malformed_call_raises(results, i):
        why = verdict(i, results[i])
        assert why is None, f"{CASES[i][0]} / {CASES[i][1]}: {why}"

    def test_every_op_has_cases():
        ops = {op for op, _, _ in CASES}
        assert ops == set(OPS), sorted(set(OPS) ^ ops)


def main(argv):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", help="load this kernel library instead of building epkit")
    args = ap.parse_args(argv)
    res = run_cases(lib=args.lib)
    failed = {i: verdict(i, r) for i, r in res.items() if verdict(i, r)}
    crashes = sum("crash" in r for r in res.values())
    asan = sum("AddressSanitizer" in r.get("crash", "") for r in res.values())
    for i, why in sorted(failed.items()):
        print(f"FAIL {CASES[i][0]} / {CASES[i][1]}: {why}")
    per_op = {op: sum(o == op for o, _, _ in CASES) for op in OPS}
    print("cases per op: " + ", ".join(f"{op} {n}" for op, n in per_op.items()))
    print(f"raw ops: {len(res)} cases (each a valid and a malformed call) over {len(per_op)} ops: "
          f"{len(res) - len(failed)} passed, {len(failed)} failed, {crashes} crashed "
          f"({asan} with an AddressSanitizer report)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
