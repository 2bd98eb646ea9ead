"""The conformance suite: hypothesis drives cases through a group, mode after mode.

For each mode, hypothesis draws ``examples`` cases (:func:`epkit.verify.strategies.cases`)
inside the mode's capabilities (:mod:`epkit.verify.capabilities`); each runs on the group and
is checked against the reference under the contract. A draw the implementation refuses
(``NotImplementedError`` on every rank) is redrawn without the refused feature where the refusal
can be attributed (the same case without capacity, with align 1, ...), and counted as refused;
inside what the implementation declared, a refusal is a failure. Every requested example runs:
the first failing case is shrunk (within ``shrink_seconds``, to a case failing the same
property; cases are memoized, so hypothesis' replays cost nothing) and reported, then the rest
of the examples run and are tallied. A mode that checked fewer examples than requested for a
property it applies to fails, with a line saying why.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import random
import time
import zlib
from dataclasses import dataclass, field
from xml.sax.saxutils import quoteattr

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

from .accumulate import describe_accumulate, parse_accumulate
from .adapters import load_factory
from .capabilities import FEATURES, declarations, resolve_capabilities
from .cases import ModeSpec
from .checks import check_case
from .strategies import cases, corner_cases
from .verdict import (ACCEPTED, CONTRACTS, FAILED, NA, PASSED, PROPERTIES, REFUSED, SKIPPED,
                      Mismatch, Verdict, weaker)

__all__ = ["DEFAULT_IMPL", "ModeResult", "Suite", "SuiteResult", "Tally", "modes_of",
           "select_modes"]

DEFAULT_IMPL = "epkit.verify.adapters:epkit_factory"


def modes_of(impl: str) -> list[ModeSpec]:
    """The modes an implementation offers (its factory's ``modes``, else one ``default``)."""
    modes = getattr(load_factory(impl), "modes", None)
    return list(modes) if modes else [ModeSpec()]


def select_modes(modes: list[ModeSpec], patterns) -> list[ModeSpec]:
    """Keep the modes whose name matches one of the (comma-separated) fnmatch ``patterns``."""
    if not patterns:
        return list(modes)
    if isinstance(patterns, str):
        patterns = [patterns]
    pats = [p.strip() for spec in patterns for p in spec.split(",") if p.strip()]
    return [m for m in modes if any(fnmatch.fnmatchcase(m.name, p) for p in pats)]


@dataclass
class Tally:
    """One property of one mode: ``requested`` examples it applies to, ``checked`` of them
    (``passed`` + ``failed``), ``refused`` ones (with their reasons) and ``unchecked`` others
    (not run after a timeout, or skipped)."""

    requested: int = 0
    checked: int = 0
    passed: int = 0
    failed: int = 0
    refused: int = 0
    accepted: int = 0  # invalid inputs taken without a ValueError (checked, neither way)
    reasons: collections.Counter = field(default_factory=collections.Counter)  # refusals
    unrun: collections.Counter = field(default_factory=collections.Counter)  # other reasons

    @property
    def run(self) -> int:  # the former name of ``checked``
        return self.checked

    @property
    def unchecked(self) -> int:
        return self.requested - self.checked

    def add(self, status: str, reason: str | None = None):
        if status == NA:
            return
        self.requested += 1
        if status in (PASSED, FAILED, ACCEPTED):
            self.checked += 1
            self.passed += status == PASSED
            self.failed += status == FAILED
            self.accepted += status == ACCEPTED
        elif status == REFUSED:
            self.refused += 1
            self.reasons[reason or "NotImplementedError"] += 1
        else:
            self.unrun[reason or "skipped"] += 1

    def to_json(self) -> dict:
        return {"requested": self.requested, "checked": self.checked, "passed": self.passed,
                "failed": self.failed, "accepted_invalid": self.accepted,
                "refused": self.refused, "reasons": dict(self.reasons),
                "not_checked": dict(self.unrun)}


@dataclass
class ModeResult:
    """Everything the closing table says about one mode."""

    mode: ModeSpec
    capabilities: object = None
    tallies: dict = field(default_factory=lambda: {p: Tally() for p in PROPERTIES})
    met: str | None = "exact"  # the strongest contract every checked example met
    not_exact: collections.Counter = field(default_factory=collections.Counter)
    worst: dict = field(default_factory=dict)  # property -> (bound units, ulps)
    redrawn: collections.Counter = field(default_factory=collections.Counter)  # features
    refused_cases: dict = field(default_factory=dict)  # feature key -> refused draws
    world_sizes: collections.Counter = field(default_factory=collections.Counter)  # checked
    corners: int = 0  # corner cases run before the random draws
    first_failed_at: int | None = None  # the example (1-based, corners first) that failed first
    check_errors: bool = False
    accumulate: str = "float32"
    failure: Verdict | None = None
    later_failures: int = 0  # failing examples after the reported (shrunk) one
    # invalid inputs dispatch took without raising ValueError on every rank, by kind
    accepted_invalid: collections.Counter = field(default_factory=collections.Counter)

    def count(self, v: Verdict):
        if _accepts_only(v):
            self.accepted_invalid[v.accepted_invalid] += 1
        for p in PROPERTIES:
            status = v.status.get(p, SKIPPED)
            if p == "dispatch" and status == FAILED and _accepts_only(v):
                status = ACCEPTED
            self.tallies[p].add(status, v.refusal)
        for p, level in v.met.items():
            self.met = weaker(self.met, level)
        for p, why in v.not_exact.items():
            self.not_exact[why] += 1
        for p, w in v.worst.items():
            self.worst[p] = max(self.worst.get(p, (0.0, 0.0)), w)
        if v.refused_for:
            self.redrawn["+".join(v.refused_for)] += 1
            for k in v.refused_for:
                self.refused_cases.setdefault(k, []).append(v.redrawn_from)
        if any(v.status.get(p) in (PASSED, FAILED) for p in PROPERTIES):
            self.world_sizes[v.case.world_size] += 1

    def not_run(self, n: int, reason: str):
        for p in PROPERTIES:
            for _ in range(n):
                self.tallies[p].add(SKIPPED, reason)

    @property
    def problem(self) -> str | None:
        """Why the mode fails although no check failed: too few examples checked."""
        short = [(t.checked, p, t) for p, t in self.tallies.items() if t.unchecked > 0]
        if not short:
            return None
        _, p, t = min(short, key=lambda x: (x[0], PROPERTIES.index(x[1])))
        why = [f"{n} refused ({r})" for r, n in t.reasons.most_common(3)]
        why += [f"{n} {r}" for r, n in t.unrun.most_common(3)]
        return f"only {t.checked} of {t.requested} examples checked for {p}: {', '.join(why)}"

    @property
    def ok(self) -> bool:
        return self.failure is None and self.problem is None and not any(
            t.failed or t.accepted for t in self.tallies.values())


def _accepts_only(v: Verdict) -> bool:
    """Is ``v``'s only failure an invalid input that dispatch took (no input validation)?"""
    return bool(v.accepted_invalid) and v.failed_properties == ["dispatch"]


@dataclass
class SuiteResult:
    impl: str
    world_size: int
    examples: int
    seed: int
    contract: str = "exact"
    accumulate: str = "float32"
    check_errors: bool | None = None
    modes: list = field(default_factory=list)
    results: dict = field(default_factory=dict)  # mode name -> ModeResult
    seconds: float = 0.0
    restarts: int = 0
    kernels: str = ""  # which of epkit's kernels served (verify/kernels.py)

    @property
    def tallies(self) -> dict:
        return {m: r.tallies for m, r in self.results.items()}

    @property
    def failures(self) -> list:
        return [r.failure for r in self.results.values() if r.failure is not None]

    @property
    def passed(self) -> int:
        return sum(t.passed for m in self.tallies.values() for t in m.values())

    @property
    def failed(self) -> int:
        """Failed checks (invalid inputs accepted included), plus requested checks that were
        never made (refused, not run)."""
        return sum(t.failed + t.accepted + t.unchecked for m in self.tallies.values()
                   for t in m.values())

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results.values())

    @property
    def world_sizes_checked(self) -> list[int]:
        """The world sizes of the cases that were run and checked, over every mode."""
        return sorted({n for r in self.results.values() for n in r.world_sizes})

    @property
    def unsupported_modes(self) -> list[str]:
        return [m for m, props in self.tallies.items()
                if all(t.checked == 0 and t.refused > 0 for t in props.values()
                       if t.requested)]

    def cell(self, mode: str, prop: str) -> str:
        t = self.tallies[mode][prop]
        invalid = f" +{t.accepted} INVALID" if t.accepted else ""
        if t.failed:
            return f"FAILED {t.failed}/{t.requested}{invalid}"
        if t.accepted:
            return f"{t.checked}/{t.requested}{invalid}"
        if t.unchecked:
            return f"{t.checked}/{t.requested} SHORT"
        if t.requested:
            return f"{t.checked}/{t.requested}"
        return "-"

    def met(self, mode: str) -> str:
        r = self.results[mode]
        if not any(t.checked for t in r.tallies.values()):
            return "-"
        return r.met or "none"

    def table(self) -> str:
        """Closing table: a row per mode, a column per property (checked/requested) and the
        contract the mode meets; then a line per mode that needs one."""
        head = ["mode", *PROPERTIES, "meets"]
        rows = [[m.name, *(self.cell(m.name, p) for p in PROPERTIES), self.met(m.name)]
                for m in self.modes]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

        def line(r):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip()

        out = [line(head), line(["-" * w for w in widths]), *map(line, rows)]
        out.append(f"cells: checked/requested examples, corner cases included (contract "
                   f"{self.contract}); FAILED "
                   "f/requested; SHORT = fewer checked than requested (a failure); - = not "
                   "applicable; meets: the strongest contract every example met")
        if any(r.accepted_invalid for r in self.results.values()):
            out.append("+n INVALID: n invalid inputs that dispatch took without raising "
                       "ValueError on every rank (a failure, apart from wrong answers on valid "
                       "inputs: FAILED)")
        out += self.notes()
        return "\n".join(out)

    def notes(self) -> list[str]:
        lines = []
        for m in self.modes:
            r = self.results[m.name]
            if r.problem:
                lines.append(f"{m.name}: FAILED: {r.problem}")
            if r.later_failures:
                lines.append(f"{m.name}: {r.later_failures} more failing examples after the "
                             "reported one")
            if r.accepted_invalid:
                n = sum(r.accepted_invalid.values())
                wrong = sum(t.failed for t in r.tallies.values())
                lines.append(f"{m.name}: FAILED: accepts invalid inputs (no input validation): "
                             f"{n} invalid-input cases returned without raising ValueError on "
                             "every rank (" + ", ".join(
                                 k.replace("_", " ") for k, _ in r.accepted_invalid.most_common())
                             + "); apart from these, "
                             + (f"{wrong} failed checks on valid inputs" if wrong else
                                "no failure on valid inputs"))
            met = self.met(m.name)
            if met in ("reordered", "bounded"):
                lines.append(f"{m.name}: meets {met}; not exact: "
                             + ", ".join(w for w, _ in r.not_exact.most_common()))
            if r.redrawn:
                what = ", ".join(f"{n} ({f})" for f, n in r.redrawn.most_common())
                decls = declarations(r.refused_cases)
                hint = ("; to draw only inside, declare " + " ".join(
                    f"--supports {d}" for d in decls)) if decls else ""
                lines.append(f"{m.name}: refused draws redrawn without the feature: {what}"
                             + hint)
            if self.contract == "bounded" and r.worst:
                lines.append(f"{m.name}: largest error, in bounds (ulps): " + ", ".join(
                    f"{p} {w[0]:.2g} ({w[1]:.2g})" for p, w in r.worst.items()))
        return lines

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed"

    def to_json(self) -> dict:
        return {
            "impl": self.impl,
            "world_size": self.world_size,
            "examples": self.examples,
            "seed": self.seed,
            "contract": self.contract,
            "accumulate": self.accumulate,
            "check_errors": self.check_errors,
            "world_sizes_checked": self.world_sizes_checked,
            "seconds": round(self.seconds, 3),
            "kernels": self.kernels,
            "passed": self.passed,
            "failed": self.failed,
            "ok": self.ok,
            "pool_restarts": self.restarts,
            "results": {m: {p: t.to_json() for p, t in props.items()}
                        for m, props in self.tallies.items()},
            "modes": {m: {"meets": self.met(m), "problem": r.problem,
                          "accepted_invalid": dict(r.accepted_invalid),
                          "capabilities": r.capabilities.describe() if r.capabilities else None,
                          "accumulate": r.accumulate, "check_errors": r.check_errors,
                          "corner_cases": r.corners, "first_failed_at": r.first_failed_at,
                          "world_sizes_checked": dict(sorted(r.world_sizes.items())),
                          "not_exact": dict(r.not_exact), "redrawn": dict(r.redrawn),
                          "worst": {p: list(w) for p, w in r.worst.items()}}
                      for m, r in self.results.items()},
            "unsupported_modes": self.unsupported_modes,
            "failures": [{"mode": v.mode.name, "properties": v.failed_properties,
                          "case": repr(v.case), "report": v.report()} for v in self.failures],
        }

    def junit_xml(self) -> str:
        """JUnit XML: one test case per mode and property."""
        cases_xml, n_fail, n_skip = [], 0, 0
        for m in self.modes:
            r = self.results[m.name]
            for p in PROPERTIES:
                t = r.tallies[p]
                body = ""
                if t.failed or t.accepted or (r.failure is not None
                                              and p in r.failure.failed_properties):
                    n_fail += 1
                    text = r.failure.report() if r.failure is not None else ""
                    what = f"{t.failed} of {t.requested} failed" + (
                        f", {t.accepted} invalid inputs accepted" if t.accepted else "")
                    body = (f"<failure message={quoteattr(what)}>"
                            f"{_xml_text(text)}</failure>")
                elif t.unchecked:
                    n_fail += 1
                    body = f"<failure message={quoteattr(r.problem or 'not checked')}/>"
                elif not t.requested:
                    n_skip += 1
                    body = "<skipped message=\"not applicable\"/>"
                cases_xml.append(f"  <testcase classname={quoteattr('epkit.verify.' + m.name)} "
                                 f"name={quoteattr(p)} time=\"0\">{body}</testcase>")
        head = (f"<testsuite name=\"epkit verify\" tests=\"{len(cases_xml)}\" "
                f"failures=\"{n_fail}\" errors=\"0\" skipped=\"{n_skip}\" "
                f"time=\"{self.seconds:.3f}\">")
        caps = sorted({r.capabilities.describe() for r in self.results.values()
                       if r.capabilities is not None})
        recorded = [("impl", self.impl), ("seed", self.seed), ("contract", self.contract),
                    ("accumulate", self.accumulate), ("capabilities", " | ".join(caps)),
                    ("check_errors", self.check_errors), ("world_size", self.world_size),
                    ("world_sizes_checked", ",".join(map(str, self.world_sizes_checked))),
                    ("examples", self.examples), ("kernels", self.kernels),
                    ("corner_cases", max((r.corners for r in self.results.values()),
                                         default=0))]
        props = "  <properties>" + "".join(
            f"<property name={quoteattr(k)} value={quoteattr(str(v))}/>" for k, v in recorded
        ) + "</properties>"
        return "\n".join(['<?xml version="1.0" encoding="utf-8"?>', head, props, *cases_xml,
                          "</testsuite>", ""])


def _xml_text(text: str) -> str:
    from xml.sax.saxutils import escape

    return escape(text)


class _private_hypothesis_home:
    """Hypothesis keeps a cache (``.hypothesis/constants``) under its home directory, the
    current directory by default, even with ``database=None``: a run writes nothing there.
    Inside, the home is a private temporary directory unless the user chose one
    (``HYPOTHESIS_STORAGE_DIRECTORY``)."""

    def __enter__(self):
        import os
        import tempfile

        from hypothesis import configuration

        self.saved = getattr(configuration, "__hypothesis_home_directory", None)
        self.tmp = None
        if self.saved is None and not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
            self.tmp = tempfile.TemporaryDirectory(prefix="epkit-verify-hypothesis-")
            configuration.set_hypothesis_home_dir(self.tmp.name)
        return self

    def __exit__(self, *exc):
        from hypothesis import configuration

        if self.tmp is not None:
            configuration.set_hypothesis_home_dir(self.saved)
            self.tmp.cleanup()


class _CaseFailed(AssertionError):
    def __init__(self, verdict: Verdict):
        super().__init__(verdict.report())
        self.verdict = verdict


class Suite:
    """Run ``examples`` hypothesis cases per mode of ``impl`` on ``runner`` (a :class:`Pool`
    or :class:`TorchrunGroup`) under ``contract`` and tally the checks. ``supports``: the
    command line's capability declarations (``["capacity=no", ...]`` or a dict);
    ``accumulate``: the accumulation declaration (:mod:`epkit.verify.accumulate`), over the
    capabilities' one; ``check_errors``: draw invalid inputs (None: as the capabilities say);
    ``corners``: run the corner matrix (:func:`~epkit.verify.strategies.corner_cases`; or
    these cases, a list) before
    the ``examples`` random draws of each mode; ``on_mode(mode, ModeResult)``: called as each
    mode finishes (after ``on_failure``); ``count_overflow``: the count-overflow corner in
    ``every`` mode without a quantized payload, or ``once``, in the first of them (for
    Triton's interpreter, where it takes tens of seconds)."""

    def __init__(self, runner, *, impl: str = DEFAULT_IMPL, modes=None, examples: int = 20,
                 seed: int | None = None, max_tokens: int = 24, max_hidden: int = 72,
                 shrink_seconds: float = 20.0,
                 reference=None, progress=None, on_failure=None, strategy_kwargs=None,
                 contract: str = "exact", accumulate: str | None = None, supports=None,
                 check_errors: bool | None = None, corners: bool = True, on_mode=None,
                 count_overflow: str = "every"):
        if contract not in CONTRACTS:
            raise ValueError(f"contract must be one of {', '.join(CONTRACTS)}")
        parse_accumulate(accumulate)  # a bad declaration is a ValueError here, not later
        self.check_errors = check_errors
        self.corners = corners
        if count_overflow not in ("every", "once"):
            raise ValueError("count_overflow must be 'every' or 'once'")
        self.count_overflow = count_overflow
        self.runner = runner
        self.impl = impl
        self.modes = list(modes) if modes is not None else modes_of(impl)
        self.examples = int(examples)
        self.seed = random.randrange(2**31) if seed is None else int(seed)
        self.max_tokens = max_tokens
        self.max_hidden = max_hidden
        self.shrink_seconds = shrink_seconds
        self.reference = reference
        self.progress = progress or (lambda n: None)
        self.on_failure = on_failure or (lambda v: None)
        self.on_mode = on_mode or (lambda mode, result: None)
        self.strategy_kwargs = dict(strategy_kwargs or {})
        self.contract = contract
        self.accumulate = accumulate
        self.supports = supports
        factory = load_factory(impl)
        self.capabilities = {m.name: resolve_capabilities(factory, m, supports)
                             for m in self.modes}

    def run(self) -> SuiteResult:
        t0 = time.monotonic()
        caps0 = next(iter(self.capabilities.values()), None)
        res = SuiteResult(impl=self.impl, world_size=self.runner.world_size,
                          examples=self.examples, seed=self.seed, modes=self.modes,
                          contract=self.contract, accumulate=self.accumulate_of(caps0),
                          check_errors=self.check_errors)
        with _private_hypothesis_home():
            for mode in self.modes:
                mr = self.run_mode(mode)
                res.results[mode.name] = mr
                if mr.failure is not None:
                    self.on_failure(mr.failure)
                self.on_mode(mode, mr)
        res.check_errors = any(r.check_errors for r in res.results.values())
        res.seconds = time.monotonic() - t0
        res.restarts = getattr(self.runner, "restarts", 0)
        return res

    def accumulate_of(self, caps) -> str:
        """The accumulation declaration a mode runs under, as text (``float32``, ``native``,
        per dtype)."""
        spec = self.accumulate or getattr(caps, "accumulate", None)
        return describe_accumulate(parse_accumulate(spec))

    def count_overflow_in(self, mode: ModeSpec) -> bool:
        """Does ``mode``'s corner matrix hold the count-overflow corner?"""
        if self.count_overflow == "every":
            return True
        return mode == next((m for m in self.modes if m.payload is None), None)

    def corner_cases(self, mode: ModeSpec) -> list:
        """``mode``'s corner matrix: the cases given as ``corners``, else the matrix of
        :func:`~epkit.verify.strategies.corner_cases`."""
        if isinstance(self.corners, (list, tuple)):
            return list(self.corners)
        caps = self.capabilities.get(mode.name) or resolve_capabilities(
            load_factory(self.impl), mode, self.supports)
        return corner_cases(self.runner.world_size, mode, caps, max_tokens=self.max_tokens,
                            check_errors=self.checks_errors(caps),
                            count_overflow=self.count_overflow_in(mode))

    def checks_errors(self, caps) -> bool:
        if self.check_errors is not None:
            return bool(self.check_errors)
        return getattr(caps, "check_errors", None) is True

    # -- one mode --------------------------------------------------------------------------
    def run_mode(self, mode: ModeSpec) -> ModeResult:
        """One mode's property run (a :class:`_ModeRun`): the requested examples, the first
        failure shrunk, the rest drawn afresh and tallied."""
        caps = self.capabilities.get(mode.name) or resolve_capabilities(
            load_factory(self.impl), mode, self.supports)
        return _ModeRun(self, mode, caps).run()

    @staticmethod
    def _hypothesis(strategy, fn, examples, seed, phases):
        test = settings(
            max_examples=max(examples, 1),
            deadline=None,
            database=None,
            derandomize=False,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            verbosity=Verbosity.quiet,
        )(given(strategy)(fn))
        return hypothesis_seed(seed)(test)


class _ModeRun:
    """The state of one mode's run: the verdicts so far (``checked``: one case run and
    checked; ``evaluated``: after a refusal was attributed to a feature), the features
    refusals were attributed to, and where the run stands (first failure, examples drawn,
    whether a hang forbids shrinking)."""

    def __init__(self, verifier, mode: ModeSpec, caps):
        self.vr, self.mode, self.caps = verifier, mode, caps
        self.mr = ModeResult(mode=mode, capabilities=caps,
                             check_errors=verifier.checks_errors(caps),
                             accumulate=verifier.accumulate_of(caps))
        self.checked: dict = {}
        self.evaluated: dict = {}
        self.known: list = []
        self.failed_at = None
        self.primary = None
        self.generated = 0
        self.no_shrink = False
        self.timeout = float(getattr(verifier.runner, "timeout", 30.0))
        self.target = verifier.examples  # examples to tally: the corners, then the draws
        # the cases each adapter (one per group size and factory arguments, as the workers
        # cache them) ran since the group started, and what ran before each case
        self.history: dict = {}
        self.before: dict = {}
        self.restarts = getattr(verifier.runner, "restarts", 0)
        self.first_invalid = None  # the first invalid input accepted (reported if alone)

    def run_corners(self, errors: bool) -> Verdict | None:
        """Run and tally the corner matrix; the first failing corner's verdict (not shrunk:
        corners are small already), later failing ones counted."""
        vr, mr = self.vr, self.mr
        corners = vr.corner_cases(self.mode)
        mr.corners = len(corners)
        self.target = len(corners) + vr.examples
        first = None
        for case in corners:
            if self.no_shrink:
                break
            v = self.evaluate(case)
            self.tally(v)
            if self.secondary(v):
                continue
            if v.failed:
                if first is None:
                    first = v
                else:
                    mr.later_failures += 1
        return first

    def secondary(self, v: Verdict) -> bool:
        """An invalid input taken without a ValueError (only that) is tallied apart and
        reported only where no valid input failed: it neither shrinks nor hides a wrong
        answer."""
        if not _accepts_only(v):
            return False
        self.first_invalid = self.first_invalid or v
        return True

    def run(self) -> ModeResult:
        vr, mr = self.vr, self.mr
        errors = mr.check_errors
        corner_failure = self.run_corners(errors) if vr.corners else None
        kw = {"max_hidden": vr.max_hidden, **vr.strategy_kwargs}
        strategy = cases(vr.runner.world_size, self.mode, max_tokens=vr.max_tokens,
                         capabilities=self.caps, check_errors=errors, **kw)
        base_seed = vr.seed ^ zlib.crc32(self.mode.name.encode())
        if not self.no_shrink and vr.examples:
            try:
                vr._hypothesis(strategy, self.prop, vr.examples, base_seed,
                               [Phase.explicit, Phase.generate, Phase.shrink])()
            except _CaseFailed as exc:
                mr.failure = exc.verdict
        if corner_failure is not None:
            if mr.failure is None:  # the corner's report (random draws did not fail)
                mr.failure = corner_failure
            else:  # the shrunk random failure is reported; the corner counts as one more
                mr.later_failures += 1
        if mr.failure is not None:
            mr.failure = self.needs_earlier(mr.failure, max(vr.shrink_seconds, 10.0))
        # Every requested example runs: after a failure (shrunk and reported above), the rest
        # are drawn afresh and tallied without shrinking.
        for attempt in range(1, 4):
            left = self.target - self.generated
            if left <= 0 or self.no_shrink:
                break
            vr._hypothesis(strategy, self.rest, left, base_seed ^ (0x9E3779B1 * attempt),
                           [Phase.generate])()
        left = self.target - self.generated
        if left > 0:
            mr.not_run(left, "not run (the implementation hung)" if self.no_shrink
                       else "not drawn")
            vr.progress(left)
        if mr.failure is None and self.first_invalid is not None:
            mr.failure = self.first_invalid  # no wrong answer: the invalid input's report
        return mr

    def run_check(self, case) -> Verdict:
        """Run ``case`` on the group and check it (once per case)."""
        if case in self.checked:
            return self.checked[case]
        vr = self.vr
        t0 = time.monotonic()
        results = self._run_on_adapter(case)
        took = time.monotonic() - t0
        try:
            self.checked[case] = check_case(case, self.mode, results, vr.impl, vr.reference,
                                            contract=vr.contract, capabilities=self.caps,
                                            accumulate=vr.accumulate)
        except Exception as exc:  # noqa: BLE001 - outputs the checks cannot read
            import traceback

            v = Verdict(case=case, mode=self.mode, impl=vr.impl, contract=vr.contract)
            for p in PROPERTIES:
                v.fail(p, None, "outputs", f"could not be compared ({type(exc).__name__}"
                       f": {exc})")
                v.met[p] = None
            v.errors.append(traceback.format_exc(limit=-4))
            self.checked[case] = v
        if took >= self.timeout and any(
                (r.get("error") or {}).get("type") in ("Timeout", "WorkerDied")
                for r in results):
            self.no_shrink = True  # a hang: every further case could cost a timeout
        return self.checked[case]

    def _adapter_key(self, case):
        mode = self.mode
        return (case.world_size, case.max_tokens if mode.static else None,
                case.ranks_per_node if mode.nodes else None)

    def _run_on_adapter(self, case):
        """Run ``case`` on the group, keeping the history of its adapter."""
        runner = self.vr.runner
        if getattr(runner, "restarts", 0) != self.restarts:  # fresh workers, fresh adapters
            self.history.clear()
        ran = self.history.setdefault(self._adapter_key(case), [])
        self.before.setdefault(case, tuple(ran))
        results = runner.run(case, self.vr.impl, self.mode)
        ran.append(case)
        self.restarts = getattr(runner, "restarts", 0)
        return results

    def needs_earlier(self, v: Verdict, budget_s: float) -> Verdict:
        """A failure whose case ran after others on its adapter: run it alone on a fresh
        group; if it passes there, find earlier cases it needs (the latest one alone first,
        within ``budget_s``, else all of them) and say so in the verdict (``after``)."""
        runner, vr = self.vr.runner, self.vr
        before = self.before.get(v.case, ())
        if not before or not hasattr(runner, "restart") or self.no_shrink:
            return v

        def fails(after) -> bool:
            runner.restart()
            for earlier in after:
                runner.run(earlier, vr.impl, self.mode)
            again = check_case(v.case, self.mode, runner.run(v.case, vr.impl, self.mode),
                               vr.impl, vr.reference, contract=vr.contract,
                               capabilities=self.caps, accumulate=vr.accumulate)
            return again.failed

        if fails(()):
            return v
        t0, after = time.monotonic(), before
        for earlier in reversed(before):
            if time.monotonic() - t0 > budget_s:
                break
            if fails((earlier,)):
                after = (earlier,)
                break
        runner.restart()
        self.history.clear()
        return dataclasses.replace(v, after=after)

    def attribute(self, case, v, v2, keys) -> Verdict:
        """A refusal that goes away without the features ``keys``: the verdict of the case
        without them, unless the implementation declared them supported (then a failure)."""
        caps = self.caps
        declared = [k for k in keys if caps.declared(k, case)]
        if not declared:
            return dataclasses.replace(v2, redrawn_from=case, refused_for=tuple(keys))
        vf = dataclasses.replace(v, status=dict(v.status), mismatches=list(v.mismatches))
        for p in PROPERTIES:
            if vf.status.get(p) == REFUSED:
                vf.status[p] = FAILED
        vf.mismatches.append(Mismatch(
            "dispatch", None, "refusal", f"{v.refusal}: refused although declared "
            f"supported ({', '.join(f'{k}: {getattr(caps, k)!r}' for k in declared)}); "
            f"without {'+'.join(keys)} the case runs"))
        return vf

    def _without_refused(self, case, v):
        """The features whose removal makes a refused case run: ``(case', keys)`` or None.

        One feature at a time, the likeliest first (named in the refusal's message, or
        refused before); where removing one leaves the case refused for something else (the
        next refusal in the implementation's order), that removal is kept and the search goes
        on from there, guided by the new message. Removing weighted, unweighted or an index
        dtype turns on the other one, so such a removal is kept only where the message names
        it: the redraw never trips a feature it did not need to change."""
        c, keys, refusal = case, [], v.refusal
        for _ in range(len(FEATURES)):
            words = (refusal or "").lower()

            def likely(f):
                return f.key in self.known or any(w in words for w in f.words)

            present = [f for f in FEATURES if f.key not in keys and f.present(c)]
            step = None
            for f in sorted(present, key=lambda f: (not likely(f), f.flip)):
                c2 = f.remove(c)
                if c2 == c:
                    continue
                v2 = self.run_check(c2)
                if not v2.refused:
                    return c2, tuple(keys + [f.key])
                if v2.refusal != refusal and (likely(f) or not f.flip):
                    step = (c2, f.key, v2.refusal)
                    break
            if step is None:
                return None
            c, keys, refusal = step[0], keys + [step[1]], step[2]
        return None

    def evaluate(self, case) -> Verdict:
        if case in self.evaluated:
            return self.evaluated[case]
        v = self.run_check(case)
        if v.refused and not self.no_shrink:
            found = self._without_refused(case, v)
            if found is not None:
                self.known.extend(k for k in found[1] if k not in self.known)
                v = self.attribute(case, v, self.checked[found[0]], found[1])
        self.evaluated[case] = v
        return v

    def tally(self, v):
        self.generated += 1
        self.vr.progress(1)
        self.mr.count(v)
        if v.failed and self.mr.first_failed_at is None:
            self.mr.first_failed_at = self.generated

    def prop(self, case):
        """The hypothesis property: raises _CaseFailed on a failure of the first failing
        property (so hypothesis shrinks towards it), within the shrink budget."""
        vr = self.vr
        if case not in self.evaluated:
            if self.failed_at is not None and (
                    self.no_shrink or time.monotonic() - self.failed_at > vr.shrink_seconds):
                return  # shrink budget spent: unseen cases count as passing
            if self.no_shrink:
                return  # a timeout: the rest is reported as not run
        v = self.evaluate(case)
        if self.failed_at is None and self.generated < self.target:
            self.tally(v)
        if self.secondary(v):
            return
        if v.failed:
            if self.failed_at is None:
                self.failed_at = time.monotonic()
                self.primary = v.failed_properties[0] if v.failed_properties else None
            if self.primary is None or self.primary in v.failed_properties:
                raise _CaseFailed(v)

    def rest(self, case):
        """After the failure: further draws, tallied, not shrunk."""
        if self.generated >= self.target or self.no_shrink:
            return
        v = self.evaluate(case)
        self.tally(v)
        if v.failed and not self.secondary(v):
            self.mr.later_failures += 1
