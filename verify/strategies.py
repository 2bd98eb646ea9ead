"""Hypothesis strategies that draw whole-group cases, and the fixed corner cases run first.

Structure (world size, experts, top-k, hidden, tokens per rank, dtypes, align, capacity, ...)
is drawn by hypothesis, so it shrinks to a small failing case; the values themselves come from a
drawn seed (see :mod:`epkit.verify.cases`), which keeps examples cheap to draw and to print.
:func:`corner_cases` is the matrix every mode runs before its random draws, so that every run
reaches every regime whatever the seed (docs/verify.md, "What every run covers").
"""

from __future__ import annotations

from hypothesis import strategies as st

from epkit.reference import payloads
from .capabilities import Capabilities
from .cases import FLOAT_DTYPES, SEQUENCES, VIOLATIONS, Case, ModeSpec

__all__ = ["cases", "corner_cases", "MANY_TOKENS", "PEER_ROWS"]

MAX_TOPK = 255  # the documented limit of both transports
MAX_EXPERTS = 512
MANY_TOKENS = 320  # the largest tokens per rank of a "many tokens" draw (H <= 8 there)
SLOT_BUDGET = 512  # tokens x top-k per rank of a wide top-k draw (H <= 16 there)
PEER_ROWS = (64, 128, 256)  # per-peer row counts the corner cases cross (buffer sizes)
# K's bucket b draws K in [2**b, 2**(b+1)): log-uniform over 1..255, a little tilted to the
# small K most models use; sampled_from shrinks to bucket 0 (K = 1).
_K_BUCKETS = (0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7)
# Violations that need two ranks (they make one rank differ from another, or E % R != 0).
_GROUP_VIOLATIONS = ("topk_differs", "hidden_differs", "dtype_differs", "experts_not_divisible")


@st.composite
def cases(
    draw,
    world_size: int = 4,
    mode: ModeSpec | None = None,
    *,
    max_tokens: int = 24,
    min_world_size: int = 1,
    max_local_experts: int = 6,
    max_topk: int = MAX_TOPK,
    max_hidden: int = 72,
    capabilities: Capabilities | None = None,
    many_every: int = 8,
    check_errors: bool = False,
) -> Case:
    """Draw a :class:`Case` for a group of up to ``world_size`` ranks, valid for ``mode`` and
    inside ``capabilities`` (:class:`~epkit.verify.capabilities.Capabilities`; default: all).

    ``mode`` (a :class:`ModeSpec`) constrains the draw: a quantized payload (``"mxfp8"``,
    ``"fp8_block128"``) gives ``H`` a multiple of its block (32, 128);
    ``uniform`` gives uniform plans without capacity; ``static`` gets the case's token bound as
    ``max_tokens``; ``nodes`` draws ``ranks_per_node``, a divisor of the world size
    (two-level nodes first, so a case shrinks to one with nodes of several ranks). Without a
    mode, payload and plan shape are drawn too.

    ``K`` is log-uniform over 1..min(255, ``max_topk``, the capabilities' ``max_topk``); above 8
    the experts grow with it (up to 512) and tokens x K stays within 512 per rank, H within 16.
    About one draw in ``many_every`` (0: never) has up to 320 tokens per rank (K <= 8, H <= 8);
    the others up to ``max_tokens``. Values hold NaN, infinities, -0 and subnormals in real rows
    (``specials``) and weights exact 0, -0 and 1 (``special_weights``) in about a third of the
    draws each. ``check_errors``: about one draw in four carries one invalid input
    (``violation``).
    """
    caps = capabilities or Capabilities()
    uniform_only = mode is not None and mode.uniform
    no_unused = not caps.allows("unused_slots")
    # The mix (dtype, weighted, many tokens, special values, invalid inputs) comes from a
    # seeded Random: hypothesis' own choices lean to the simplest value (measured: bfloat16
    # in 16 % of 300 draws), these must be balanced. The Random's seed is drawn, so a case
    # still replays; these knobs just do not shrink.
    mix = draw(st.randoms(use_true_random=True), label="mix")
    # the draws, in this order (hypothesis replays and shrinks by it): the shape, the hidden
    # size, the routing and tokens, the dtypes, the options
    R, G, payload, E, K, max_tokens_drawn, max_h, many = _shape(
        draw, world_size, min_world_size, mode, caps, max_local_experts, max_topk, max_tokens,
        max_hidden, many_every, mix)
    H = _hidden(draw, payload, max_h)
    routing, K, tokens = _routing_and_tokens(draw, R, E, K, caps, uniform_only, no_unused,
                                             max_tokens_drawn, many)
    dtypes = x_dtypes(caps)
    dtype = _float_dtype(mix.random(), dtypes)
    y_dtype = dtype
    if caps.allows("mixed_dtypes") and not draw(st.integers(0, 3), label="mixed dtypes?"):
        y_dtype = draw(st.sampled_from(dtypes), label="y_dtype")
    capacity = None
    if not uniform_only and caps.allows("capacity") and draw(st.booleans(), label="use capacity"):
        capacity = draw(st.integers(0, 16), label="capacity")
    weighted = _weighted(caps, lambda: mix.random() < 0.5)
    specials = mix.random() < 1 / 3
    special_weights = mix.random() < 1 / 3 and weighted
    violation = None
    if mix.random() < 0.25 and check_errors:
        violation = VIOLATIONS[int(mix.random() * len(VIOLATIONS))]
    # the calls' order (one draw in four today's stage by stage), and one draw in eight with
    # its twin on the same adapter: run after it, or both in flight (either combine order)
    order = "stages" if mix.random() < 0.25 else "training"
    sequence = "single"
    if mix.random() < 1 / 8:
        sequence = SEQUENCES[1 + int(mix.random() * (len(SEQUENCES) - 1))]
        order = "training" if sequence.startswith("overlap") else order
    case = Case(
        world_size=R,
        num_experts=E,
        topk=K,
        hidden=H,
        tokens=tokens,
        dtype=dtype,
        y_dtype=y_dtype,
        idx_dtype=draw(st.sampled_from(list(caps.index_dtypes or ("int64", "int32"))),
                       label="idx_dtype"),
        routing=routing,
        unused_pct=0 if no_unused else draw(st.sampled_from([20, 0, 10, 50, 100]),
                                            label="unused_pct"),
        align=draw(st.sampled_from(list(caps.aligns())), label="align"),
        capacity=capacity,
        weighted=weighted,
        payload=payload,
        nan_padding=draw(st.booleans(), label="nan_padding"),
        zero_rows=draw(st.integers(0, 4), label="zero_rows") == 4,  # shrinks to False
        max_tokens=max(max_tokens, max_tokens_drawn),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
        ranks_per_node=G,
        specials=specials,
        special_weights=special_weights,
        order=order,
        sequence=sequence,
    )
    return with_violation(case, violation) if violation else case


def x_dtypes(caps) -> tuple:
    """The dtypes x and expert_y may be drawn in (the ``x_dtypes`` capability)."""
    return tuple(d for d in FLOAT_DTYPES if d in (caps.x_dtypes or FLOAT_DTYPES))


def _float_dtype(r: float, dtypes) -> str:
    """x's dtype from a uniform ``r``: float16 a quarter of the draws where allowed, the rest
    bfloat16 and float32 (bfloat16 for ``r < 0.5``, as before float16 was drawn)."""
    if "float16" in dtypes and r >= 0.75:
        return "float16"
    pick = "bfloat16" if r < 0.5 else "float32"
    return pick if pick in dtypes else dtypes[0]


def _weighted(caps, choose) -> bool:
    """Weighted or not, half and half where both are allowed."""
    if caps.allows("weighted") and caps.allows("unweighted"):
        return not choose()
    return caps.allows("weighted")


def _topk_cap(caps, max_topk) -> int:
    return max(1, min(MAX_TOPK, max_topk, caps.max_topk or MAX_TOPK))


def _shape(draw, world_size, min_world_size, mode, caps, max_local_experts, max_topk,
           max_tokens, max_hidden, many_every, mix):
    """World size, ranks per node (a mode with ``nodes``: a divisor of the world size, nodes of
    several ranks first), payload, experts and top-k; with the token and hidden bounds that go
    with them."""
    R = draw(st.integers(min_world_size, world_size), label="world_size")
    G = 1
    if mode is not None and mode.nodes:
        divisors = [g for g in range(1, R + 1) if R % g == 0]
        G = draw(st.sampled_from([g for g in divisors if 1 < g < R] + [1, R][:len(divisors)]),
                 label="ranks_per_node")
    payload = (mode.payload if mode is not None
               else draw(st.sampled_from([None, *payloads.NAMES]), label="payload"))
    cap_k = _topk_cap(caps, max_topk)
    b = draw(st.sampled_from([b for b in _K_BUCKETS if 2**b <= cap_k]), label="topk bucket")
    K = draw(st.integers(2**b, min(2**(b + 1) - 1, cap_k)), label="topk")
    if K > 8:  # wide: experts enough for K distinct ones, few tokens, narrow rows
        lo = -(-K // R)
        L = draw(st.integers(lo, max(lo, min(lo + 8, MAX_EXPERTS // R))), label="local_experts")
        return R, G, payload, R * L, K, max(1, min(max_tokens, SLOT_BUDGET // K)), 16, False
    L = draw(st.integers(1, max_local_experts), label="local_experts")
    if many_every and mix.random() < 1 / many_every:
        return R, G, payload, R * L, K, MANY_TOKENS, 8, True
    return R, G, payload, R * L, K, max_tokens, max_hidden, False


def _hidden(draw, payload, max_h) -> int:
    """H: a multiple of a quantized payload's block (1..3 blocks of 32, 1..2 of 128)."""
    block = payloads.get(payload).block
    if block:
        return block * (1 if max_h <= 16 else draw(
            st.integers(1, max(2, max(96, max_h) // block)), label="hidden/block"))
    return draw(st.integers(1, max_h), label="hidden")


def _routing_and_tokens(draw, R, E, K, caps, uniform_only, no_unused, max_tokens_drawn, many):
    """``(routing, K, tokens per rank)``: every slot used where the capabilities say so (K
    distinct experts per token, none -1), zero-token ranks only where allowed."""
    routings = ["random", "grouped", "hot", "uniform"]
    if no_unused:  # every slot used: K distinct experts per token, none left -1
        routings = ["random", "hot", "uniform"]
    routing = "uniform" if uniform_only else draw(st.sampled_from(routings), label="routing")
    if no_unused:
        K = min(K, R) if routing == "uniform" else min(K, E)
    min_t = 0 if caps.allows("zero_token_ranks") else 1
    if many:  # every rank's count from 64 to the hundreds, but the last one's (0 allowed)
        hi = max_tokens_drawn
        if routing == "uniform":
            return routing, K, (R * draw(st.integers(64 // R + 1, hi // R), label="tokens/R"),) * R
        tokens = draw(st.lists(st.integers(64, hi), min_size=R, max_size=R), label="tokens")
        return routing, K, tuple(tokens[:-1]) + (draw(st.integers(min_t, hi), label="last"),)
    if routing == "uniform":
        T = R * draw(st.integers(min_t, max(max_tokens_drawn // R, min_t)), label="tokens/R")
        return routing, K, (T,) * R
    return routing, K, tuple(draw(st.lists(st.integers(min_t, max_tokens_drawn), min_size=R,
                                           max_size=R), label="tokens"))


def with_violation(case: Case, kind: str) -> Case:
    """``case`` made invalid by ``kind`` (on its last rank), adjusted so that the violation
    really is one: two ranks where it compares ranks, a token and two slots where it needs
    them, and random routing (a uniform plan needs E % R == 0)."""
    if kind in _GROUP_VIOLATIONS and case.world_size < 2:
        kind = "id_out_of_range"
    tokens = list(case.tokens)
    tokens[-1] = max(tokens[-1], 1)
    kw = dict(violation=kind, tokens=tuple(tokens), routing="random", capacity=None,
              payload=case.payload, sequence="single")
    if kind == "duplicate_id":
        kw.update(topk=max(case.topk, 2), unused_pct=0)
    if kind == "experts_not_divisible":
        kw.update(num_experts=case.num_experts + 1, ranks_per_node=1)
    return case.replace(**kw)


# -- the corner matrix ---------------------------------------------------------------------------
WIDE_ROWS = {"float32": 4096, "bfloat16": 7168}  # H of the wide-row corners (14,336 B a bf16 row)
MANY_EXPERTS = 384  # the many-experts corners: ids past 8 bits, at every world size
COUNT_ROWS = 2**16  # the count-overflow corner sends one expert more rows than this


def corner_cases(world_size: int, mode: ModeSpec | None = None,
                 capabilities: Capabilities | None = None, *, max_tokens: int = 24,
                 check_errors: bool = False, count_overflow: bool = True) -> list[Case]:
    """The fixed cases every mode runs before its random draws (inside ``capabilities``):

    - for every world size ``R`` in 1..min(``world_size``, 4), every x dtype allowed (float32,
      bfloat16, float16), weighted and unweighted: a case with a rank without tokens (the last
      one), and in turn K = 1, K = E (every expert), every slot unused, one hot expert; NaN
      padding, special values (NaN, infinities, -0, subnormals in real rows) and special
      weights (0, -0, 1) in half of them. The hot-expert one of every ``R`` has 384 experts
      and routes to an id past 255 (ids packed in 8 bits); at the full world size the first
      float32 and bfloat16 ones with tokens have wide rows (H 4096 and 7168);
    - at the full world size, top-k wide: K = E = 40 (every slot past 16 used) and K = 255
      (within ``max_topk``) over 384 experts, two tokens per rank, H = 4;
    - at the full world size, tokens enough that each rank sends a peer more than 64, 128 and
      256 rows (the sizes of per-peer buffers), H = 4, on block boundaries: the ranks hold
      ``M``, ``M - 1`` and ``M + 1`` tokens (then again), ``M`` a multiple of 64, 128, 256;
    - without a quantized payload (and with ``count_overflow``): the count overflow, on a
      group of two (one rank if that
      is all there is): every token routed to every expert (K = E = R), so one expert gets
      more than 65,536 rows and a rank holds more than 65,536 slots; H = 1;
    - with ``check_errors``: one case per kind of invalid input (``VIOLATIONS``).

    Features the capabilities exclude are left out of a corner (a corner never leaves them).
    """
    caps = capabilities or Capabilities()
    uniform = mode is not None and mode.uniform
    payload = mode.payload if mode is not None else None
    block = payloads.get(payload).block
    H = block or 8
    dtypes = x_dtypes(caps)
    aligns = list(caps.aligns())
    idx_dtypes = list(caps.index_dtypes or ("int64", "int32"))
    weights = [w for w in (True, False) if caps.allows("weighted" if w else "unweighted")]
    zero_ok = caps.allows("zero_token_ranks")
    no_unused = not caps.allows("unused_slots")
    cap_k = _topk_cap(caps, MAX_TOPK)
    out, i = [], 0
    full = min(world_size, 4)
    for R in range(1, full + 1):
        wide = set()
        combos = [(d, w) for d in dtypes for w in weights]
        kinds = [("k1", "kE", "unused", "hot")[(i + n) % 4] for n in range(len(combos))]
        kinds = ["k1" if k == "unused" and no_unused else k for k in kinds]
        # the many-experts one: the hot expert's, else the last with slots in use
        many_at = kinds.index("hot") if "hot" in kinds else max(
            n for n, k in enumerate(kinds) if k != "unused")
        for n, (dtype, weighted) in enumerate(combos):
            kind = kinds[n]
            many = n == many_at
            L = MANY_EXPERTS // R if many else 2
            E = R * L
            K = {"k1": 1, "kE": min(E, cap_k, 2 if many else E), "unused": min(3, cap_k),
                 "hot": min(2, cap_k, E)}[kind]
            h = H
            if R == full and kind != "unused" and dtype in WIDE_ROWS and dtype not in wide:
                wide.add(dtype)
                h = WIDE_ROWS[dtype]
            T = 1 if h != H else 3 + i % 3  # wide rows: a token a rank
            tokens = [T] * R
            if zero_ok and not ((many or h != H) and R == 1):  # R = 1: keep its only tokens
                tokens[-1] = 0
            routing = {"hot": "hot"}.get(kind, "random")
            if uniform:
                routing = "uniform"
                tokens = [R if many or h != H or not zero_ok else 0] * R
                K = min(K, R) if no_unused else K
            case = Case(
                world_size=R, num_experts=E, topk=K, hidden=h, tokens=tuple(tokens),
                dtype=dtype, y_dtype=dtype, idx_dtype=idx_dtypes[i % len(idx_dtypes)],
                routing=routing, unused_pct=100 if kind == "unused" else 0,
                align=aligns[i % len(aligns)], weighted=weighted, payload=payload,
                nan_padding=True, zero_rows=i % 3 == 1, max_tokens=max(max_tokens, T),
                seed=1000 + i, ranks_per_node=_nodes(mode, R), specials=i % 2 == 0,
                special_weights=weighted and i % 4 < 2, order=ORDERS_CYCLE[i % 2])
            out.append(_routed_past(case, 255) if many else case)
            i += 1
    _with_sequences(out)
    R = full
    for j, K in enumerate(k for k in sorted({min(cap_k, 40), cap_k}) if k > 8):
        # wide top-k: every slot past 16 used (K = E), then K = 255 with unused slots
        E = R * -(-K // R) if j == 0 else R * (max(K, 256) // R + 1)  # past 256
        E = min(E, R * (MAX_EXPERTS // R))
        K = min(E, cap_k) if j == 0 else min(K, E)
        if uniform and no_unused:  # a uniform plan uses min(K, R) slots per token
            K = min(K, R)
        out.append(Case(
            world_size=R, num_experts=E, topk=K, hidden=block or 4,
            tokens=(R,) * R if uniform else (2,) * R, dtype=_dtype(FLOAT_DTYPES[j % 2], dtypes),
            y_dtype=_dtype(FLOAT_DTYPES[j % 2], dtypes), idx_dtype=idx_dtypes[0],
            routing="uniform" if uniform else "random", unused_pct=0 if no_unused else 20 * j,
            align=aligns[0], weighted=weights[-1 - j % len(weights)], payload=payload,
            nan_padding=True, max_tokens=max(max_tokens, R), seed=2500 + j,
            ranks_per_node=_nodes(mode, R), specials=j == 1, special_weights=j == 1))
    if R > 1:
        K = min(4, cap_k, R * 2, R if uniform and no_unused else 4)
        for rows in PEER_ROWS:
            T = rows * R * 5 // 4 // K + 1  # each peer gets about 1.25 x rows rows
            M = -(-T // rows) * rows  # ... on a block boundary: M, M - 1, M + 1 tokens
            tokens = tuple(M + (0, -1, 1)[r % 3] for r in range(R))
            if uniform:  # equal counts, a multiple of R: the one of M, M - 1, M + 1 that is
                tokens = (next(t for t in (M, M - 1, M + 1) if t % R == 0),) * R
            dtype = _dtype(FLOAT_DTYPES[rows % 3 % 2], dtypes)
            out.append(Case(
                world_size=R, num_experts=R * 2, topk=K, hidden=block or 4, tokens=tokens,
                dtype=dtype, y_dtype=dtype, idx_dtype=idx_dtypes[0],
                routing="uniform" if uniform else "random", unused_pct=0, align=aligns[0],
                weighted=weights[0], payload=payload, nan_padding=True,
                max_tokens=max(max_tokens, *tokens), seed=2000 + rows,
                ranks_per_node=_nodes(mode, R)))
    if payload is None and count_overflow:
        out.append(count_overflow_case(world_size, caps, mode, max_tokens))
    if check_errors:
        base = Case(world_size=min(world_size, 2), num_experts=2 * min(world_size, 2), topk=2,
                    hidden=H, tokens=(3,) * min(world_size, 2), payload=payload,
                    weighted=weights[0], idx_dtype=idx_dtypes[0], max_tokens=max_tokens,
                    seed=3000, unused_pct=0, dtype=_dtype("float32", dtypes),
                    y_dtype=_dtype("float32", dtypes))
        out += [with_violation(base.replace(seed=3000 + j), kind)
                for j, kind in enumerate(VIOLATIONS)
                if world_size > 1 or kind not in _GROUP_VIOLATIONS]
    return out


def count_overflow_case(world_size: int, caps: Capabilities, mode=None,
                        max_tokens: int = 24) -> Case:
    """The count-overflow corner: ``R = min(world_size, 2)`` ranks (1 where top-k is capped
    at 1), ``K = E = R``, every token routed to every expert (routing ``every``: a uniform
    plan too), ``65536 // R + 1`` tokens a rank: each expert gets more than 65,536 rows and
    each rank holds more than 65,536 slots. H = 1, so it costs what moving 2**17 rows costs."""
    R = max(1, min(world_size, 2, _topk_cap(caps, MAX_TOPK)))
    T = COUNT_ROWS // R + 1
    dtypes = x_dtypes(caps)
    return Case(world_size=R, num_experts=R, topk=R, hidden=1, tokens=(T,) * R,
                dtype=_dtype("bfloat16", dtypes), y_dtype=_dtype("bfloat16", dtypes),
                idx_dtype=(caps.index_dtypes or ("int32",))[0], routing="every", unused_pct=0,
                align=caps.aligns()[0], weighted=caps.allows("weighted"), nan_padding=True,
                max_tokens=max(max_tokens, T), seed=4000, ranks_per_node=_nodes(mode, R))


ORDERS_CYCLE = ("training", "stages")  # the per-R corners alternate the calls' order


def _with_sequences(corners: list) -> None:
    """The three cheapest of ``corners`` that move rows (the larger group first among equals)
    run with their twins: repeated, and two in flight in either combine order (training
    order)."""
    moving = [n for n, c in enumerate(corners)
              if sum(c.tokens) and c.unused_pct < 100 and c.violation is None]
    moving.sort(key=lambda n: (sum(corners[n].tokens) * corners[n].hidden * corners[n].topk,
                               -corners[n].world_size))
    for n, seq in zip(sorted(moving[:3], key=lambda n: corners[n].world_size), SEQUENCES[1:]):
        corners[n] = corners[n].replace(sequence=seq, order="training")


def _dtype(want: str, dtypes) -> str:
    """``want`` where the capabilities allow it, else the first allowed x dtype."""
    return want if want in dtypes else dtypes[0]


def _routed_past(case: Case, top: int, tries: int = 64) -> Case:
    """``case`` with the first seed (from its own) whose routing names an expert id above
    ``top``: a fixed corner that is sure to reach the ids a narrow packing loses."""
    for seed in range(case.seed, case.seed + tries):
        c = case.replace(seed=seed)
        if any(i.size and int(i.max()) > top for i in c.all_inputs()[1]):
            return c
    return case


def _nodes(mode, R) -> int:
    """ranks_per_node of a corner: two-level nodes where the world size allows them."""
    if mode is None or not mode.nodes:
        return 1
    inner = [g for g in range(2, R) if R % g == 0]
    return inner[0] if inner else 1
