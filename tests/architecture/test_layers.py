"""The layers of epkit's packages, read from their imports (every import statement, at module
level or inside a function: a function-level import hides a cycle, it does not remove it).

- No import cycle anywhere, inside a package or across packages.
- The harness does not depend on the programs (``epkit.verify`` never imports ``epkit.tools``),
  and the reference (the spec, pure NumPy) imports nothing of production, verify or tools.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# package-dir of pyproject.toml: the folder each package's modules live in
PACKAGES = {"epkit": "production", "epkit.reference": "reference", "epkit.verify": "verify",
            "epkit.tools": "tools", "epkit.baselines": "baselines"}


def modules() -> dict:
    """module name -> path, for every module of the packages (subpackages included)."""
    found = {}
    for pkg, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in ("csrc", "__pycache__")]
            for f in filenames:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    found[".".join([pkg] + rel)] = os.path.join(dirpath, f)
    return found


def imports(name: str, path: str, known: dict) -> set:
    """The modules of ``known`` that module ``name`` imports. ``from pkg import sub`` counts as
    importing the submodule ``sub``, not the package's ``__init__`` (the package is imported
    first anyway, by whoever imports any of its modules)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else [mod] + subs
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def graph() -> dict:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(g: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_detector_finds_a_cycle_closed_inside_a_function(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from . import b\n")
    b.write_text("def f():\n    from .a import x\n")
    known = {"p.a": str(a), "p.b": str(b)}
    g = {m: imports(m, p, known) for m, p in known.items()}
    assert cycles(g) == [["p.a", "p.b"]]


def test_no_import_cycle():
    g = graph()
    found = cycles(g)
    detail = "\n".join(" <-> ".join(c) + "\n" + "\n".join(
        f"    {m} imports {sorted(g[m] & set(c))}" for m in c) for c in found)
    assert not found, f"import cycles:\n{detail}"


@pytest.mark.parametrize("package,forbidden", [
    ("epkit.verify", ("epkit.tools",)),
    ("epkit.reference", ("epkit.tools", "epkit.verify", "epkit.baselines")),
])
def test_layering(package, forbidden):
    g = graph()
    bad = sorted((m, t) for m, ts in g.items() if m == package or m.startswith(package + ".")
                 for t in ts if any(t == f or t.startswith(f + ".") for f in forbidden))
    assert not bad, f"{package} must not import {forbidden}: {bad}"


def test_the_library_imports_no_harness_program_or_baseline():
    """epkit itself (production/: ops, integrations, nn, triton) never imports epkit.verify,
    epkit.tools or epkit.baselines, not even inside a function: the harness checks the library,
    the library does not lean on it (the frameworks' verify adapters live in verify/)."""
    g = graph()
    above = ("epkit.verify", "epkit.tools", "epkit.baselines")
    library = [m for m in g if m.startswith("epkit") and not m.startswith(above)
               and not m.startswith("epkit.reference")]
    bad = sorted((m, t) for m in library for t in g[m] if t.startswith(above))
    assert not bad, f"the library imports the harness, the programs or the baselines: {bad}"


def test_reference_imports_no_production_module():
    g = graph()
    ref = {m for m in g if m.startswith("epkit.reference")}
    bad = sorted((m, t) for m in ref for t in g[m] if t not in ref and t.startswith("epkit"))
    assert not bad, f"the reference imports production: {bad}"


def documented_order(text: str) -> dict:
    """docs/design.md "Where things live": for the reference and production lists, module name
    -> its line's position (a folder ``x/`` stands for its modules not listed on their own)."""
    block = text[text.index("```\nreference/"):]
    block = block[:block.index("```", 4)]
    pkg = {"reference": "epkit.reference", "production": "epkit"}
    order, current, line_no = {}, None, 0
    for line in block.splitlines():
        head = line.split("/", 1)[0]
        if line[:1].strip():
            current = pkg.get(head) if line[len(head):len(head) + 1] == "/" else None
            continue
        if current is None or not line.startswith("  ") or line.startswith("   "):
            continue
        line_no += 1
        for entry in line.strip().split("   ")[0].split():
            name = entry[:-3] if entry.endswith(".py") else entry
            name = name[:-len("/__init__")] if name.endswith("/__init__") else name
            order.setdefault(current, {})[name] = (line_no, entry.endswith("/"))
    return order


def position(module: str, listed: dict):
    """The documented line of ``module``: its own (``triton/__init__.py`` for the package
    ``epkit.triton``), else its folder's (``triton/`` for ``epkit.triton.pack``); None when the
    list does not place it."""
    for prefix in sorted(listed, key=len, reverse=True):  # epkit.reference before epkit
        if not module.startswith(prefix + "."):
            continue
        parts, entries = module[len(prefix) + 1:].split("."), listed[prefix]
        if "/".join(parts) in entries:  # its own line: "plan.py", "triton/_runtime.py"
            return entries["/".join(parts)][0]
        folder = entries.get(parts[0] + "/")
        return None if folder is None else folder[0]
    return None


def test_design_doc_lists_the_layers_in_import_order():
    """A module imports only modules listed above it (or on its own line) in docs/design.md,
    so the document's picture of the layers cannot drift from the code."""
    listed = documented_order(open(os.path.join(ROOT, "docs", "design.md")).read())
    assert set(listed) == {"epkit.reference", "epkit"}
    g = graph()
    others = ("epkit.verify", "epkit.tools", "epkit.baselines")
    library = [m for m in g if m.startswith("epkit.") and m != "epkit.reference"
               and not m.startswith(others)]
    unlisted = sorted(m for m in library if position(m, listed) is None)
    assert not unlisted, f"modules docs/design.md does not place: {unlisted}"
    upward = [f"{m} (line {position(m, listed)}) imports {t} (line {position(t, listed)})"
              for m in library for t in g[m]
              if t in library and position(t, listed) > position(m, listed)]
    assert not upward, "docs/design.md lists these the other way round:\n" + "\n".join(upward)
