"""The conformance suite: hypothesis drives cases through a group, mode after mode.

For each mode, hypothesis draws ``examples`` cases (:func:`epkit.verify.strategies.cases`),
each runs on the group and is checked against the reference. The first failing case is shrunk
(within ``shrink_seconds``; cases are memoized, so hypothesis' replays cost nothing) and the
smallest one found is reported. A mode whose every property raised ``NotImplementedError`` is
reported unsupported after its first example.
"""

from __future__ import annotations

import fnmatch
import random
import time
import zlib
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

from epkit.verify.adapters import load_factory
from epkit.verify.cases import ModeSpec
from epkit.verify.check import FAILED, PASSED, PROPERTIES, SKIPPED, UNSUPPORTED, Verdict, check_case
from epkit.verify.strategies import cases

__all__ = ["DEFAULT_IMPL", "Suite", "SuiteResult", "Tally", "modes_of", "select_modes"]

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
    run: int = 0  # checked: passed + failed
    passed: int = 0
    failed: int = 0
    unsupported: int = 0
    skipped: int = 0

    def add(self, status: str):
        if status == PASSED:
            self.run += 1
            self.passed += 1
        elif status == FAILED:
            self.run += 1
            self.failed += 1
        elif status == UNSUPPORTED:
            self.unsupported += 1
        else:
            self.skipped += 1


@dataclass
class SuiteResult:
    impl: str
    world_size: int
    examples: int
    seed: int
    modes: list = field(default_factory=list)
    tallies: dict = field(default_factory=dict)  # mode name -> property -> Tally
    failures: list = field(default_factory=list)  # Verdicts (the shrunk case of each mode)
    seconds: float = 0.0
    restarts: int = 0

    @property
    def passed(self) -> int:
        return sum(t.passed for m in self.tallies.values() for t in m.values())

    @property
    def failed(self) -> int:
        return sum(t.failed for m in self.tallies.values() for t in m.values())

    @property
    def unsupported_modes(self) -> list[str]:
        return [m for m, props in self.tallies.items()
                if all(t.run == 0 and t.unsupported > 0 for t in props.values())]

    def cell(self, mode: str, prop: str) -> str:
        t = self.tallies[mode][prop]
        if t.failed:
            return f"FAILED {t.failed}/{t.run}"
        if t.run:
            return f"{t.passed}/{t.run}" + ("" if not t.unsupported else " (part unsup.)")
        if t.unsupported:
            return "unsupported"
        return "-"

    def table(self) -> str:
        """Closing table: a row per mode, a column per property; cells are passed/run."""
        head = ["mode", *PROPERTIES]
        rows = [[m.name, *(self.cell(m.name, p) for p in PROPERTIES)] for m in self.modes]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

        def line(r):
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip()

        out = [line(head), line(["-" * w for w in widths]), *map(line, rows)]
        out.append("cells: passed/run (examples checked); FAILED f/run; unsupported = the "
                   "implementation raised NotImplementedError; - = not applicable")
        return "\n".join(out)

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed"

    def to_json(self) -> dict:
        return {
            "impl": self.impl,
            "world_size": self.world_size,
            "examples": self.examples,
            "seed": self.seed,
            "seconds": round(self.seconds, 3),
            "passed": self.passed,
            "failed": self.failed,
            "pool_restarts": self.restarts,
            "results": {m: {p: vars(t) for p, t in props.items()}
                        for m, props in self.tallies.items()},
            "unsupported_modes": self.unsupported_modes,
            "failures": [{"mode": v.mode.name, "properties": v.failed_properties,
                          "case": repr(v.case), "report": v.report()} for v in self.failures],
        }


class _CaseFailed(AssertionError):
    def __init__(self, verdict: Verdict):
        super().__init__(verdict.report())
        self.verdict = verdict


class Suite:
    """Run ``examples`` hypothesis cases per mode of ``impl`` on ``runner`` (a :class:`Pool`
    or :class:`TorchrunGroup`) and tally the checks."""

    def __init__(self, runner, *, impl: str = DEFAULT_IMPL, modes=None, examples: int = 20,
                 seed: int | None = None, max_tokens: int = 24, shrink_seconds: float = 20.0,
                 reference=None, progress=None, on_failure=None, strategy_kwargs=None):
        self.runner = runner
        self.impl = impl
        self.modes = list(modes) if modes is not None else modes_of(impl)
        self.examples = int(examples)
        self.seed = random.randrange(2**31) if seed is None else int(seed)
        self.max_tokens = max_tokens
        self.shrink_seconds = shrink_seconds
        self.reference = reference
        self.progress = progress or (lambda n: None)
        self.on_failure = on_failure or (lambda v: None)
        self.strategy_kwargs = dict(strategy_kwargs or {})

    def run(self) -> SuiteResult:
        t0 = time.monotonic()
        res = SuiteResult(impl=self.impl, world_size=self.runner.world_size,
                          examples=self.examples, seed=self.seed, modes=self.modes)
        for mode in self.modes:
            tallies, failure = self.run_mode(mode)
            res.tallies[mode.name] = tallies
            if failure is not None:
                res.failures.append(failure)
                self.on_failure(failure)
        res.seconds = time.monotonic() - t0
        res.restarts = getattr(self.runner, "restarts", 0)
        return res

    def run_mode(self, mode: ModeSpec):
        tallies = {p: Tally() for p in PROPERTIES}
        memo: dict = {}
        st = {"failed_at": None, "generated": 0, "stop": False, "no_shrink": False}

        def execute(case):
            if case in memo:
                return memo[case]
            if st["failed_at"] is not None and (
                    st["no_shrink"] or time.monotonic() - st["failed_at"] > self.shrink_seconds):
                return None  # shrink budget spent: unseen cases count as passing
            results = self.runner.run(case, self.impl, mode)
            v = check_case(case, mode, results, self.impl, self.reference)
            memo[case] = v
            if any((r.get("error") or {}).get("type") in ("Timeout", "WorkerDied")
                   for r in results):
                st["no_shrink"] = True  # every shrink step could cost a timeout: report as is
            return v

        def prop(case):
            if st["stop"]:
                return
            v = execute(case)
            if v is None:
                return
            if st["failed_at"] is None and st["generated"] < self.examples:
                st["generated"] += 1
                self.progress(1)
                for p in PROPERTIES:
                    tallies[p].add(v.status.get(p, SKIPPED))
                if all(v.status.get(p) in (UNSUPPORTED, SKIPPED) for p in PROPERTIES) and \
                        any(v.status.get(p) == UNSUPPORTED for p in PROPERTIES):
                    st["stop"] = True  # nothing of this mode runs: say so once
            if v.failed:
                if st["failed_at"] is None:
                    st["failed_at"] = time.monotonic()
                raise _CaseFailed(v)

        strategy = cases(self.runner.world_size, mode, max_tokens=self.max_tokens,
                         **self.strategy_kwargs)
        test = settings(
            max_examples=self.examples,
            deadline=None,
            database=None,
            derandomize=False,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            verbosity=Verbosity.quiet,
        )(given(strategy)(prop))
        test = hypothesis_seed(self.seed ^ zlib.crc32(mode.name.encode()))(test)
        failure = None
        try:
            test()
        except _CaseFailed as exc:
            failure = exc.verdict
        self.progress(max(self.examples - st["generated"], 0))
        return tallies, failure
