"""Whole-group test cases and the modes they run in.

A :class:`Case` is small and hashable: the knobs hypothesis draws plus one integer seed. The
arrays (tokens, routing, weights, and the expert outputs and gradients the harness feeds in) are
made from it deterministically with NumPy, so the parent process (which runs the reference) and
every worker rank (which runs the implementation) build the same bytes without shipping them, and
``repr(case)`` is a complete reproducer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = ["Case", "ModeSpec", "FLOAT_DTYPES", "ORDERS", "SEQUENCES", "STAGES", "VIOLATIONS",
           "np_dtype"]

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# Invalid inputs a case can carry (``Case.violation``, drawn under ``check_errors``): each is an
# InputError of the reference, which every rank of the implementation must raise too.
VIOLATIONS = ("duplicate_id", "id_out_of_range", "nonfinite_weight", "topk_differs",
              "hidden_differs", "dtype_differs", "experts_not_divisible", "weights_shape",
              "idx_rows")
# What a rank does with a case, in the case's ``order`` (worker.py); a failure names its stage.
# training: as a training step does it, combine before any backward, then one backward over
# both; stages: each backward right after its forward (dispatch's before combine runs).
ORDERS = {"training": ("dispatch", "combine", "backward"),
          "stages": ("dispatch", "dispatch_backward", "combine", "combine_backward")}
STAGES = ORDERS["stages"]
# The properties (the table's columns) each stage's call produces.
PRODUCES = {"dispatch": ("dispatch",), "dispatch_backward": ("dispatch_backward",),
            "combine": ("combine",), "combine_backward": ("combine_backward", "weight_grad"),
            "backward": ("dispatch_backward", "combine_backward", "weight_grad")}
# How a report names the call that runs in each stage ("dispatch wrote into topk_idx").
CALLS = {"dispatch": "dispatch", "dispatch_backward": "dispatch's backward",
         "combine": "combine", "combine_backward": "combine's backward",
         "backward": "the backward"}
# How a case shares its adapter with its twin (Case.twin: the same shapes, a fresh routing):
# alone; the twin run after it; both dispatched before either is combined (two batches in
# flight), combined in the order dispatched or the reverse (worker.schedule).
SEQUENCES = ("single", "repeat", "overlap", "overlap_reversed")


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a dtype name (bfloat16 / float8_e4m3fn come from ml_dtypes)."""
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    if name == "float8_e4m3fn":
        return np.dtype(ml_dtypes.float8_e4m3fn)
    return np.dtype(name)


@dataclass(frozen=True)
class ModeSpec:
    """One way of running an implementation: a name for the report and the factory's kwargs.

    ``kwargs`` are passed to the adapter factory (``factory(group, **kwargs)``). The flags tell
    the harness what the mode needs and allows:

    - ``payload``: a quantized payload (``"mxfp8"``, ``"fp8_block128"``; the reference's payload
      table) makes cases with ``H`` a multiple of its block and compares ``expert_x`` as E4M3
      plus ``expert_scale`` (and ``expert_x_hp`` against the dequantized rows, if offered).
    - ``uniform``: the mode needs uniform plans (``exchange="equal"``); cases are drawn uniform.
    - ``static``: the factory also gets ``max_tokens_per_rank=case.max_tokens``, and dispatch may
      return extra all-padding rows after ``expert_offsets[-1]``.
    - ``capabilities``: what this mode supports (``(("capacity", False), ...)`` or a dict), on
      top of the factory's ``capabilities`` (:mod:`epkit.verify.capabilities`).
    - ``nodes``: the factory takes ``ranks_per_node`` (the nodes of the combine's summation
      order, and hier's): cases draw it, a divisor of the world size, the factory gets
      ``ranks_per_node=case.ranks_per_node`` and the reference is called with it. Other modes
      run with ``ranks_per_node = 1`` (rank by rank).
    """

    name: str = "default"
    kwargs: tuple = ()
    payload: str | None = None
    uniform: bool = False
    static: bool = False
    capabilities: tuple = ()
    nodes: bool = False

    def __post_init__(self):
        if isinstance(self.capabilities, dict):
            object.__setattr__(self, "capabilities", tuple(self.capabilities.items()))

    def factory_kwargs(self, case: "Case | None" = None) -> dict:
        kw = dict(self.kwargs)
        if self.static and case is not None:
            kw["max_tokens_per_rank"] = case.max_tokens
        if self.nodes and case is not None:
            kw["ranks_per_node"] = case.ranks_per_node
        return kw


@dataclass(frozen=True)
class Case:
    """One whole-group case. ``eval(repr(case))`` (with ``Case`` imported) rebuilds it."""

    world_size: int
    num_experts: int
    topk: int
    hidden: int
    tokens: tuple  # tokens per rank, len == world_size
    dtype: str = "float32"  # x
    y_dtype: str = "float32"  # expert_y fed to combine
    idx_dtype: str = "int64"
    routing: str = "random"  # "random" | "hot" | "grouped" | "uniform" | "every"
    unused_pct: int = 20  # chance (percent) that a slot is -1 (all but "uniform" routing)
    align: int = 1
    capacity: int | None = None
    weighted: bool = True
    payload: str | None = None
    nan_padding: bool = False  # padding rows of expert_y / grad_expert_x hold NaN
    zero_rows: bool = False  # some token rows are +0 / -0 (exercises signed zeros, amax == 0)
    max_tokens: int = 32  # the bound tokens were drawn under (static modes get it)
    seed: int = 0
    ranks_per_node: int = 1  # nodes of the summation order (modes with ``nodes``; a divisor of R)
    specials: bool = False  # real rows hold NaN, +-Inf, -0 and subnormals (x: finite if payload)
    special_weights: bool = False  # some routing weights are exactly 0, -0 or 1
    violation: str | None = None  # an invalid input (VIOLATIONS) on the last rank
    order: str = "training"  # ORDERS: the calls' order on every rank
    sequence: str = "single"  # SEQUENCES: with its twin on the same adapter, and how

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}")
        if self.sequence not in SEQUENCES:
            raise ValueError(f"sequence must be one of {', '.join(SEQUENCES)}")
        if self.sequence.startswith("overlap") and self.order != "training":
            raise ValueError("two batches in flight run in training order")
        if self.sequence != "single" and self.violation is not None:
            raise ValueError("an invalid input runs alone (sequence 'single')")
        if len(self.tokens) != self.world_size:
            raise ValueError("tokens must list one count per rank")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError("ranks_per_node must divide world_size")
        if self.violation is not None and self.violation not in VIOLATIONS:
            raise ValueError(f"violation must be one of {', '.join(VIOLATIONS)}")
        if self.num_experts % self.world_size and self.violation != "experts_not_divisible":
            raise ValueError("num_experts must be a multiple of world_size")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)

    def twin(self) -> "Case":
        """The second batch of a sequence: the same shapes (tokens, H, K, E, dtypes, options),
        a fresh routing and fresh values (another seed), alone."""
        return self.replace(seed=(self.seed * 0x9E3779B1 + 0x7F4A7C15) % 2**32,
                            sequence="single")

    # -- inputs ---------------------------------------------------------------------------
    def _rng(self, rank: int, tag: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, rank, tag])

    def inputs(self, rank: int):
        """(x [T, H], topk_idx [T, K], topk_weights [T, K] float32) of one rank, as NumPy."""
        T, H, K, E, R = self.tokens[rank], self.hidden, self.topk, self.num_experts, self.world_size
        rng = self._rng(rank, 0)
        x = _values(rng, (T, H), self.dtype, self.specials, nonfinite=self.payload is None)
        if self.zero_rows and T:
            rows = rng.random(T) < 0.25
            x[rows] = np.where(rng.random((int(rows.sum()), 1)) < 0.5, 0.0, -0.0).astype(x.dtype)
        idx = np.full((T, K), -1, dtype=np.int64)
        if self.routing == "every":
            # every token routes to every expert (K = E), in its own random order: each expert
            # gets every token of the group (the count-overflow corner; drawn vectorized)
            if K != E:
                raise ValueError("routing 'every' needs topk == num_experts")
            idx = np.argsort(rng.random((T, K)), axis=1).astype(np.int64)
        elif self.routing == "uniform":
            # Token t uses one expert on each of the ranks (t + j) % R, j < min(K, R): every
            # source sends every destination the same number of tokens and of slots.
            used = min(K, R)
            for t in range(T):
                ks = rng.permutation(K)[:used]
                for j, k in enumerate(ks):
                    d = (t + j) % R
                    idx[t, k] = d * self.local_experts + int(rng.integers(self.local_experts))
        else:
            logits = np.zeros((T, E))
            if self.routing == "hot":
                hot = rng.choice(E, size=min(E, int(rng.integers(1, 3))), replace=False)
                logits[:, hot] = 3.0
            elif self.routing == "grouped":
                # node-limited routing (DeepSeek-V3 style): each token picks its experts on
                # one or two ranks only, so several of its slots share a rank.
                L = self.local_experts
                for t in range(T):
                    ranks = rng.choice(R, size=min(R, 1 + int(rng.random() < 0.3)), replace=False)
                    allowed = (ranks[:, None] * L + np.arange(L)[None, :]).reshape(-1)
                    logits[t] = -np.inf
                    logits[t, allowed] = 0.0
            # Gumbel top-k: K distinct experts per token, drawn with weights exp(logits).
            keys = logits + rng.gumbel(size=(T, E))
            width = min(K, E)
            top = np.argsort(-keys, axis=1, kind="stable")[:, :width]
            top = np.where(np.take_along_axis(keys, top, axis=1) == -np.inf, -1, top)
            drop = rng.random((T, width)) * 100 < self.unused_pct
            top = np.where(drop, -1, top)
            for t in range(T):
                idx[t, rng.permutation(K)[:width]] = top[t]
        idx = idx.astype(self.idx_dtype)
        w = (rng.random((T, K)) * 2.0 - 0.5).astype(np.float32)
        w *= np.exp2(rng.integers(-3, 4, size=(T, K))).astype(np.float32)
        if self.special_weights:
            # exact 0 keeps its slot (a routing map built from probs != 0 loses it), -0 and 1
            r = rng.random((T, K))
            w = np.where(r < 0.15, np.float32(0.0), w)
            w = np.where((r >= 0.15) & (r < 0.25), np.float32(-0.0), w)
            w = np.where((r >= 0.25) & (r < 0.4), np.float32(1.0), w).astype(np.float32)
        if self.violation is not None and rank == self.world_size - 1:
            x, idx, w = _violate(self.violation, x, idx, w, E)
        return x, idx, w

    def all_inputs(self):
        """Lists over ranks: (xs, topk_idx, topk_weights)."""
        per = [self.inputs(r) for r in range(self.world_size)]
        return [p[0] for p in per], [p[1] for p in per], [p[2] for p in per]

    def expert_rows(self, rank: int, tag: int, valid: np.ndarray, dtype: str) -> np.ndarray:
        """Random rows ``[len(valid), H]`` by position (padding rows, where ``valid`` is False,
        hold NaN when ``nan_padding``). The harness itself uses :meth:`slot_rows`."""
        rng = self._rng(rank, tag)
        v = _values(rng, (len(valid), self.hidden), "float32")
        if self.nan_padding:
            v[~valid] = np.nan
        return v.astype(np_dtype(dtype))

    def slot_rows(self, rank: int, tag: int, row_src, dtype: str) -> np.ndarray:
        """The rows fed to an implementation (expert_y, the gradient of expert_x) on ``rank``,
        in *its* row order: the row of slot ``(s, t, k)`` (``row_src``) is a fixed random row of
        that slot, wherever it lives, so any layout can be checked against the reference's.
        Padding rows (``row_src`` -1, or not a slot of this case) hold NaN when
        ``nan_padding``, else random values."""
        src = np.asarray(row_src, dtype=np.int64).reshape(-1, 3)
        M, H, K = len(src), self.hidden, self.topk
        out = _values(self._rng(rank, tag + 16), (M, H), "float32")
        s, t, k = src[:, 0], src[:, 1], src[:, 2]
        real = (s >= 0) & (s < self.world_size) & (t >= 0) & (k >= 0) & (k < K)
        real &= t < np.asarray(self.tokens, dtype=np.int64)[np.clip(s, 0, self.world_size - 1)]
        if self.nan_padding:
            out[~real] = np.nan
        for r in np.unique(s[real]):
            table = _values(self._rng(int(r), tag + 32), (self.tokens[r] * K, H), "float32",
                            self.specials)
            rows = np.flatnonzero(real & (s == r))
            out[rows] = table[t[rows] * K + k[rows]]
        return out.astype(np_dtype(dtype))

    def token_rows(self, rank: int, tag: int, recv_src, dtype: str) -> np.ndarray:
        """Like :meth:`slot_rows` for a rank-major layout: the row of token ``(s, t)``
        (``recv_src``) on ``rank`` is a fixed random row of that token and rank."""
        src = np.asarray(recv_src, dtype=np.int64).reshape(-1, 2)
        out = _values(self._rng(rank, tag + 16), (len(src), self.hidden), "float32")
        s, t = src[:, 0], src[:, 1]
        real = (s >= 0) & (s < self.world_size) & (t >= 0)
        real &= t < np.asarray(self.tokens, dtype=np.int64)[np.clip(s, 0, self.world_size - 1)]
        if self.nan_padding:
            out[~real] = np.nan
        for r in np.unique(s[real]):
            table = _values(np.random.default_rng([self.seed, int(r), tag + 64, rank]),
                            (self.tokens[r], self.hidden), "float32", self.specials)
            rows = np.flatnonzero(real & (s == r))
            out[rows] = table[t[rows]]
        return out.astype(np_dtype(dtype))

    def grad_out(self, rank: int) -> np.ndarray:
        """The gradient fed to combine's output on ``rank``: [T, H] in x's dtype."""
        return _values(self._rng(rank, 3), (self.tokens[rank], self.hidden), self.dtype,
                       self.specials)

    def snippet(self, impl: str, mode: str) -> str:
        return (
            "from epkit.verify import Case, replay\n"
            f"replay({self!r},\n       impl={impl!r}, mode={mode!r})"
        )


TAG_Y, TAG_GRAD_X = 1, 2


_SUBNORMAL_ROW = np.float32(2.0**-136)  # scales a row of normals into the subnormal range


def _values(rng: np.random.Generator, shape, dtype: str, specials: bool = False,
            nonfinite: bool = True) -> np.ndarray:
    """Real random floats: normal, each row scaled by its own power of two, so that summation
    order shows in the last bits. ``specials``: some rows lie wholly in the subnormal range (a
    token with one such slot has a subnormal sum, which flushing to zero loses), and single
    elements are NaN, +-Inf (``nonfinite``), -0 or subnormal."""
    v = rng.standard_normal(shape).astype(np.float32)
    if len(shape) == 2 and shape[0]:
        v *= np.exp2(rng.integers(-6, 7, size=(shape[0], 1))).astype(np.float32)
    if specials and v.size:
        v[rng.random(shape[0]) < 0.2] *= _SUBNORMAL_ROW
        r = rng.random(shape)
        tiny = (np.sign(rng.standard_normal(shape)) * np.exp2(-rng.integers(127, 150, shape)))
        v = np.where(r < 0.08, tiny.astype(np.float32), v)
        v = np.where((r >= 0.08) & (r < 0.11), np.float32(-0.0), v)
        if nonfinite:
            v = np.where((r >= 0.11) & (r < 0.12), np.float32(np.nan), v)
            v = np.where((r >= 0.12) & (r < 0.13), np.float32(np.inf), v)
            v = np.where((r >= 0.13) & (r < 0.14), np.float32(-np.inf), v)
    return v.astype(np_dtype(dtype))


def _violate(kind: str, x, idx, w, E):
    """One rank's inputs made invalid the way ``kind`` says (``experts_not_divisible`` is the
    case's ``num_experts`` itself)."""
    if kind == "duplicate_id" and idx.shape[0] and idx.shape[1] >= 2:
        idx = idx.copy()
        idx[0, 1] = idx[0, 0] = max(int(idx[0, 0]), 0)
    elif kind == "id_out_of_range" and idx.size:
        idx = idx.copy()
        idx[0, 0] = E
    elif kind == "nonfinite_weight" and w.size:
        w = w.copy()
        w[0, -1] = np.inf if w.shape[0] % 2 else np.nan
    elif kind == "topk_differs":
        idx = np.concatenate([idx, np.full((idx.shape[0], 1), -1, idx.dtype)], axis=1)
        w = np.concatenate([w, np.zeros((w.shape[0], 1), w.dtype)], axis=1)
    elif kind == "hidden_differs":
        x = np.concatenate([x, np.zeros((x.shape[0], 1), x.dtype)], axis=1)
    elif kind == "dtype_differs":
        other = "float32" if x.dtype == np_dtype("bfloat16") else "bfloat16"
        x = x.astype(np.float32).astype(np_dtype(other))
    elif kind == "weights_shape":
        w = np.concatenate([w, np.zeros((w.shape[0], 1), w.dtype)], axis=1)
    elif kind == "idx_rows":
        idx = np.concatenate([idx, np.full((1, idx.shape[1]), -1, idx.dtype)])
    return x, idx, w


def sane_row_src(row_src, rows: int, width: int = 3) -> np.ndarray:
    """``row_src`` as int64 ``[rows, width]`` (``recv_src``: width 2); anything malformed
    (wrong shape or kind) reads as all padding (the dispatch check reports it)."""
    a = None if row_src is None else np.asarray(row_src)
    if a is None or a.shape != (rows, width) or a.dtype.kind not in "iu":
        return np.full((rows, width), -1, dtype=np.int64)
    return a.astype(np.int64)


def valid_rows(tokens_per_expert, expert_offsets, rows: int) -> np.ndarray:
    """Boolean mask of the non-padding rows of an expert-major layout with ``rows`` rows.
    Tolerates a malformed layout (that is the dispatch check's business, not this one's)."""
    valid = np.zeros(rows, dtype=bool)
    tpe = np.asarray(tokens_per_expert).reshape(-1)
    off = np.asarray(expert_offsets).reshape(-1)
    for j in range(min(len(tpe), max(len(off) - 1, 0))):
        lo = int(np.clip(off[j], 0, rows))
        hi = int(np.clip(off[j] + tpe[j], lo, rows))
        valid[lo:hi] = True
    return valid

