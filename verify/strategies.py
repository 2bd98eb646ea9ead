"""Hypothesis strategies that draw whole-group cases.

Structure (world size, experts, top-k, hidden, tokens per rank, dtypes, align, capacity, ...)
is drawn by hypothesis, so it shrinks to a small failing case; the values themselves come from a
drawn seed (see :mod:`epkit.verify.cases`), which keeps examples cheap to draw and to print.
"""

from __future__ import annotations

from hypothesis import strategies as st

from epkit.reference import payloads
from .capabilities import WIDE_TOPK, Capabilities
from .cases import FLOAT_DTYPES, Case, ModeSpec

__all__ = ["cases"]


@st.composite
def cases(
    draw,
    world_size: int = 4,
    mode: ModeSpec | None = None,
    *,
    max_tokens: int = 24,
    min_world_size: int = 1,
    max_local_experts: int = 6,
    max_topk: int = 8,
    max_hidden: int = 72,
    capabilities: Capabilities | None = None,
    wide_every: int = 20,
) -> Case:
    """Draw a :class:`Case` for a group of up to ``world_size`` ranks, valid for ``mode`` and
    inside ``capabilities`` (:class:`~epkit.verify.capabilities.Capabilities`; default: all).

    ``mode`` (a :class:`ModeSpec`) constrains the draw: a quantized payload (``"mxfp8"``,
    ``"fp8_block128"``) gives ``H`` a multiple of its block (32, 128);
    ``uniform`` gives uniform plans without capacity; ``static`` keeps every rank's tokens
    within ``max_tokens``; ``nodes`` draws ``ranks_per_node``, a divisor of the world size
    (two-level nodes first, so a case shrinks to one with nodes of several ranks). Without a
    mode, payload and plan shape are drawn too.

    (About 70 lines, most of them the Case's fields: the draws' order is what hypothesis
    replays and shrinks by, so it reads here in one place.)

    About one draw in ``wide_every`` (0: never) is a wide top-k case: ``K`` in 129..255 (within
    ``max_topk`` of the capabilities) and up to 512 experts, with few tokens and a narrow hidden
    size; it shrinks to an ordinary draw.
    """
    caps = capabilities or Capabilities()
    uniform_only = mode is not None and mode.uniform
    no_unused = not caps.allows("unused_slots")
    # the draws, in this order (hypothesis replays and shrinks by it): the shape, the hidden
    # size, the routing and tokens, the dtypes, the options
    R, G, wide, payload, E, K, max_tokens_drawn, max_h = _shape(
        draw, world_size, min_world_size, mode, caps, max_local_experts, max_topk, max_tokens,
        max_hidden, wide_every)
    H = _hidden(draw, payload, wide, max_h)
    routing, K, tokens = _routing_and_tokens(draw, R, E, K, caps, uniform_only, no_unused,
                                             max_tokens_drawn)
    dtype = draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    y_dtype = dtype
    if caps.allows("mixed_dtypes") and not draw(st.integers(0, 3), label="mixed dtypes?"):
        y_dtype = draw(st.sampled_from(FLOAT_DTYPES), label="y_dtype")
    capacity = None
    if not uniform_only and caps.allows("capacity") and draw(st.booleans(), label="use capacity"):
        capacity = draw(st.integers(0, 16), label="capacity")
    if caps.allows("weighted") and caps.allows("unweighted"):
        weighted = draw(st.integers(0, 3), label="weighted") != 0  # mostly weighted
    else:
        weighted = caps.allows("weighted")
    return Case(
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
        max_tokens=max_tokens,
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
        ranks_per_node=G,
    )


def _shape(draw, world_size, min_world_size, mode, caps, max_local_experts, max_topk,
           max_tokens, max_hidden, wide_every):
    """World size, ranks per node (a mode with ``nodes``: a divisor of the world size, nodes of
    several ranks first), the wide top-k switch, payload, experts and top-k; with the token and
    hidden bounds that go with them."""
    R = draw(st.integers(min_world_size, world_size), label="world_size")
    G = 1
    if mode is not None and mode.nodes:
        divisors = [g for g in range(1, R + 1) if R % g == 0]
        G = draw(st.sampled_from([g for g in divisors if 1 < g < R] + [1, R][:len(divisors)]),
                 label="ranks_per_node")
    cap_k = caps.max_topk or 255
    wide = (wide_every > 0 and cap_k > WIDE_TOPK  # shrinks to False
            and draw(st.sampled_from([False] * (wide_every - 1) + [True]), label="wide top-k"))
    payload = (mode.payload if mode is not None
               else draw(st.sampled_from([None, *payloads.NAMES]), label="payload"))
    if wide:
        lo_k = min(129, cap_k)
        L = draw(st.integers(-(-lo_k // R), 512 // R), label="local_experts (wide)")
        E = R * L
        K = draw(st.integers(min(lo_k, E), min(255, E, cap_k)), label="topk (wide)")
        return R, G, wide, payload, E, K, min(max_tokens, 6), 16
    L = draw(st.integers(1, max_local_experts), label="local_experts")
    E = R * L
    K = draw(st.integers(1, min(max_topk, cap_k)), label="topk")
    return R, G, wide, payload, E, K, max_tokens, max_hidden


def _hidden(draw, payload, wide, max_h) -> int:
    """H: a multiple of a quantized payload's block (1..3 blocks of 32, 1..2 of 128)."""
    block = payloads.get(payload).block
    if block:
        return block * (1 if wide else draw(st.integers(1, max(2, 96 // block)),
                                            label="hidden/block"))
    return draw(st.integers(1, max_h), label="hidden")


def _routing_and_tokens(draw, R, E, K, caps, uniform_only, no_unused, max_tokens_drawn):
    """``(routing, K, tokens per rank)``: every slot used where the capabilities say so (K
    distinct experts per token, none -1), zero-token ranks only where allowed."""
    routings = ["random", "grouped", "hot", "uniform"]
    if no_unused:  # every slot used: K distinct experts per token, none left -1
        routings = ["random", "hot", "uniform"]
    routing = "uniform" if uniform_only else draw(st.sampled_from(routings), label="routing")
    if no_unused:
        K = min(K, R) if routing == "uniform" else min(K, E)
    min_t = 0 if caps.allows("zero_token_ranks") else 1
    if routing == "uniform":
        T = R * draw(st.integers(min_t, max(max_tokens_drawn // R, min_t)), label="tokens/R")
        return routing, K, (T,) * R
    return routing, K, tuple(draw(st.lists(st.integers(min_t, max_tokens_drawn), min_size=R,
                                           max_size=R), label="tokens"))
