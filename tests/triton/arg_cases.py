"""One table of the C++ ops' argument errors: every case is a bad call, ``name -> (op, args)``.

The C++ kernels keep their checks (csrc/checks.h) as the CPU path's own guard; the Triton
kernels run the same checks in Python (triton/rowchecks.py, wirechecks.py, the paths' own);
test_arg_messages.py holds both to one message for every case here, word for word. Metadata
errors (a shape, a dtype, an option, the plan's words) and, on CPU tensors, the data errors the
C++ kernels raise (a map entry out of range, a row named twice). The cases are built from
small groups and inputs when the test module is collected.
"""

from __future__ import annotations

import numpy as np
import torch

from test_combine import expert_side, layout, source_side
from test_plan import direct_words
from wire_cases import make_group

PAIRS, DEDUP = 0, 1
BIG = 1 << 40
BF = torch.bfloat16


def _layout_prepare(cpp):
    out = {}
    idx3 = torch.tensor([[0, 3], [1, -1], [2, 0]])
    for name, kind, E, R in (("1d", "1d", 4, 1), ("float", "float", 4, 1), ("bool", "bool", 4, 1),
                             ("zero_ranks", "ok", 4, 0), ("negative_ranks", "ok", 4, -2),
                             ("experts_not_multiple", "ok", 3, 2), ("too_few_experts", "ok", 1, 2),
                             ("negative_experts", "ok", -4, 1), ("absurd_experts", "ok", BIG, 1),
                             ("absurd_both", "ok", BIG, BIG)):
        idx = {"1d": idx3.view(-1), "float": idx3.float(), "bool": idx3 > 0, "ok": idx3}[kind]
        out[f"layout.{name}"] = ("layout", (idx, E, R))
    x, idx, w = torch.randn(6, 8), torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1], [-1, -1],
                                                  [1, 2]]), torch.rand(6, 2)
    ok = [0, 0, 0, 1]
    for name, args in {
        "empty_pre_error": (x, idx, w, 4, 1, [], 0),
        "short_pre_error": (x, idx, w, 4, 1, [0, 0], 0),
        "negative_experts": (x, idx, w, -4, 1, ok, 0),
        "negative_experts_past_header": (x, idx, w, -9, 4, [22, -9, 0, 1], 0),
        "zero_ranks": (x, idx, w, 4, 0, ok, 0),
        "absurd_experts": (x, idx, w, BIG, 1, ok, 0),
        "absurd_experts_on_error": (x, idx, w, BIG, 1, [22, 0, 0, 1], 0),
        "experts_not_multiple": (x, idx, w, 3, 2, ok, 0),
        "x_1d": (x.view(-1), idx, w, 4, 1, ok, 0),
        "x_int": (x.int(), idx, w, 4, 1, ok, 0),
        "x_half": (x.half(), idx, w, 4, 1, ok, 0),
        "idx_rows": (x, idx[:3], w[:3], 4, 1, ok, 0),
        "idx_float": (x, idx.float(), w, 4, 1, ok, 0),
        "idx_bool": (x, idx > 0, w, 4, 1, ok, 0),
        "weights_shape": (x, idx, w[:, :1], 4, 1, ok, 0),
        "weights_1d": (x, idx, w.view(-1), 4, 1, ok, 0),
        "weights_double": (x, idx, w.double(), 4, 1, ok, 0),
        "payload_code": (x, idx, w, 4, 1, ok, 3),
        "max_tokens": (x, idx, w, 4, 1, [0, 0, 0, 1, -7], 0),
    }.items():
        out[f"prepare.{name}"] = ("prepare", args)
    return out


def _plan(cpp):
    rng = np.random.default_rng(2)
    w1, w2 = direct_words(rng, 1, 4, 2, 8, 1, 0, 3), direct_words(rng, 2, 4, 2, 8, 1, 0, 3)
    ok = dict(words=w1, rank=0, E=4, align=2, cap=-1, tr=1, ex=0, mt=-1)

    def call(**kw):
        a = dict(ok, **kw)
        return "plan", (a["words"], a["rank"], a["E"], a["align"], a["cap"], a["tr"], a["ex"],
                        a["mt"])

    return {f"plan.{k}": v for k, v in {
        "rank_equal_R": call(rank=1), "rank_negative": call(rank=-1),
        "rank_past_two_ranks": call(words=w2, rank=2), "zero_ranks": call(words=w1[:0]),
        "transport": call(tr=2), "exchange": call(ex=9), "exchange_negative": call(ex=-1),
        "words_1d": call(words=w1.view(-1)), "words_float": call(words=w1.float()),
        "words_int32": call(words=w1.int()), "words_width": call(words=w1[:, :-1]),
        "experts_disagree_with_words": call(E=5), "negative_experts": call(words=w1[:, :8], E=-1),
        "absurd_experts": call(E=2**40), "align": call(align=0), "capacity": call(cap=-2),
        "max_tokens": call(mt=-2),
    }.items()}


def _pack_unpack(cpp):
    g = make_group(cpp, 2, 2, 2, [4, 3], 8, "dedup", "static", seed=1)
    x, idx, w, plan = g.rows[0], g.idxs[0], g.ws[0], g.plans[0]
    SB = g.word(0, "SEND_BYTES")
    u8 = torch.uint8
    out = {
        "pack.weights_dtype": ("pack", (x, idx, w.double(), plan, 1, 2, SB)),
        "pack.idx_rows": ("pack", (x, idx[:2], w[:2], plan, 1, 2, SB)),
        "pack.idx_float": ("pack", (x, idx.float(), w, plan, 1, 2, SB)),
        "pack.send_bytes": ("pack", (x, idx, w, plan, 1, 2, SB + 1)),
        "pack.num_ranks": ("pack", (x, idx, w, plan, 1, 3, SB)),
        "pack.transport": ("pack", (x, idx, w, plan, 0, 2, SB)),
        "pack.bad_transport": ("pack", (x, idx, w, plan, 7, 2, SB)),
        "pack.plan_short": ("pack", (x, idx, w, plan[:-1], 1, 2, SB)),
        "pack.plan_int32": ("pack", (x, idx, w, plan.int(), 1, 2, SB)),
        "pack.payload": ("pack", (x[:, :4], idx, w, plan, 1, 2, SB)),
        "pack.plan_host_words": ("pack", (x, idx, w, plan, 1, 2, SB, plan[:-1].clone())),
        "pack.plan_host_dtype": ("pack", (x, idx, w, plan, 1, 2, SB, plan.int())),
        "pack_into.send_dtype": ("pack_into", (x, idx, w, plan, 1, 2,
                                               torch.zeros(SB // 4, dtype=torch.int32))),
        "pack_into.send_size": ("pack_into", (x, idx, w, plan, 1, 2, torch.zeros(SB + 8, dtype=u8))),
        "pack_into.plan_host_2d": ("pack_into", (x, idx, w, plan, 1, 2, torch.zeros(SB, dtype=u8),
                                                 plan.view(1, -1).clone())),
        "scatter_rows.map_dtype": ("scatter_rows", (x, idx.int(), 4)),
        "scatter_rows.rows": ("scatter_rows", (x, idx, -1)),
        "scatter_rows_into.out_hidden": ("scatter_rows_into", (x, idx, torch.zeros(9, 7,
                                                                                 dtype=x.dtype))),
    }
    # data errors on CPU tensors (the C++ kernels' range checks)
    p = make_group(cpp, 2, 2, 2, [4, 3], 8, "pairs", "ragged", seed=1)
    px, pw, pplan, PSB = p.rows[0], p.ws[0], p.plans[0], p.word(0, "SEND_BYTES")
    m = torch.tensor([[0, -1], [2, 1], [-1, 3]])
    out.update({
        "pack.expert": ("pack", (px, torch.where(p.idxs[0] == 1, 4, p.idxs[0]), pw, pplan, 0, 2,
                                 PSB)),
        "pack.expert_below": ("pack", (px, torch.where(p.idxs[0] == 1, -2, p.idxs[0]), pw, pplan,
                                       0, 2, PSB)),
        "scatter_rows.map_range": ("scatter_rows", (px[:3], torch.where(m == 3, 4, m), 4)),
        "scatter_rows.map_twice": ("scatter_rows", (px[:3], torch.where(m == 3, 0, m), 4)),
        "scatter_rows_into.map_twice": ("scatter_rows_into", (px[:3], torch.where(m == 3, 1, m),
                                                              torch.zeros(4, 8, dtype=px.dtype))),
    })
    d = make_group(cpp, 2, 2, 2, [4, 3], 8, "dedup", "ragged", seed=1)
    send = [cpp.pack(d.rows[r], d.idxs[r], d.ws[r], d.plans[r], 1, 2, d.word(r, "SEND_BYTES"))[0]
            for r in range(2)]
    recv, dplan = d.recv(send)[0], d.plans[0]
    N, M = d.word(0, "RECV_ROWS"), d.word(0, "EXPERT_ROWS")
    for name, args in {
        "recv_dtype": (recv.view(torch.int8), dplan, 1, 8, BF, 2, N, M),
        "recv_2d": (recv.view(1, -1), dplan, 1, 8, BF, 2, N, M),
        "transport": (recv, dplan, 0, 8, BF, 2, N, M),
        "hidden": (recv, dplan, 1, 4, BF, 2, N, M),
        "topk": (recv, dplan, 1, 8, BF, 256, N, M),
        "recv_rows": (recv, dplan, 1, 8, BF, 2, N + 1, M),
        "expert_rows": (recv, dplan, 1, 8, BF, 2, N, M + 1),
        "recv_bytes": (recv[:-1], dplan, 1, 8, BF, 2, N, M),
        "plan_dtype": (recv, dplan.int(), 1, 8, BF, 2, N, M),
        "plan_short": (recv, dplan[:-1], 1, 8, BF, 2, N, M),
        "plan_host_words": (recv, dplan, 1, 8, BF, 2, N, M, dplan[1:].clone()),
    }.items():
        out[f"unpack.{name}"] = ("unpack", args)
    return out


def _combine(cpp):
    rng = np.random.default_rng(0)
    rmap, y, w = expert_side(rng, 9, 5, 23, 8, BF)
    u = np.minimum((rmap >= 0).sum(1).numpy(), 2)
    first, units = layout(u, False, rng)
    out = {
        "gather_units.too_few_units": ("gather_units", (y, rmap, w, DEDUP, True, first,
                                                        torch.empty((units - 1, 8), dtype=BF))),
        "gather_units.pairs_first": ("gather_units", (y, rmap[:, :1], w, PAIRS, True, first,
                                                      torch.empty((9, 8), dtype=BF))),
        "gather_units.out_dtype": ("gather_units", (y, rmap, w, DEDUP, True, first,
                                                    torch.empty((units, 8)))),
        "gather_units.no_first": ("gather_units", (y, rmap, w, DEDUP, True, None,
                                                   torch.empty((units, 8), dtype=BF))),
        "gather_rows.map_range": ("gather_rows", (y, torch.where(rmap == rmap.max(), 23, rmap), w,
                                                  DEDUP, True)),
        "gather_rows.map_below": ("gather_rows", (y, rmap[:, :1] * 0 - 5, w, PAIRS, False)),
        "gather_rows.row_weight": ("gather_rows", (y, rmap, w[:3], DEDUP, True)),
        "gather_rows.transport": ("gather_rows", (y, rmap, w, 5, True)),
        "gather_rows.y_1d": ("gather_rows", (y.view(-1), rmap, w, DEDUP, True)),
    }
    rng = np.random.default_rng(5)
    idx, smap, back, first, E = source_side(rng, 9, 4, 3, 6, 8, BF, DEDUP, True)
    w = torch.zeros(idx.shape)
    bad_first = first.clone()
    bad_first[bad_first >= 0] = back.shape[0]
    unnamed = smap.clone()
    unnamed[0, 0] = -1  # token 0 has slots on rank 0
    out_of_range = smap.clone()
    out_of_range[3, 0] = 10**6
    for name, args in {
        "first": (back, smap, idx, w, E, 4, DEDUP, False, BF, 1, bad_first),
        "unnamed_token_row": (back, unnamed, idx, w, E, 4, DEDUP, False, BF, 1, first),
        "send_map_range": (back, out_of_range, idx, w, E, 4, DEDUP, False, BF, 1, first),
        "expert_range": (back, smap, torch.where(idx == 5, E, idx), w, E, 4, DEDUP, False, BF, 1,
                         first),
        "ranks_per_node": (back, smap, idx, w, E, 4, DEDUP, False, BF, 3, first),
        "weights_shape": (back, smap, idx, w[:, :2], E, 4, DEDUP, True, BF, 1, first),
        "out_dtype": (back, smap, idx, w, E, 4, DEDUP, False, torch.float16, 1, first),
        "experts_not_multiple": (back, smap, idx, w, E + 1, 4, DEDUP, False, BF, 1, first),
    }.items():
        out[f"reduce_tokens.{name}"] = ("reduce_tokens", args)
    pidx, psmap, pback, _, pE = source_side(rng, 9, 4, 3, 6, 8, torch.float32, PAIRS, False)
    sent_unused = psmap.clone()
    t, k = np.argwhere(pidx.numpy() < 0)[0]
    sent_unused[t, k] = 0
    out["reduce_tokens.sent_unused_slot"] = ("reduce_tokens", (pback, sent_unused, pidx, w, pE, 4,
                                                               PAIRS, False, torch.float32, 1,
                                                               None))
    return out


def _backward(cpp):
    one = torch.ones
    out = {f"combine_backward_dest.{name}": ("combine_backward_dest", args) for name, args in {
        "row_twice": (one(2, 4), torch.tensor([[0, 1], [1, -1]]), one(3), one(3, 4), True),
        "map_range": (one(2, 4), torch.tensor([[0, 7], [1, 1]]), one(3), one(3, 4), True),
        "map_below": (one(2, 4), torch.tensor([[0, 1], [-2, -1]]), one(3), one(3, 4), False),
        "hidden": (one(2, 5), torch.tensor([[0, 1], [2, -1]]), one(3), one(3, 4), True),
        "row_weight": (one(2, 4), torch.tensor([[0, 1], [2, -1]]), one(2), one(3, 4), True),
        "recv_dtype": (one(2, 4, dtype=torch.float16), torch.tensor([[0, 1], [2, -1]]), one(3),
                       one(3, 4), True),
    }.items()}
    rmap = torch.tensor([[0, -1, 2], [1, -1, -1]])
    values, first = torch.arange(3.0), torch.tensor([0, 2])
    out.update({f"gather_slot_values.{name}": ("gather_slot_values", args) for name, args in {
        "first_overruns": (values, rmap, first, 2),
        "map_range": (values, torch.tensor([[0, -1, 8], [1, -1, -1]]), first, 4),
        "first_size": (values, rmap, first[:1], 4),
        "values_dtype": (values.double(), rmap, first, 4),
    }.items()})
    idx = torch.tensor([[0, 5, -1], [3, 1, 2]])  # E = 6, R = 2: L = 3
    smap = torch.tensor([[0, 1], [2, -1]])
    back, sfirst = torch.arange(6.0), torch.tensor([0, 1, 2])
    out.update({f"scatter_slot_values.{name}": ("scatter_slot_values", args) for name, args in {
        "first_overruns": (back[:3], smap, idx, sfirst, 6, 2, DEDUP),
        "expert_range": (back, smap, torch.tensor([[0, 6, -1], [3, 1, 2]]), sfirst, 6, 2, DEDUP),
        "send_map_range": (back, torch.tensor([[0, 7], [2, -1]]), idx, sfirst, 6, 2, DEDUP),
        "send_map_columns": (back, smap, idx, sfirst, 6, 3, DEDUP),
    }.items()})
    out["quantize_mxfp8.hidden"] = ("quantize_mxfp8", (torch.randn(2, 40),))
    out["quantize_mxfp8.dtype"] = ("quantize_mxfp8", (torch.randn(2, 64).half(),))
    out["quantize_fp8_block128.hidden"] = ("quantize_fp8_block128", (torch.randn(2, 64),))
    return out


def cases() -> dict:
    """Every case: ``name -> (op, args)``, ``op`` a name of ``torch.ops.epkit`` and of the
    Triton kernels' table (``epkit.triton.OPS``)."""
    import epkit.ops  # noqa: F401  (loads the C++ kernels)

    cpp = torch.ops.epkit
    out = {}
    for group in (_layout_prepare, _plan, _pack_unpack, _combine, _backward):
        out.update(group(cpp))
    return out


# Which check each case is to hit: a piece of the C++ kernel's first line (test_arg_messages.py
# asserts it), so two tiers that raise the same wrong check do not pass as one.
EXPECT = {
    "combine_backward_dest.hidden": "recv must have size(1) == 4 (hidden of expert_y)",
    "combine_backward_dest.map_below": "recv_map entry 2 is -2, outside [-1, 3)",
    "combine_backward_dest.map_range": "recv_map entry 1 is 7, outside [-1, 3)",
    "combine_backward_dest.recv_dtype": "recv must be float32 or bfloat16, got torch.float16",
    "combine_backward_dest.row_twice": "entries 1 and 2 both name row 1",
    "combine_backward_dest.row_weight": "row_weight must have size(0) == 3",
    "gather_rows.map_below": "recv_map entry 0 is -5, outside",
    "gather_rows.map_range": "is 23, outside [-1, 23)",
    "gather_rows.row_weight": "row_weight must have size(0) == 23",
    "gather_rows.transport": "transport must be 0 (pairs) or 1 (dedup), got 5",
    "gather_rows.y_1d": "expert_y must be 2-D",
    "gather_slot_values.first_overruns": "first[1] = 2 places entry 0 of row 1 at 2",
    "gather_slot_values.first_size": "first must have size(0) == 2",
    "gather_slot_values.map_range": "recv_map entry 2 is 8, outside [-1, 3)",
    "gather_slot_values.values_dtype": "values must be torch.float32, got torch.float64",
    "gather_units.no_first": "dedup places its units by first",
    "gather_units.out_dtype": "out must be torch.bfloat16, got torch.float32",
    "gather_units.pairs_first": "pairs' rows are placed one per row (no first)",
    "gather_units.too_few_units": "outside the 12 units",
    "layout.1d": "topk_idx must be 2-D",
    "layout.absurd_both": "num_ranks must be in [1, 1048576], got 1099511627776",
    "layout.absurd_experts": "num_experts must be in [1, 2147483647], got 1099511627776",
    "layout.bool": "topk_idx must have an integer dtype, got torch.bool",
    "layout.experts_not_multiple": "num_experts 3 is not a multiple of num_ranks 2",
    "layout.float": "topk_idx must have an integer dtype, got torch.float32",
    "layout.negative_experts": "num_experts must be in [1, 2147483647], got -4",
    "layout.negative_ranks": "num_ranks must be in [1, 1048576], got -2",
    "layout.too_few_experts": "num_experts 1 is not a multiple of num_ranks 2",
    "layout.zero_ranks": "num_ranks must be in [1, 1048576], got 0",
    "pack.bad_transport": "transport must be 0 (pairs) or 1 (dedup), got 7",
    "pack.expert": "topk_idx[0, 1] = 4 outside [-1, 4)",
    "pack.expert_below": "topk_idx[0, 1] = -2 outside [-1, 4)",
    "pack.idx_float": "topk_idx must have an integer dtype, got torch.float32",
    "pack.idx_rows": "topk_idx must have size(0) == 4 (tokens of x)",
    "pack.num_ranks": "num_ranks 3 disagrees with the plan's 2",
    "pack.payload": "payload of 8 bytes, the plan says 16",
    "pack.plan_int32": "plan must be torch.int64, got torch.int32",
    "pack.plan_short": "plan has 52 words",
    "pack.plan_host_words": "plan_host has 52 words, the plan 53",
    "pack.plan_host_dtype": "plan_host must be torch.int64, got torch.int32",
    "pack_into.plan_host_2d": "plan_host must be 1-D",
    "pack.send_bytes": "send_bytes 385 disagrees",
    "pack.transport": "transport 0 disagrees with the plan's 1",
    "pack.weights_dtype": "topk_weights must be torch.float32, got torch.float64",
    "pack_into.send_dtype": "send must be torch.uint8, got torch.int32",
    "pack_into.send_size": "send_bytes 392 disagrees",
    "plan.absurd_experts": "num_experts 1099511627776, got [1, 13]",
    "plan.align": "align must be in [1, 2147483647], got 0",
    "plan.capacity": "capacity must be >= 0 (or -1: none), got -2",
    "plan.exchange": "exchange code 9 outside [0, 5]",
    "plan.exchange_negative": "exchange code -1 outside [0, 5]",
    "plan.experts_disagree_with_words": "num_experts 5, got [1, 13]",
    "plan.max_tokens": "max_tokens_per_rank must be in [0, 2147483647] (or -1), got -2",
    "plan.negative_experts": "num_experts must be in [1, 2147483647], got -1",
    "plan.rank_equal_R": "rank 1 outside [0, 1)",
    "plan.rank_negative": "rank -1 outside [0, 1)",
    "plan.rank_past_two_ranks": "rank 2 outside [0, 2)",
    "plan.transport": "transport must be 0 (pairs) or 1 (dedup), got 2",
    "plan.words_1d": "words must be 2-D",
    "plan.words_float": "words must be torch.int64, got torch.float32",
    "plan.words_int32": "words must be torch.int64, got torch.int32",
    "plan.words_width": "num_experts 4, got [1, 12]",
    "plan.zero_ranks": "words must have one row per rank",
    "prepare.absurd_experts": "num_experts must be in [1, 2147483647], got 1099511627776",
    "prepare.absurd_experts_on_error": "leaves no room for the count words' header (num_ranks 1)",
    "prepare.empty_pre_error": "got 0 values",
    "prepare.experts_not_multiple": "num_experts 3 is not a multiple of num_ranks 2",
    "prepare.idx_bool": "topk_idx must have an integer dtype, got torch.bool",
    "prepare.idx_float": "topk_idx must have an integer dtype, got torch.float32",
    "prepare.idx_rows": "topk_idx must have size(0) == 6 (tokens of x)",
    "prepare.max_tokens": "pre_error's max_tokens_per_rank must be >= -1, got -7",
    "prepare.negative_experts": "num_experts must be in [1, 2147483647], got -4",
    "prepare.negative_experts_past_header": "num_experts -9 leaves no room",
    "prepare.payload_code": "payload must be one of",
    "prepare.short_pre_error": "got 2 values",
    "prepare.weights_1d": "topk_weights must be 2-D",
    "prepare.weights_double": "topk_weights must be torch.float32, got torch.float64",
    "prepare.weights_shape": "topk_weights must have the shape of topk_idx [6, 2], got [6, 1]",
    "prepare.x_1d": "x must be 2-D",
    "prepare.x_half": "x must be float32 or bfloat16, got torch.float16",
    "prepare.x_int": "x must be float32 or bfloat16, got torch.int32",
    "prepare.zero_ranks": "num_ranks must be in [1, 1048576], got 0",
    "quantize_fp8_block128.hidden": "H % 128 == 0, got H = 64",
    "quantize_mxfp8.dtype": "x must be float32 or bfloat16, got torch.float16",
    "quantize_mxfp8.hidden": "H % 32 == 0, got H = 40",
    "reduce_tokens.expert_range": "is 12, outside [-1, 12)",
    "reduce_tokens.experts_not_multiple": "num_experts 13 is not a multiple of num_ranks 4",
    "reduce_tokens.first": "units lie outside back's 48 units",
    "reduce_tokens.out_dtype": "out_dtype must be float32 or bfloat16, got torch.float16",
    "reduce_tokens.ranks_per_node": "ranks_per_node 3 must be >= 1 and divide 4",
    "reduce_tokens.send_map_range": "send_map entry 12 is 1000000",
    "reduce_tokens.sent_unused_slot": "send_map sends a slot whose topk_idx is -1",
    "reduce_tokens.unnamed_token_row": "a kept slot whose token row send_map does not name",
    "reduce_tokens.weights_shape": "topk_weights must have the shape of topk_idx [9, 6], got [9, 2]",
    "scatter_rows.map_dtype": "send_map must be torch.int64, got torch.int32",
    "scatter_rows.map_range": "send_map entry 5 is 4, outside [-1, 4)",
    "scatter_rows.map_twice": "names send row 0, named already by token 0",
    "scatter_rows.rows": "send_rows must be >= 0, got -1",
    "scatter_rows_into.map_twice": "names send row 1, named already by token 1",
    "scatter_rows_into.out_hidden": "out must have size(1) == 8 (hidden of src)",
    "scatter_slot_values.expert_range": "topk_idx entry 1 is 6, outside [-1, 6)",
    "scatter_slot_values.first_overruns": "first[2] = 2 places slot (1, 2) at 3",
    "scatter_slot_values.send_map_columns": "send_map must have size(1) == 3",
    "scatter_slot_values.send_map_range": "send_map entry 1 is 7, outside [-1, 3)",
    "unpack.expert_rows": "expert_rows 6 disagrees with the plan's 5",
    "unpack.hidden": "rows of 8 payload bytes",
    "unpack.plan_dtype": "plan must be torch.int64, got torch.int32",
    "unpack.plan_short": "plan has 52 words",
    "unpack.plan_host_words": "plan_host has 52 words, the plan 53",
    "unpack.recv_2d": "recv must be 1-D",
    "unpack.recv_bytes": "received 159 bytes, the plan says 160",
    "unpack.recv_dtype": "recv must be torch.uint8, got torch.int8",
    "unpack.recv_rows": "recv_rows 6 disagrees with the plan's 5",
    "unpack.topk": "topk 256 out of range for transport 1",
    "unpack.transport": "transport 0 disagrees with the plan's 1",
}
