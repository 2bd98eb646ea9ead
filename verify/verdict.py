"""The outcome of one case: a status per property, the contract each met, and the report.

The properties are the columns of the closing table; a :class:`Verdict` holds each one's
status (``passed``, ``failed``, ``refused``, ``skipped``, ``n/a``), the strongest contract it
met, the mismatches found and the report that replays a failure.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from .cases import Case, ModeSpec

__all__ = ["CONTRACTS", "PROPERTIES", "Mismatch", "Verdict", "weaker"]

# Properties (columns of the closing table); cases.PRODUCES says which stage makes each.
PROPERTIES = ("dispatch", "dispatch_backward", "combine", "combine_backward", "weight_grad")
PASSED, FAILED, REFUSED, SKIPPED, NA = "passed", "failed", "refused", "skipped", "n/a"
ACCEPTED = "accepted"  # a tally's status: an invalid input the implementation did not reject
CONTRACTS = ("exact", "reordered", "bounded")  # strictest first
SEQUENCE_TEXT = {"repeat": "the twin run after the case",
                 "overlap": "both dispatched before either is combined, then combined and "
                            "differentiated in the order dispatched",
                 "overlap_reversed": "both dispatched before either is combined, then "
                                     "combined and differentiated in the reverse order"}
_RANK = {c: i for i, c in enumerate(CONTRACTS)}


def weaker(a: str | None, b: str | None) -> str | None:
    """The weaker of two contract levels (None: none met)."""
    if a is None or b is None:
        return None
    return a if _RANK[a] >= _RANK[b] else b


@dataclass
class Mismatch:
    prop: str
    rank: int | None
    output: str
    message: str

    def __str__(self):
        where = f"rank {self.rank}, " if self.rank is not None else ""
        return f"{self.prop}: {where}{self.output}: {self.message}"


@dataclass
class Verdict:
    """The outcome of one case: a status per property, and what went wrong.

    ``met[p]``: the strongest contract property ``p`` met (None: none); ``not_exact[p]``: why
    it is not exact when it met a weaker one; ``worst[p]``: the largest error in units of the
    bound (and in ulps) of the bounded comparisons; ``refusal``: the message of a refusal."""

    case: Case
    mode: ModeSpec
    impl: str
    contract: str = "exact"
    status: dict = field(default_factory=dict)
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # worker exceptions, with tracebacks
    met: dict = field(default_factory=dict)
    not_exact: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    refusal: str | None = None
    redrawn_from: Case | None = None  # the refused draw this case replaced
    refused_for: tuple = ()  # the features that draw was refused for
    after: tuple = ()  # earlier cases on the same adapter the failure needs (alone it passes)
    accepted_invalid: str | None = None  # the violation dispatch did not reject (ValueError)

    @property
    def failed(self) -> bool:
        return any(s == FAILED for s in self.status.values())

    @property
    def refused(self) -> bool:
        return any(s == REFUSED for s in self.status.values())

    @property
    def failed_properties(self) -> list[str]:
        return [p for p in PROPERTIES if self.status.get(p) == FAILED]

    def fail(self, prop, rank, output, message):
        self.status[prop] = FAILED
        self.mismatches.append(Mismatch(prop, rank, output, message))

    def report(self) -> str:
        c = self.case
        lines = [f"FAILED {', '.join(self.failed_properties)} [mode {self.mode.name}, "
                 f"impl {self.impl}, contract {self.contract}]"]
        lines += ["  " + str(m) for m in self.mismatches]
        for e in self.errors:
            lines.append(textwrap.indent(e.rstrip(), "    "))
        lines.append(
            f"  case: world {c.world_size}, experts {c.num_experts}, top-k {c.topk}, hidden "
            f"{c.hidden}, tokens {list(c.tokens)}, x {c.dtype}, expert_y {c.y_dtype}, "
            f"idx {c.idx_dtype}, routing {c.routing}, align {c.align}, capacity {c.capacity}, "
            f"{'weighted' if c.weighted else 'unweighted'}, payload {c.payload}, "
            f"NaN padding {c.nan_padding}, seed {c.seed}")
        lines.append(f"  order {c.order}, sequence {c.sequence}" + (
            ": the case and its twin (Case.twin(): the same shapes, a fresh routing) on "
            "one adapter, " + SEQUENCE_TEXT[c.sequence] + "; a failure may need the first "
            "batch (replay runs both)" if c.sequence != "single" else ""))
        if self.redrawn_from is not None:
            lines.append(f"  (redrawn without {', '.join(self.refused_for)}, which the "
                         "implementation refused)")
        if self.after:
            lines.append(f"  needs earlier cases: alone, on a fresh group, this case passes; "
                         f"after the {len(self.after)} case(s) below on the same adapter it "
                         "fails (state kept from one call to the next)")
        lines.append("  reproduce:")
        snippet = c.snippet(self.impl, self.mode.name)
        if self.contract != "exact":
            snippet = snippet[:-1] + f", contract={self.contract!r})"
        if self.after:
            snippet = snippet[:-1] + ",\n       after=[" + ",\n              ".join(
                repr(e) for e in self.after) + "])"
        lines.append(textwrap.indent(snippet, "    "))
        return "\n".join(lines)
