"""``layout`` and ``prepare`` on any device (cpu/layout.cpp): the routing's counts and the count
words this rank contributes to the count exchange, written as device-generic torch ops plus one
single-program Triton kernel that assembles the words.

No host read on ``prepare``'s path: every data-dependent verdict ("the first bad entry") is a
0-d device tensor (argmax of a mask), and the kernel picks the error in cpu/layout.cpp's order
(index range, duplicate expert, non-finite weight, H % block, non-finite payload, static
overflow) and writes it into the words, which the group agrees on after the all-gather. Only
metadata (shapes, dtypes, option values) raises here, as the C++ checks (checks.h) do.
``layout`` is a standalone query that *raises* on an expert id outside [-1, E) (as the C++ op
does): that verdict is its one host read (the first bad position and its id, read together),
and it is not on the dispatch path.

Counting uses integer scatters (``scatter_add_``; integer sums do not depend on their order) and
no output size that depends on data, so the ops are capturable.
"""

from __future__ import annotations

import torch

from ._runtime import launch, specialization, tl, triton
from epkit.reference import abi
from epkit.reference.errors import Reason

__all__ = ["layout", "prepare", "counts"]

MAX_RANKS = 1 << 20          # checks.h kMaxRanks
MAX_EXPERTS = (1 << 31) - 1  # checks.h kMaxExperts (int32 max)
WORD_HEADER = abi.WORD_HEADER
_W = {name: i for i, name in enumerate(abi.WORD_FIELDS)}
_PRE = {name: i for i, name in enumerate(abi.PRE_ERROR_FIELDS)}
_BLOCKS = {abi.PAYLOAD_CODES[n]: b for n, b in abi.PAYLOAD_BLOCKS.items()}  # code -> block


# ---- argument checks (checks.h, the same messages) --------------------------------------------
def _fail(op: str, msg: str):
    raise RuntimeError(f"{op}: {msg}")


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


# c10's names of the dtypes (the C++ messages print ScalarType names).
_C10 = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
        torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
        torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
        torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def dtype_name(dt: torch.dtype) -> str:
    return _C10.get(dt, str(dt).replace("torch.", ""))


def check_dim(op, name, t, dim):
    if t.dim() != dim:
        _fail(op, f"{name} must be {dim}-D, got {t.dim()}-D of shape {_shape(t)}")


def check_index_dtype(op, name, t):
    dt = t.dtype
    if dt == torch.bool or dt.is_floating_point or dt.is_complex:
        _fail(op, f"{name} must have an integer dtype, got {dtype_name(dt)}")


def check_num_ranks(op, R):
    if not 1 <= R <= MAX_RANKS:
        _fail(op, f"num_ranks must be in [1, {MAX_RANKS}], got {R}")


def check_experts_ranks(op, E, R):
    """num_experts E >= 1, a multiple of num_ranks R (checks.h check_experts_ranks)."""
    check_num_ranks(op, R)
    if not 1 <= E <= MAX_EXPERTS:
        _fail(op, f"num_experts must be in [1, {MAX_EXPERTS}], got {E}")
    if E % R:
        _fail(op, f"num_experts {E} is not a multiple of num_ranks {R}")


def _check_routing(op, x, idx, w):
    check_dim(op, "x", x, 2)
    check_dim(op, "topk_idx", idx, 2)
    check_index_dtype(op, "topk_idx", idx)
    if idx.device != x.device:
        _fail(op, f"topk_idx is on {idx.device}, expected {x.device}")
    if idx.shape[0] != x.shape[0]:
        _fail(op, f"topk_idx must have size(0) == {x.shape[0]} (tokens of x), got shape "
                  f"{_shape(idx)}")
    check_dim(op, "topk_weights", w, 2)
    if w.dtype != torch.float32:
        _fail(op, f"topk_weights must be Float, got {dtype_name(w.dtype)}")
    if w.device != x.device:
        _fail(op, f"topk_weights is on {w.device}, expected {x.device}")
    if w.shape != idx.shape:
        _fail(op, f"topk_weights must have the shape of topk_idx {_shape(idx)}, got {_shape(w)}")


def _check_prepare(x, idx, w, E, R, pre_error, payload):
    op = "epkit.prepare"
    if len(pre_error) <= _PRE["b"]:
        _fail(op, "pre_error must be [code, a, b(, x dtype code(, max_tokens_per_rank))], got "
                  f"{len(pre_error)} values")
    check_num_ranks(op, R)
    if payload not in _BLOCKS:
        _fail(op, f"payload must be one of {abi.PAYLOAD_CHOICES}, got {payload}")
    if pre_error[_PRE["code"]] != 0:
        if not -R <= E <= MAX_EXPERTS:
            _fail(op, f"num_experts {E} leaves no room for the count words' header (num_ranks {R})")
        return
    check_experts_ranks(op, E, R)
    _check_routing(op, x, idx, w)
    if x.dtype not in (torch.float32, torch.bfloat16):
        _fail(op, f"x must be float32 or bfloat16, got {dtype_name(x.dtype)}")
    if len(pre_error) > _PRE["max_tokens"] and pre_error[_PRE["max_tokens"]] < -1:
        _fail(op, "pre_error's max_tokens_per_rank must be >= -1, got "
                  f"{pre_error[_PRE['max_tokens']]}")


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
    check_dim(op, "topk_idx", topk_idx, 2)
    check_index_dtype(op, "topk_idx", topk_idx)
    check_experts_ranks(op, E, R)
    idx = topk_idx.to(torch.int64).contiguous()
    T, K = idx.shape
    flat = idx.view(-1)
    bad = _first((flat < -1) | (flat >= E))
    # The standalone op raises like the C++ one: its one host read (the dispatch uses prepare,
    # which carries the error in its words instead).
    i, e = torch.stack([bad, _at(flat, bad)]).tolist()
    if i >= 0:
        _fail(op, f"topk_idx[{i // K}, {i % K}] = {e} outside [-1, {E})")
    tpe, tpr, spr, in_rank = counts(idx, E, R, with_slots=True)
    return tpe, tpr, spr, in_rank


# ---- prepare ----------------------------------------------------------------------------------
# found: [6] int64, the value checks' verdicts (-1: none): flat index of the first id out of
# range, that id, first row naming an expert twice, that row's smallest such expert, first row
# with a non-finite weight, first row with a non-finite payload value.
_F_RANGE, _F_RANGE_VALUE, _F_DUP, _F_DUP_EXPERT, _F_WEIGHT, _F_PAYLOAD = range(6)


@triton.jit(do_not_specialize=["E", "R", "T", "H", "K", "x_dtype", "payload", "pre_code",
                               "pre_a", "pre_b", "hidden_bad", "max_tokens"])
def _words_kernel(found_ptr, tpe_ptr, tpr_ptr, words_ptr, E, R, T, H, K, x_dtype, payload,
                  pre_code, pre_a, pre_b, hidden_bad, max_tokens, CHECK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program writes the whole word vector ``words`` [8 + E + R] int64: the header (the
    error in cpu/layout.cpp's order, then tokens, hidden, topk, x dtype, payload) and the counts
    ``tpe`` [E] int64, ``tpr`` [R] int64 (zeros when there is an error). ``found`` [6] int64:
    the value checks' verdicts (module comment); read only when CHECK (pre_code == 0)."""
    E = E.to(tl.int64)
    R = R.to(tl.int64)
    code = pre_code.to(tl.int64)
    a = pre_a.to(tl.int64)
    b = pre_b.to(tl.int64)
    zero = E * 0
    if CHECK:
        i_range = tl.load(found_ptr + 0)
        i_dup = tl.load(found_ptr + 2)
        i_weight = tl.load(found_ptr + 4)
        i_payload = tl.load(found_ptr + 5)
        # Latest check first, so the earliest failing check is the one left standing.
        code = tl.where((max_tokens >= 0) & (T > max_tokens), 20, zero)
        a = tl.where(code != 0, T.to(tl.int64), zero)
        b = tl.where(code != 0, max_tokens.to(tl.int64), zero)
        pc = tl.where(i_payload >= 0, 14, code)
        a = tl.where(i_payload >= 0, i_payload, a)
        b = tl.where(i_payload >= 0, payload.to(tl.int64), b)
        code = pc
        hc = tl.where(hidden_bad != 0, 15, code)
        a = tl.where(hidden_bad != 0, H.to(tl.int64), a)
        b = tl.where(hidden_bad != 0, payload.to(tl.int64), b)
        code = hc
        wc = tl.where(i_weight >= 0, 13, code)
        a = tl.where(i_weight >= 0, i_weight, a)
        b = tl.where(i_weight >= 0, zero, b)
        code = wc
        dc = tl.where(i_dup >= 0, 2, code)
        a = tl.where(i_dup >= 0, i_dup, a)
        b = tl.where(i_dup >= 0, tl.load(found_ptr + 3), b)
        code = dc
        rc = tl.where(i_range >= 0, 1, code)
        a = tl.where(i_range >= 0, tl.load(found_ptr + 1), a)
        b = tl.where(i_range >= 0, E, b)
        code = rc
        tl.store(words_ptr + 3, T.to(tl.int64))
        tl.store(words_ptr + 4, H.to(tl.int64))
        tl.store(words_ptr + 5, K.to(tl.int64))
    else:
        tl.store(words_ptr + 3, zero)
        tl.store(words_ptr + 4, zero)
        tl.store(words_ptr + 5, zero)
    tl.store(words_ptr + 0, code)
    tl.store(words_ptr + 1, a)
    tl.store(words_ptr + 2, b)
    tl.store(words_ptr + 6, x_dtype.to(tl.int64))
    tl.store(words_ptr + 7, payload.to(tl.int64))
    # The counts, or zeros when this rank's words carry an error.
    offs = tl.arange(0, BLOCK).to(tl.int64)
    keep = (offs * 0 + code) == 0  # a tensor mask (the interpreter mistypes splatted scalars)
    n = E + R
    for i in range(0, tl.cdiv(n, BLOCK)):
        o = i * BLOCK + offs
        inside = o < n
        if CHECK:
            v = tl.load(tpe_ptr + o, mask=inside & (o < E) & keep, other=0)
            v += tl.load(tpr_ptr + (o - E), mask=inside & (o >= E) & keep, other=0)
        else:
            v = o * 0
        tl.store(words_ptr + 8 + o, v, mask=inside)


_BLOCK = 128
_SCALARS = ("E", "R", "T", "H", "K", "x_dtype", "payload", "pre_code", "pre_a", "pre_b",
            "hidden_bad", "max_tokens")
for _check in (True, False):
    specialization(f"prepare_words_{'check' if _check else 'pre_error'}", _words_kernel,
                   {"found_ptr": "*i64", "tpe_ptr": "*i64", "tpr_ptr": "*i64",
                    "words_ptr": "*i64", **{s: "i64" for s in _SCALARS},
                    "CHECK": "constexpr", "BLOCK": "constexpr"},
                   {"CHECK": _check, "BLOCK": _BLOCK})


def _found(x, idx, w, E, payload):
    """The value checks' verdicts ``found`` [6] int64 (see above) as device tensors."""
    T, K = idx.shape
    flat = idx.view(-1)
    none = torch.full((), -1, dtype=torch.int64, device=idx.device)
    i_range = _first((flat < -1) | (flat >= E))
    if K > 1:
        # A row's ids sorted: equal neighbours (not -1) are a duplicate; the first such
        # neighbour in sorted order is the row's smallest duplicated expert.
        s = idx.sort(dim=1).values
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        i_dup = _first(dup.any(1))
        smallest = torch.where(dup, s[:, 1:], E).amin(1)
        dup_expert = _at(smallest, i_dup)
    else:
        i_dup, dup_expert = none, none
    i_weight = _first(~torch.isfinite(w).all(1)) if K else none
    block = _BLOCKS[payload]
    i_payload = none
    if block and x.shape[1] % block == 0 and x.numel():
        i_payload = _first(~torch.isfinite(x).all(1))
    return torch.stack([i_range, _at(flat, i_range), i_dup, dup_expert, i_weight, i_payload])


def prepare(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            num_experts: int, num_ranks: int, pre_error: list, payload: int) -> torch.Tensor:
    """The count words ``[8 + E + R]`` int64 of this rank (abi.WORD_FIELDS, then tokens per
    expert, tokens per rank), on ``topk_idx``'s device. ``x`` [T, H] float32 / bfloat16,
    ``topk_idx`` [T, K] any integer dtype, ``topk_weights`` [T, K] float32; ``pre_error`` =
    [code, a, b(, x dtype code(, max_tokens_per_rank))]: a nonzero code is the caller's own
    verdict, which travels as is (the tensors are then not looked at)."""
    E, R, payload = int(num_experts), int(num_ranks), int(payload)
    pre = [int(v) for v in pre_error]
    _check_prepare(x, topk_idx, topk_weights, E, R, pre, payload)
    dev = topk_idx.device
    words = torch.empty(WORD_HEADER + E + R, dtype=torch.int64, device=dev)
    x_dtype = pre[_PRE["x_dtype"]] if len(pre) > _PRE["x_dtype"] else 0
    max_tokens = pre[_PRE["max_tokens"]] if len(pre) > _PRE["max_tokens"] else -1
    if pre[0] != 0:
        launch(_words_kernel, (1,), words, words, words, words, E, R, 0, 0, 0, x_dtype, payload,
               pre[0], pre[1], pre[2], 0, -1, CHECK=False, BLOCK=_BLOCK)
        return words
    idx = topk_idx.to(torch.int64).contiguous()
    T, K = idx.shape
    H = x.shape[1]
    block = _BLOCKS[payload]
    found = _found(x, idx, topk_weights, E, payload)
    tpe, tpr, _, _ = counts(idx, E, R)
    launch(_words_kernel, (1,), found, tpe, tpr, words, E, R, T, H, K, x_dtype, payload, 0, 0, 0,
           int(bool(block) and H % block != 0), max_tokens, CHECK=True, BLOCK=_BLOCK)
    return words
