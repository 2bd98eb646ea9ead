"""The docs agree with each other and with the code, where a rule has one source in the code.

- No file of the repository points outside it: a clone has nothing there (``../`` paths and
  relative Markdown links resolve inside the repository, to a file that exists).
- The reason table of docs/semantics.md ("Errors") states, for every code, the name and the
  message that reference/errors.py gives: a message of the table is the code's with its
  details (``{a}``, ``{dtype a}``, ``(...)``) left open.
- A sentence that states which dtypes ``x``, ``expert_y`` or ``topk_weights`` take ("`x` is
  float32 or bfloat16", "`topk_weights` float32 only", a table row ``| `x` | `[T, H]` |
  float32 or bfloat16``) names the set the validation accepts (reference/dtypes.py,
  reference/validate.py), in every document.
- An option's default in docs/usage.md's option table is the signature's, and no document says
  production lacks an option that ``epkit.Dispatcher`` takes.
- A duration quoted for a timed command (DURATIONS) is no older, in git, than the command's
  source: a change to the command asks for a new measurement.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess

import pytest

from doc_outputs import DOCS, ROOT

SKIP_DIRS = {".venv", ".git", "build", "epkit.egg-info", "__pycache__", ".pytest_cache"}
SOURCE_EXT = (".md", ".py", ".toml", ".sh", ".cpp", ".h", ".cfg", ".txt", ".yml", ".yaml")


def _files():
    for base, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for f in files:
            if f.endswith(SOURCE_EXT) or f == "Makefile":
                yield os.path.relpath(os.path.join(base, f), ROOT)
    yield ".ci/run"


def outside_paths(rel: str, text: str) -> list[str]:
    """The paths ``text`` (the file ``rel`` under ROOT) points to that lie outside ROOT, or, for
    a Markdown link, that do not exist."""
    here = os.path.dirname(os.path.join(ROOT, rel))
    bad = []
    for m in re.finditer(r"(?<![\w/.])((?:\.\./)+[\w.\-]+(?:/[\w.\-]+)*)", text):
        # relative to the file or to the repository's root: inside it, and there, from either
        paths = [os.path.normpath(os.path.join(base, m.group(1))) for base in (here, ROOT)]
        if not any((p + os.sep).startswith(ROOT + os.sep) and os.path.exists(p) for p in paths):
            bad.append(m.group(1))
    if rel.endswith(".md"):
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path = os.path.normpath(os.path.join(here, target))
            if not (path + os.sep).startswith(ROOT + os.sep) or not os.path.exists(path):
                bad.append(target)
    return bad


def test_nothing_points_outside_the_repository():
    bad = {}
    for rel in _files():
        with open(os.path.join(ROOT, rel), errors="replace") as f:
            found = outside_paths(rel, f.read())
        if found:
            bad[rel] = found
    assert not bad, f"paths outside the repository (a clone has no such file): {bad}"


def test_outside_paths_are_seen():
    """The check itself: it finds the citation issue 36 found."""
    up = ".." + "/"  # (not written whole: this file would cite it)
    assert outside_paths("docs/design.md", f"the decisions `{up}shared/design/semantics.md` left") == [
        f"{up}shared/design/semantics.md"]
    assert outside_paths("docs/usage.md", f"[example]({up}examples/train_moe.py)") == []
    assert outside_paths("docs/usage.md", "[gone](nowhere.md)") == ["nowhere.md"]


# ---- the reason table against reference/errors.py -------------------------------------------

def _table_rows(doc: str):
    """``(code, name, text)`` of every row of the reason tables of ``doc``."""
    text = open(os.path.join(ROOT, doc)).read()
    for m in re.finditer(r"^\| (\d+) \| `(\w+)` \| (.*?) \| .*\|$", text, re.M):
        yield int(m.group(1)), m.group(2), m.group(3)


def _pattern(text: str) -> re.Pattern:
    """A table message as a pattern: ``{...}`` and ``(...)`` stand for any text."""
    parts = re.split(r"\{[^}]*\}|\(\.\.\.\)", text.replace("\\|", "|"))
    return re.compile(".*?".join(re.escape(p) for p in parts), re.S)


DETAILS = [(0, 0), (1, 1), (2, 3), (3, 2), (4, 4), (5, 5), (6, 6), (-1, -1), (9, 8), (255, 255)]


def table_disagreements(doc: str) -> list[str]:
    from epkit.reference.errors import Reason, format_reason

    bad = []
    for code, name, text in _table_rows(doc):
        if name not in Reason.__members__:
            bad.append(f"{code} {name}: no such reason in reference/errors.py")
            continue
        if Reason[name].value != code:
            bad.append(f"{name}: the table says code {code}, the code says {Reason[name].value}")
            continue
        pat = _pattern(text)
        said = [format_reason(code, a, b) for a, b in DETAILS]
        if not any(pat.fullmatch(s) for s in said):
            bad.append(f"{code} {name}: the table says {text!r}, the code says {said[2]!r}")
    return bad


def test_reason_table_is_the_codes():
    rows = list(_table_rows("docs/semantics.md"))
    assert len(rows) > 40, "the reason table was not found"
    assert table_disagreements("docs/semantics.md") == []


def test_reason_table_check_sees_a_planted_rule(tmp_path, monkeypatch):
    """Issue 36: the table said topk_weights must be float32 while the code takes three."""
    planted = tmp_path / "docs" / "x.md"
    planted.parent.mkdir()
    planted.write_text("| 19 | `WEIGHTS_DTYPE` | topk_weights must be float32, got {dtype a} | |\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    assert len(table_disagreements("docs/x.md")) == 1


# ---- dtype rules against the validation ------------------------------------------------------

DTYPE = r"(?:float32|bfloat16|float16|float64|int8|int16|int32|int64|uint8)"
LIST = rf"{DTYPE}(?:(?:, | or | and |, or ){DTYPE})*"


def accepted() -> dict[str, set[str]]:
    """What the validation accepts, by argument: reference/dtypes.py, reference/validate.py."""
    from epkit.reference.dtypes import FLOAT_DTYPES
    from epkit.reference.validate import WEIGHT_DTYPES

    names = lambda ds: {str(d) for d in ds}  # noqa: E731
    return {"x": names(FLOAT_DTYPES), "expert_y": names(FLOAT_DTYPES),
            "topk_weights": names(WEIGHT_DTYPES)}


def dtype_rules(text: str) -> list[tuple[str, set[str], str]]:
    """``(argument, dtypes, the words)`` of every dtype rule ``text`` states: "`x` is float32
    or bfloat16", "`topk_weights` must be float32", "`topk_weights` float32 only", and a table
    row whose first cell is the argument and whose third begins with the list."""
    out = []
    args = "|".join(accepted())
    for m in re.finditer(rf"`({args})` (?:(?:is|must be) (?P<l1>{LIST})|(?P<l2>{LIST}) only)", text):
        out.append((m.group(1), set(re.findall(DTYPE, m.group("l1") or m.group("l2"))), m.group(0)))
    for m in re.finditer(rf"^\| `({args})` \| `\[[^]]*\]` \| (?P<l>{LIST})", text, re.M):
        out.append((m.group(1), set(re.findall(DTYPE, m.group("l"))), m.group(0)))
    return out


def test_dtype_rules_agree_with_the_validation():
    rules, bad = accepted(), []
    found = 0
    for doc in DOCS:
        for arg, said, words in dtype_rules(open(os.path.join(ROOT, doc)).read()):
            found += 1
            if said != rules[arg]:
                bad.append(f"{doc}: {words!r} (the validation takes {sorted(rules[arg])})")
    assert found >= 4, "the dtype rules were not found"
    assert not bad, "dtype rules that disagree with the code:\n" + "\n".join(bad)


@pytest.mark.parametrize("planted", [
    "slot is used). `topk_weights` is float32 and finite.",
    "`topk_weights` float32 only (others: `InputError`).",
    "| `topk_weights` | `[T, K]` | float32; nothing else |",
    "| `x` | `[T, H]` | float32, bfloat16 or float16 |",
])
def test_dtype_check_sees_planted_rules(planted):
    rules = accepted()
    found = dtype_rules(planted)
    assert found and any(said != rules[arg] for arg, said, _ in found), found


# ---- options against the signatures ----------------------------------------------------------

def test_option_table_defaults_are_the_signatures():
    """docs/usage.md's option table (ExpertParallelMoE's options): a default written as a
    Python literal is the signature's."""
    from epkit.nn import ExpertParallelMoE

    params = inspect.signature(ExpertParallelMoE.__init__).parameters
    text = open(os.path.join(ROOT, "docs", "usage.md")).read()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, re.M)
    checked, bad = 0, []
    for name, default in rows:
        if name not in params:
            continue
        try:
            value = ast.literal_eval(default)
        except (ValueError, SyntaxError):
            continue
        checked += 1
        if params[name].default != value:
            bad.append(f"{name}: the table says {default}, the signature {params[name].default!r}")
    assert checked >= 6, rows
    assert not bad, bad


def lacking(text: str) -> list[str]:
    """Options of epkit.Dispatcher a text says production does not have."""
    import epkit

    params = inspect.signature(epkit.Dispatcher.__init__).parameters
    said = re.findall(r"(?:[Pp]roduction|epkit) (?:has|takes) no `(\w+)`", text)
    return [name for name in said if name in params]


def test_no_document_denies_an_option_production_takes():
    bad = {doc: lacking(open(os.path.join(ROOT, doc)).read()) for doc in DOCS}
    assert not any(bad.values()), bad
    assert lacking("Production has no `ranks_per_node` yet: it sums with `G = 1`.") == [
        "ranks_per_node"]


# ---- quoted durations no older than their command --------------------------------------------

# A timed command: the lines that say how long it takes now (a file, and a pattern its line
# matches), and the sources that make the command what it is. Dated records of past runs (the
# rows of docs/benchmarks.md's tables, each with its load) are history, not claims.
DURATIONS = {
    "epkit bench --quick": ([("tools/bench.py", r"^QUICK_DURATION = "),
                             ("docs/benchmarks.md", r"epkit bench --quick --json out.json +#"),
                             ("docs/benchmarks.md", r"^on the machine's load: when last timed")],
                            ["tools/bench.py", "tools/bench_group.py", "baselines"]),
}
SECONDS = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|seconds|min)\b")


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _line_time(path: str, line: int) -> int:
    """When ``path``'s line ``line`` last changed (commit time; now when uncommitted)."""
    out = _git("blame", "--porcelain", "-L", f"{line},{line}", "--", path)
    if out.startswith("0000000000000000000000000000000000000000"):
        return 2 ** 62  # not committed yet: newer than anything
    return int(re.search(r"^committer-time (\d+)$", out, re.M).group(1))


def stale_durations() -> list[str]:
    bad = []
    for cmd, (claims, sources) in DURATIONS.items():
        changed = int(_git("log", "-1", "--format=%ct", "--", *sources).strip() or 0)
        for path, pattern in claims:
            lines = [(n, line) for n, line in
                     enumerate(open(os.path.join(ROOT, path)).read().splitlines(), 1)
                     if re.search(pattern, line) and SECONDS.search(line)]
            if not lines:
                bad.append(f"{path}: no line says how long `{cmd}` takes ({pattern!r})")
            for n, line in lines:
                if _line_time(path, n) < changed:
                    bad.append(f"{path}:{n}: a duration of `{cmd}` older than its sources "
                               f"({', '.join(sources)}): measure it again: {line.strip()!r}")
    return bad


def test_quoted_durations_are_no_older_than_their_command():
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.fail("this check reads git's history: run it in a clone")
    assert stale_durations() == []


def test_duration_check_reads_git_times():
    """The check's clock: README.md's first line is committed, so it has a commit time, and that
    time is no later than the newest commit's."""
    newest = int(_git("log", "-1", "--format=%ct").strip())
    assert 0 < _line_time("README.md", 1) <= newest


def test_duration_check_sees_an_old_claim(monkeypatch):
    """Issue 36: the help's "about 30 s" had outlived the command it timed. A claim line older
    than the command's newest source is reported."""
    monkeypatch.setattr(__import__(__name__), "_line_time", lambda path, line: 0)
    stale = stale_durations()
    assert any(s.startswith("tools/bench.py:") for s in stale), stale
    assert any(s.startswith("docs/benchmarks.md:") for s in stale), stale
