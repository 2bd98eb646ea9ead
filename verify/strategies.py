"""Hypothesis strategies that draw whole-group cases.

Structure (world size, experts, top-k, hidden, tokens per rank, dtypes, align, capacity, ...)
is drawn by hypothesis, so it shrinks to a small failing case; the values themselves come from a
drawn seed (see :mod:`epkit.verify.cases`), which keeps examples cheap to draw and to print.
"""

from __future__ import annotations

from hypothesis import strategies as st

from epkit.verify.cases import FLOAT_DTYPES, Case, ModeSpec

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
) -> Case:
    """Draw a :class:`Case` for a group of up to ``world_size`` ranks, valid for ``mode``.

    ``mode`` (a :class:`ModeSpec`) constrains the draw: ``payload="mxfp8"`` gives ``H % 32 == 0``;
    ``uniform`` gives uniform plans without capacity; ``static`` keeps every rank's tokens
    within ``max_tokens``. Without a mode, payload and plan shape are drawn too.
    """
    R = draw(st.integers(min_world_size, world_size), label="world_size")
    L = draw(st.integers(1, max_local_experts), label="local_experts")
    E = R * L
    K = draw(st.integers(1, max_topk), label="topk")
    payload = mode.payload if mode is not None else draw(st.sampled_from([None, "mxfp8"]))
    if payload == "mxfp8":
        H = 32 * draw(st.integers(1, 3), label="hidden/32")
    else:
        H = draw(st.integers(1, max_hidden), label="hidden")
    uniform_only = mode is not None and mode.uniform
    routing = "uniform" if uniform_only else draw(
        st.sampled_from(["random", "grouped", "hot", "uniform"]), label="routing")
    if routing == "uniform":
        T = R * draw(st.integers(0, max_tokens // R), label="tokens/R")
        tokens = (T,) * R
    else:
        tokens = tuple(
            draw(st.lists(st.integers(0, max_tokens), min_size=R, max_size=R), label="tokens")
        )
    dtype = draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    y_dtype = dtype if draw(st.integers(0, 3)) else draw(st.sampled_from(FLOAT_DTYPES))
    capacity = None
    if not uniform_only and draw(st.booleans(), label="use capacity"):
        capacity = draw(st.integers(0, 16), label="capacity")
    return Case(
        world_size=R,
        num_experts=E,
        topk=K,
        hidden=H,
        tokens=tokens,
        dtype=dtype,
        y_dtype=y_dtype,
        idx_dtype=draw(st.sampled_from(["int64", "int32"]), label="idx_dtype"),
        routing=routing,
        unused_pct=draw(st.sampled_from([20, 0, 10, 50, 100]), label="unused_pct"),
        align=draw(st.sampled_from([1, 2, 4, 3, 8]), label="align"),
        capacity=capacity,
        weighted=draw(st.integers(0, 3), label="weighted") != 0,  # mostly weighted
        payload=payload,
        nan_padding=draw(st.booleans(), label="nan_padding"),
        zero_rows=draw(st.integers(0, 4), label="zero_rows") == 4,  # shrinks to False
        max_tokens=max_tokens,
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )
