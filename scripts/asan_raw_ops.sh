#!/usr/bin/env bash
# The raw ops (torch.ops.epkit.*) on malformed arguments under AddressSanitizer.
#
# Builds the CPU kernels with -fsanitize=address into their own directory (the normal build is
# untouched), then runs every case of tests/production/test_raw_ops.py against that library, each
# case's valid and malformed call in a child process with libasan preloaded. A case passes when
# the valid call succeeds, the malformed one raises "epkit.<op>: ..." and ASan reports nothing;
# the summary counts the cases, the failures, the crashes and the ASan reports.
#
#   scripts/asan_raw_ops.sh            # build (cached) and run; exit 1 on any failure
#
# Environment: PYTHON (default .venv/bin/python), EPKIT_ASAN_BUILD_DIR (default
# .venv/epkit-build/epkit_C_asan), MAX_JOBS (parallel compiles, default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
BUILD="${EPKIT_ASAN_BUILD_DIR:-$ROOT/.venv/epkit-build/epkit_C_asan}"
export MAX_JOBS="${MAX_JOBS:-2}"
mkdir -p "$BUILD"

# The ASan runtime must come first in every process that loads the library (the build step loads
# it too): preload the compiler's.
LIBASAN="$(c++ -print-file-name=libasan.so)"
LIBASAN="$(readlink -f "$LIBASAN")"
[ -e "$LIBASAN" ] || { echo "asan_raw_ops: no libasan.so for c++ (install libasan)"; exit 2; }
# python links no libstdc++: preloaded after libasan, ASan's __cxa_throw interceptor finds the
# real one (else the first C++ exception aborts with "CHECK failed ... real___cxa_throw").
PRELOAD="$LIBASAN:$(readlink -f "$(c++ -print-file-name=libstdc++.so.6)")"

# Leaks: python and torch keep allocations to exit, not ours to report. allocator_may_return_null:
# an absurd size is a failed allocation (an exception), not an ASan abort. halt_on_error: the
# first report ends the child, so it is pinned on its case (the runner starts a fresh one).
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:detect_odr_violation=0:alloc_dealloc_mismatch=0"

echo "asan_raw_ops: building the ASan kernels in $BUILD"
t0=$(date +%s)
LD_PRELOAD="$PRELOAD" "$PY" - "$BUILD" <<'EOF'
import sys

from torch.utils import cpp_extension

from epkit import _build

flags = [f for f in _build.CFLAGS if not f.startswith("-O")]
flags += ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
cpp_extension.load(name="epkit_C_asan", build_directory=sys.argv[1],
                   sources=_build.sources(cuda=False), extra_cflags=flags,
                   extra_ldflags=["-fopenmp", "-fsanitize=address"],
                   extra_include_paths=[_build.CSRC], is_python_module=False)
EOF
LIB="$BUILD/epkit_C_asan.so"
echo "asan_raw_ops: built in $(( $(date +%s) - t0 )) s: $LIB"
echo "asan_raw_ops: preloading $PRELOAD"
t0=$(date +%s)
set +e
LD_PRELOAD="$PRELOAD" "$PY" "$ROOT/tests/production/test_raw_ops.py" --lib "$LIB"
rc=$?
set -e
echo "asan_raw_ops: ran in $(( $(date +%s) - t0 )) s, exit $rc (ASAN_OPTIONS=$ASAN_OPTIONS)"
exit $rc
