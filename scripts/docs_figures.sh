#!/usr/bin/env bash
# The deterministic tables and figures of docs/benchmarks.md, regenerated (`make docs` runs it).
#
# Every table there sits between `<!-- table: NAME -->` and `<!-- /table -->`; this script
# replaces it with what its `epkit simulate ... --markdown` command prints (seeded: the same
# table on every machine), the command written above it. The figures are written into docs/.
# `epkit bench`'s timings (docs/bench_scaling.png and the bench tables) are not here: they
# depend on the machine and its load, so docs/benchmarks.md gives their command and machine.
#
#     bash scripts/docs_figures.sh        # from anywhere; about 100 s on the 2-core machine
#
# EPKIT names the epkit command (default: the repository's .venv/bin/epkit).
set -euo pipefail
cd "$(dirname "$0")/.."
EPKIT=${EPKIT:-.venv/bin/epkit}
PY=${PY:-.venv/bin/python}
DOC=docs/benchmarks.md
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# table NAME ARGS...: the Markdown table of `epkit simulate ARGS`, kept for NAME's markers
table() {
  local name=$1
  shift
  echo "docs_figures: $name: epkit simulate $*" >&2
  {
    printf '`epkit simulate%s`\n\n' "${*:+ $*}"
    case " $* " in *" --plot "*) plot=() ;; *) plot=(--no-plot) ;; esac  # a figure only where named
    "$EPKIT" simulate "$@" "${plot[@]}" --markdown | sed -n '/^| /p'
  } > "$OUT/$name.md"
}

# 64 ranks, 256 experts, top-8, 4096 tokens a rank (the defaults): bytes and messages
table defaults
table target_f32 --hidden 64 --dtype float32
table target_bf16 --hidden 64
table grouped64 --routing grouped --nodes-per-token 4 --plot docs/simulate_hier.png --plot-transport hier
table grouped64_f32 --routing grouped --nodes-per-token 4 --dtype float32
table zipf64_cap --routing zipf --skew 1.2 --capacity-factor 1.25
table zipf64 --routing zipf --skew 1.2 --plot docs/simulate_heatmap.png
# 1024 ranks, 4096 experts: where hier's fewer messages win (few tokens) and where not
table uniform1024 --ranks 1024 --experts 4096
table uniform1024_t128 --ranks 1024 --experts 4096 --tokens 128
table grouped1024 --ranks 1024 --experts 4096 --routing grouped --nodes-per-token 4
table grouped1024_t128 --ranks 1024 --experts 4096 --tokens 128 --routing grouped --nodes-per-token 4
table zipf1024_t256 --ranks 1024 --experts 4096 --tokens 256 --routing zipf --skew 1.2 --plot docs/simulate_1024.png

"$PY" - "$OUT" "$DOC" <<'PYEOF'
import os, re, sys

out, doc = sys.argv[1:]
text = open(doc).read()
names = []


def table(m):
    names.append(m.group(1))
    with open(os.path.join(out, m.group(1) + ".md")) as f:   # a marker without a command fails
        return f"<!-- table: {m.group(1)} -->\n{f.read()}<!-- /table -->"


text = re.sub(r"<!-- table: (\S+) -->\n.*?<!-- /table -->", table, text, flags=re.S)
unused = sorted(set(n[:-3] for n in os.listdir(out)) - set(names))
if unused:
    sys.exit(f"docs_figures: tables without a marker in {doc}: {', '.join(unused)}")
open(doc, "w").write(text)
print(f"docs_figures: {len(names)} tables written into {doc}; figures docs/simulate_*.png")
PYEOF
