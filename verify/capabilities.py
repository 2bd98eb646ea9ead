"""What an implementation says it supports, and the features a draw can be refused for.

A capability is *undeclared* (``None``: drawn; a refusal is redrawn without the feature and
counted as refused), *declared supported* (drawn; a refusal is a failure) or *declared
unsupported* (never drawn). Declarations come from, in increasing precedence, the factory's
``capabilities`` attribute, the mode's (:class:`~epkit.verify.cases.ModeSpec` ``capabilities``)
and ``--supports KEY=VALUE`` on the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ALIGNS", "ANY", "Capabilities", "FEATURES", "Feature", "declarations",
           "parse_supports", "resolve_capabilities"]

ALIGNS = (1, 2, 4, 3, 8)  # the aligns drawn when any is allowed
ANY = "any"
INDEX_DTYPES = ("int64", "int32")
X_DTYPES = ("float32", "bfloat16", "float16")  # what x and expert_y may be (cases.FLOAT_DTYPES)
WIDE_TOPK = 8  # a top-k above this is a "wide" draw (max_topk)


@dataclass(frozen=True)
class Capabilities:
    """Declared capabilities; ``None`` = undeclared (see the module docstring).

    capacity, unused_slots (``-1`` slots), mixed_dtypes (x and expert_y of different dtypes),
    weighted, unweighted, zero_token_ranks: yes / no. align: ``(1,)``, a tuple of aligns, or
    ``"any"``. index_dtypes: a tuple of ``int32`` / ``int64``. x_dtypes: the dtypes x and
    expert_y may have (``float32``, ``bfloat16``, ``float16``). max_topk: the largest top-k.
    padding: ``"zeros"`` (padding rows of expert_x / grad expert_y hold zeros) or ``"ignored"``
    (they are not looked at; contracts reordered / bounded only). accumulate: the accumulation
    dtype of the sums, per dtype of the data summed (:mod:`epkit.verify.accumulate`: ``float32``,
    ``native``, ``bfloat16:bfloat16,float32:float32``; ``--accumulate`` overrides it).
    check_errors: invalid inputs are drawn, and every rank must raise where the reference
    does (``--check-errors``)."""

    capacity: bool | None = None
    align: tuple | str | None = None
    unused_slots: bool | None = None
    mixed_dtypes: bool | None = None
    weighted: bool | None = None
    unweighted: bool | None = None
    index_dtypes: tuple | None = None
    x_dtypes: tuple | None = None
    max_topk: int | None = None
    zero_token_ranks: bool | None = None
    padding: str = "zeros"
    accumulate: str | None = None
    check_errors: bool | None = None

    # -- what may be drawn ------------------------------------------------------------------
    def aligns(self) -> tuple:
        if self.align is None or self.align == ANY:
            return ALIGNS
        return tuple(self.align)

    def allows(self, key: str) -> bool:
        return getattr(self, key) is not False

    def declared(self, key: str, case=None) -> bool:
        """Is ``key`` (a feature name) declared supported, for ``case``'s value of it?"""
        v = getattr(self, key)
        if v is None:
            return False
        if key == "align":
            return v == ANY or (case is not None and case.align in v)
        if key == "index_dtypes":
            return case is not None and case.idx_dtype in v
        if key == "x_dtypes":
            return case is not None and {case.dtype, case.y_dtype} <= set(v)
        if key == "max_topk":
            return case is not None and case.topk <= v
        return v is True

    def merged(self, other: "Capabilities | dict | None") -> "Capabilities":
        if other is None:
            return self
        if isinstance(other, Capabilities):
            other = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                     if getattr(other, f.name) != getattr(Capabilities(), f.name)}
        return dataclasses.replace(self, **parse_supports(other))

    def describe(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or (f.name == "padding" and v == "zeros"):
                continue
            if isinstance(v, bool):
                v = "yes" if v else "no"
            elif isinstance(v, tuple):
                v = ",".join(str(a) for a in v)
            parts.append(f"{f.name}={v}")
        return " ".join(parts) or "undeclared"


_BOOL = {"yes": True, "y": True, "true": True, "1": True, "on": True,
         "no": False, "n": False, "false": False, "0": False, "off": False}
_KEYS = {f.name for f in dataclasses.fields(Capabilities)}


def _value(key: str, raw):
    if key == "accumulate":
        from .accumulate import describe_accumulate, parse_accumulate

        return describe_accumulate(parse_accumulate(raw))
    if key == "padding":
        v = str(raw).strip().lower()
        allowed = ("zeros", "ignored")
        if v not in allowed:
            raise ValueError(f"--supports {key}: expected one of {', '.join(allowed)}, got {raw!r}")
        return v
    if key == "align":
        if isinstance(raw, (tuple, list)):
            return tuple(int(a) for a in raw)
        if isinstance(raw, int) and not isinstance(raw, bool):
            return (raw,)
        v = str(raw).strip().lower()
        if v == ANY:
            return ANY
        try:
            aligns = tuple(int(a) for a in v.split(",") if a.strip())
        except ValueError:
            raise ValueError(f"--supports align: expected 1, a list such as 1,2,4, or any; "
                             f"got {raw!r}") from None
        if not aligns or min(aligns) < 1:
            raise ValueError(f"--supports align: aligns are >= 1, got {raw!r}")
        return aligns
    if key in ("index_dtypes", "x_dtypes"):
        names = tuple(raw) if isinstance(raw, (tuple, list)) else tuple(
            a.strip() for a in str(raw).split(",") if a.strip())
        known = INDEX_DTYPES if key == "index_dtypes" else X_DTYPES
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise ValueError(f"--supports {key}: some of {', '.join(known)}, got {raw!r}")
        return names
    if key == "max_topk":
        v = int(raw)
        if not 1 <= v <= 255:
            raise ValueError(f"--supports max_topk: 1..255, got {raw!r}")
        return v
    if isinstance(raw, bool):
        return raw
    v = _BOOL.get(str(raw).strip().lower())
    if v is None:
        raise ValueError(f"--supports {key}: expected yes or no, got {raw!r}")
    return v


def parse_supports(items) -> dict:
    """``["capacity=no", "align=1,2"]`` or ``{"capacity": False}`` -> validated field values."""
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items or ():
            if isinstance(item, tuple):
                pairs.append(item)
                continue
            key, sep, val = str(item).partition("=")
            if not sep:
                raise ValueError(f"--supports wants KEY=VALUE, got {item!r}")
            pairs.append((key, val))
    out = {}
    for key, raw in pairs:
        key = key.strip().replace("-", "_")
        if key not in _KEYS:
            raise ValueError(f"--supports: unknown key {key!r} (known: {', '.join(sorted(_KEYS))})")
        out[key] = _value(key, raw)
    if out.get("weighted") is False and out.get("unweighted") is False:
        raise ValueError("--supports: weighted=no and unweighted=no leave nothing to draw")
    return out


def resolve_capabilities(factory, mode, supports=None) -> Capabilities:
    """The factory's ``capabilities``, then the mode's, then ``supports`` (the CLI's)."""
    caps = Capabilities()
    for layer in (getattr(factory, "capabilities", None), getattr(mode, "capabilities", None),
                  supports):
        if layer:
            caps = caps.merged(dict(layer) if isinstance(layer, tuple) else layer)
    return caps


# -- features a refusal can be attributed to ------------------------------------------------
@dataclass(frozen=True)
class Feature:
    """A refusable feature of a case: ``present(case)`` and ``remove(case)`` (the same case
    without it); ``key`` is the capability that declares it, ``words`` hint at it in a
    refusal's message. ``flip``: removing it turns on another feature (unweighted for weighted,
    the other index dtype), so it is tried only where the refusal names it."""

    key: str
    present: object
    remove: object
    words: tuple = ()
    flip: bool = False

    def declaration(self, case) -> str:
        """The ``--supports`` declaration that keeps ``case``'s refused value out of draws."""
        if self.key == "index_dtypes":
            return "index_dtypes=" + ("int32" if case.idx_dtype == "int64" else "int64")
        if self.key == "x_dtypes":
            return "x_dtypes=float32,bfloat16"
        return f"{self.key}=" + {"align": "1", "max_topk": str(WIDE_TOPK)}.get(self.key, "no")


def _has_unused(case) -> bool:
    _, idx, _ = case.all_inputs()
    return any((i < 0).any() for i in idx)


def _no_unused(case):
    if case.routing == "uniform":
        return case.replace(topk=min(case.topk, case.world_size))
    return case.replace(routing="random" if case.routing == "grouped" else case.routing,
                        topk=min(case.topk, case.num_experts), unused_pct=0)


def _no_zero_ranks(case):
    if case.routing == "uniform":
        return case.replace(tokens=tuple(t or case.world_size for t in case.tokens))
    return case.replace(tokens=tuple(t or 1 for t in case.tokens))


def _no_half(dtype: str) -> str:
    return "float32" if dtype == "float16" else dtype


FEATURES = (
    Feature("capacity", lambda c: c.capacity is not None, lambda c: c.replace(capacity=None),
            ("capacity", "drop")),
    Feature("align", lambda c: c.align != 1, lambda c: c.replace(align=1), ("align", "pad")),
    Feature("unused_slots", _has_unused, _no_unused, ("-1", "unused", "negative")),
    Feature("mixed_dtypes", lambda c: c.y_dtype != c.dtype,
            lambda c: c.replace(y_dtype=c.dtype), ("dtype",)),
    Feature("x_dtypes", lambda c: "float16" in (c.dtype, c.y_dtype),
            lambda c: c.replace(dtype=_no_half(c.dtype), y_dtype=_no_half(c.y_dtype)),
            ("float16", "half", "fp16", "dtype")),
    Feature("weighted", lambda c: c.weighted, lambda c: c.replace(weighted=False,
                                                                  special_weights=False),
            ("weight", "prob"), flip=True),
    Feature("unweighted", lambda c: not c.weighted, lambda c: c.replace(weighted=True),
            ("unweighted",), flip=True),
    Feature("index_dtypes", lambda c: True,
            lambda c: c.replace(idx_dtype="int32" if c.idx_dtype == "int64" else "int64"),
            ("int32", "int64", "index", "idx"), flip=True),
    Feature("max_topk", lambda c: c.topk > WIDE_TOPK, lambda c: c.replace(topk=WIDE_TOPK),
            ("topk", "top-k", "top_k")),
    Feature("zero_token_ranks", lambda c: 0 in c.tokens, _no_zero_ranks,
            ("zero", "empty", "no tokens")),
)


def declarations(refused: dict) -> list[str]:
    """``--supports`` declarations for refusals ``{feature key: [refused cases]}``: one per
    feature, none that contradict each other (weighted=no with unweighted=no, both index
    dtypes) and none for a feature no draw was refused for."""
    by_key = {f.key: f for f in FEATURES}
    out = {}
    for key, refused_cases in refused.items():
        f = by_key.get(key)
        if f is None:
            continue
        decls = {f.declaration(c) for c in refused_cases}
        if len(decls) == 1:
            out[key] = decls.pop()
    if "weighted" in out and "unweighted" in out:
        del out["weighted"], out["unweighted"]
    return [out[k] for k in sorted(out)]
