"""Hypothesis strategies for whole-group cases of the reference, and comparison helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
from hypothesis import strategies as st

from epkit.reference.dtypes import BFLOAT16

F32 = np.dtype(np.float32)
DTYPES = (F32, BFLOAT16)
# Elements per scale of each quantized payload, and a payload row's bytes (docs/design.md),
# typed here independently of epkit.reference.abi.
BLOCKS = {"mxfp8": 32, "fp8_block128": 128}


def payload_row_bytes(payload, H, itemsize):
    return {None: H * itemsize, "mxfp8": H + H // 32, "fp8_block128": H + 4 * (H // 128)}[payload]


RESULT_FIELDS = ("expert_x", "expert_scale", "tokens_per_expert", "expert_offsets", "row_src",
                 "row_weight", "dropped_per_expert", "rank_major.recv_x", "rank_major.recv_scale",
                 "rank_major.recv_topk_idx", "rank_major.recv_topk_weights", "rank_major.recv_src",
                 "source.topk_idx", "source.topk_weights", "source.kept")


@dataclass
class Case:
    R: int
    E: int
    K: int
    H: int
    dtype: np.dtype
    xs: List[np.ndarray]
    idx: List[np.ndarray]
    ws: List[np.ndarray]
    align: int = 1
    capacity: Optional[int] = None
    payload: Optional[str] = None
    uniform: bool = False
    values: str = "random"
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def L(self):
        return self.E // self.R

    def kw(self, **more):
        return dict(num_experts=self.E, align=self.align, capacity=self.capacity,
                    payload=self.payload, **more)

    def rng(self, salt=1):
        return np.random.default_rng([self.seed, salt])

    def rows_like(self, shapes, dtype, salt=1, ints=None):
        """Random arrays of the given shapes: small integers (``ints=n``: -n..n), dyadic values
        when the case is dyadic, else standard normal."""
        rng = self.rng(salt)
        out = []
        for shape in shapes:
            if ints is not None:
                a = rng.integers(-ints, ints + 1, size=shape).astype(np.float32)
            elif self.values == "dyadic":
                a = rng.integers(-8, 9, size=shape).astype(np.float32) * np.float32(0.25)
            else:
                a = rng.standard_normal(shape).astype(np.float32)
            out.append(a.astype(dtype))
        return out


def _routing(rng, T, K, E, hot):
    idx = np.full((T, K), -1, np.int64)
    p = np.ones(E)
    if hot:
        p[0] += 4 * E
        p[E - 1] += E
    p /= p.sum()
    for t in range(T):
        n = int(rng.integers(0, min(K, E) + 1))
        idx[t, :n] = rng.choice(E, n, replace=False, p=p)
        rng.shuffle(idx[t])
    return idx


def _uniform_routing(rng, T, R, L):
    """K = R: every token names one expert on every rank, so every plan count is T."""
    idx = np.zeros((T, R), np.int64)
    for t in range(T):
        idx[t] = np.arange(R) * L + rng.integers(0, L, size=R)
        rng.shuffle(idx[t])
    return idx


@st.composite
def cases(draw, max_ranks=6, dtypes=DTYPES, payloads=(None,), values=("random", "dyadic"),
          capacity=True, uniform=None, max_tokens=5):
    R = draw(st.integers(1, max_ranks))
    L = draw(st.integers(1, 3))
    E = R * L
    payload = draw(st.sampled_from(payloads))
    is_uniform = draw(st.sampled_from([False, False, True])) if uniform is None else uniform
    H = BLOCKS[payload] if payload else draw(st.sampled_from([1, 2, 3, 8]))
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    vals = draw(st.sampled_from(values))
    align = draw(st.sampled_from([1, 1, 2, 3]))
    cap = draw(st.one_of(st.none(), st.integers(0, 4))) if capacity else None
    hot = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if is_uniform:
        T = draw(st.integers(0, max_tokens))
        Ts, K = [T] * R, R
        idx = [_uniform_routing(rng, T, R, L) for _ in range(R)]
    else:
        K = draw(st.sampled_from([0, 1, 2, 2, 3, 4]))
        Ts = [draw(st.sampled_from([0] + list(range(1, max_tokens + 1)))) for _ in range(R)]
        idx = [_routing(rng, T, K, E, hot) for T in Ts]
    case = Case(R, E, K, H, dtype, [], idx, [], align, cap, payload, is_uniform, vals, seed)
    case.xs = case.rows_like([(T, H) for T in Ts], dtype, salt=2)
    if vals == "dyadic":
        case.ws = [rng.integers(-4, 5, size=(T, K)).astype(np.float32) * np.float32(0.5) for T in Ts]
    else:
        case.ws = [rng.random((T, K)).astype(np.float32) for T in Ts]
    return case


def bits(a):
    """Raw bytes of an array (bitwise comparison, NaN payloads and -0.0 included)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(-1) if a.size else np.zeros(0, np.uint8)


def assert_bitwise(a, b, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert np.array_equal(bits(a), bits(b)), (what, a, b)


def assert_lists_bitwise(xs, ys, what=""):
    assert len(xs) == len(ys), what
    for r, (a, b) in enumerate(zip(xs, ys)):
        assert_bitwise(a, b, f"{what} rank {r}")


def field_of(r, path):
    """A result's field by its dotted path (``"rank_major.recv_x"``); None under a record that is
    None (the rank-major fields of a result without ``rank_major=True``)."""
    for name in path.split("."):
        r = None if r is None else getattr(r, name)
    return r


def assert_results_bitwise(ra, rb, fields=RESULT_FIELDS):
    assert len(ra) == len(rb)
    for a, b in zip(ra, rb):
        for f in fields:
            assert_bitwise(field_of(a, f), field_of(b, f), f"rank {a.rank} {f}")
        for f in ("rank", "group.num_ranks", "group.num_experts", "group.hidden", "group.topk",
                  "source.num_tokens", "group.x_dtype"):
            assert field_of(a, f) == field_of(b, f), f
