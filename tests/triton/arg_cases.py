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
        "pack_into.send_dtype": ("pack_into", (x, idx, w, plan, 1, 2,
                                               torch.zeros(SB // 4, dtype=torch.int32))),
        "pack_into.send_size": ("pack_into", (x, idx, w, plan, 1, 2, torch.zeros(SB + 8, dtype=u8))),
        "scatter_rows.map_dtype": ("scatter_rows", (x, idx.int(), 4)),
        "scatter_rows.rows": ("scatter_rows", (x, idx, -1)),
        "scatter_rows_into.out_hidden": ("scatter_rows_into", (x, idx, torch.zeros(9, 7))),
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
