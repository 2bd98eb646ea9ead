#!/usr/bin/env bash
# The one-shot GPU check (issue 9, item 4). On a machine with one or more NVIDIA GPUs:
#
#   1. build the extension with its CUDA kernels (csrc/cuda, for the GPU's architecture)
#   2. the CUDA tests (tests/cuda: kernels bit for bit against the CPU kernels, end to end
#      against the CPU run, MXFP8, lazy)
#   3. the host-synchronisation counts and the CUDA-graph capture / replay of the static mode
#   4. epkit verify --backend nccl at world size 1, and via torchrun at the GPU count when > 1
#   5. the kernel benchmark (scripts/gpu_bench.py): pack and combine at 16384 tokens, hidden
#      7168, bfloat16, top-8 of 256 experts, against the device's copy bandwidth
#
# then a summary table, last. Full logs go to $EPKIT_GPU_LOGS (default out/gpu-check-<time>).
# Budget: 8 minutes on one H200 including the build. Python: $EPKIT_PYTHON, else .venv (a CUDA
# torch kept by `make setup`), else a .venv-gpu made here on the system's CUDA torch (no
# network: the project is installed without dependencies; missing modules are reported).
#
# Exit codes: 0 every step passed; 1 a step failed; 3 no GPU here: nothing was checked (the
# steps are listed as skipped). EPKIT_GPU_CHECK_FORCE=1 runs the steps without a GPU (a CUDA
# build of torch suffices): a plumbing test of this script; the GPU steps then skip or fail.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS="${EPKIT_GPU_LOGS:-$ROOT/out/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$LOGS"
T0=$(date +%s)
declare -a NAMES STATUS SECS NOTES

record() {  # name status seconds note
  NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3"); NOTES+=("$4")
  printf '== %-34s %-7s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

summary() {
  echo
  echo "epkit GPU check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - T0 )) s, logs in $LOGS"
  printf '%-36s %-8s %6s  %s\n' "step" "result" "secs" "notes"
  printf '%-36s %-8s %6s  %s\n' "----" "------" "----" "-----"
  for i in "${!NAMES[@]}"; do
    printf '%-36s %-8s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
  done | tee "$LOGS/summary.txt"
}

STEPS=("build (CUDA kernels)" "CUDA tests" "sync counts + CUDA graph" "verify nccl, world size 1"
       "verify nccl, all GPUs (torchrun)" "kernel benchmark")

# ---- 0. is there a GPU? --------------------------------------------------------------------
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || true
fi
if [ "${EPKIT_GPU_CHECK_FORCE:-0}" = 1 ] && [ "$NGPU" -eq 0 ]; then
  NGPU=1; FORCED=1; echo "gpu_check: EPKIT_GPU_CHECK_FORCE=1: running the steps without a GPU"
fi
if [ "$NGPU" -eq 0 ]; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none): every step is skipped." | tee "$LOGS/skipped.txt"
  for s in "${STEPS[@]}"; do record "$s" skipped 0 "no GPU"; done
  summary
  exit 3
fi

# ---- the Python to use ---------------------------------------------------------------------
has_cuda_torch() {
  if [ "${FORCED:-0}" = 1 ]; then "$1" -c 'import torch; assert torch.version.cuda' >/dev/null 2>&1
  else "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; fi
}
PY="${EPKIT_PYTHON:-}"
if [ -z "$PY" ] && [ -x .venv/bin/python ] && has_cuda_torch .venv/bin/python; then PY=.venv/bin/python; fi
if [ -z "$PY" ]; then
  SYS=$(command -v python3 || command -v python)
  if [ -n "$SYS" ] && has_cuda_torch "$SYS"; then
    [ -x .venv-gpu/bin/python ] || "$SYS" -m venv --system-site-packages .venv-gpu >> "$LOGS/env.log" 2>&1
    PY=.venv-gpu/bin/python
  fi
fi
if [ -z "$PY" ] || ! has_cuda_torch "$PY"; then
  echo "gpu_check: $NGPU GPU(s), but no Python with a CUDA build of torch (set EPKIT_PYTHON)" | tee "$LOGS/skipped.txt"
  for s in "${STEPS[@]}"; do record "$s" skipped 0 "no CUDA torch"; done
  summary
  exit 1
fi
if ! "$PY" -c 'import epkit' >/dev/null 2>&1; then  # install the project itself, offline
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$LOGS/env.log" 2>&1
fi
if ! "$PY" -c 'import epkit' >/dev/null 2>&1; then  # no install possible: epkit from the tree
  mkdir -p "$LOGS/shim/epkit"
  cat > "$LOGS/shim/epkit/__init__.py" <<EOF
# epkit from the source tree without an install: the package is production/, its subpackages
# reference/ and verify/ live beside it.
import os as _os
__path__ = [_os.path.join("$ROOT", "production"), "$ROOT"]
__file__ = _os.path.join("$ROOT", "production", "__init__.py")
exec(compile(open(__file__).read(), __file__, "exec"))
EOF
  export PYTHONPATH="$LOGS/shim${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: epkit imported from the source tree ($LOGS/shim)" | tee -a "$LOGS/env.log"
fi
MISSING=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("numpy", "ml_dtypes", "pytest", "hypothesis", "tqdm")
               if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$MISSING" ]; then  # one try, quietly; offline machines keep what they have
  timeout 120 "$PY" -m pip install -q $MISSING >> "$LOGS/env.log" 2>&1 || true
fi
"$PY" -c 'import sys, torch, epkit; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")' > "$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
[ "${FORCED:-0}" = 1 ] && export EPKIT_FORCE_CUDA_BUILD=1
export EPKIT_BUILD_DIR="${EPKIT_BUILD_DIR:-$ROOT/build/gpu-ext}"
FAILED=0

note_of() {  # a short line from a log: pytest's or verify's summary, else the first exception
  local n
  n=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)|^epkit verify:.*(pass|fail)' "$1" | tail -1)
  [ -z "$n" ] && n=$(grep -E '^[A-Za-z_.]*(Error|Exception)\b' "$1" | head -1)
  [ -z "$n" ] && n=$(grep -v '^[[:space:]]*$' "$1" | tail -1)
  echo "$n" | sed 's/^=* *//' | cut -c1-80
}

run_step() {  # name timeout log command...
  local name=$1 limit=$2 log=$3; shift 3
  local t=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$log" 2>&1
  local rc=$? secs=$(( $(date +%s) - t ))
  local note
  note=$(note_of "$LOGS/$log")
  if [ $rc -eq 0 ] && [ "${FORCED:-0}" != 1 ] && [[ "$*" == *pytest* ]] \
      && ! grep -qE '[0-9]+ passed' "$LOGS/$log"; then  # on a GPU, tests that all skip failed
    rc=5; note="no test ran: $note"
  fi
  if [ $rc -eq 0 ]; then record "$name" ok "$secs" "${note:-$log}"
  elif [ $rc -eq 124 ]; then record "$name" TIMEOUT "$secs" "over ${limit}s, see $log"; FAILED=1
  else record "$name" FAILED "$secs" "rc $rc: ${note:-see $log}"; FAILED=1
  fi
  return $rc
}

# ---- 1. build --------------------------------------------------------------------------------
if ! run_step "${STEPS[0]}" 240 build.log "$PY" production/_build.py; then
  for s in "${STEPS[@]:1}"; do record "$s" skipped 0 "build failed"; done
  summary
  exit 1
fi

# ---- 2, 3. tests -----------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/cuda)
run_step "${STEPS[1]}" 240 cuda-tests.log "${PYTEST[@]}" -k "not host_waits and not no_host_sync and not graph and not verify_nccl"
run_step "${STEPS[2]}" 120 sync-graph-tests.log "${PYTEST[@]}" -k "host_waits or no_host_sync or graph"

# ---- 4. verify over NCCL ----------------------------------------------------------------------
VERIFY=(-m epkit.verify --backend nccl --examples "${EPKIT_VERIFY_EXAMPLES:-6}" --no-progress)
run_step "${STEPS[3]}" 150 verify-nccl-1.log "$PY" -m torch.distributed.run --standalone \
  --nproc-per-node 1 "${VERIFY[@]}" --json "$LOGS/verify-nccl-1.json"
if [ "$NGPU" -gt 1 ]; then
  run_step "${STEPS[4]}" 150 "verify-nccl-$NGPU.log" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$NGPU" "${VERIFY[@]}" --json "$LOGS/verify-nccl-$NGPU.json"
else
  record "${STEPS[4]}" skipped 0 "one GPU"
fi

# ---- 5. kernel benchmark ----------------------------------------------------------------------
run_step "${STEPS[5]}" 120 bench.log "$PY" scripts/gpu_bench.py --json "$LOGS/bench.json"
sed -n '1,200p' "$LOGS/bench.log"

summary
exit $FAILED
