#!/usr/bin/env bash
# The one-shot GPU check. On a machine with one or more NVIDIA GPUs:
#
#   1. build the C++ CPU kernels (the oracle) and compile every Triton kernel specialisation for
#      this GPU's architecture with the compile gate (epkit kernels --compile: registers, spills,
#      shared memory, and the numeric rules read from the assembly)
#   2. the Triton kernel tests compiled for real: tests/triton, whose group simulations and
#      per-kernel tests then also run on CUDA tensors, bit for bit against the C++ kernels
#   3. the real-GPU tests (tests/cuda): host-synchronisation counts under
#      torch.cuda.set_sync_debug_mode, the static mode captured in a CUDA graph and replayed on
#      cpu:gloo,cuda:nccl and on an NCCL-only group, the lazy form's side stream
#   4. EPKIT_HOST_PLAN=1: the end-to-end tests with the eager plan computed on the host
#   5. compute-sanitizer --tool memcheck, 6. --tool racecheck: pack, unpack, combine and every
#      backward kernel on a small group (both transports, ragged and static, a wide top-k);
#      skipped with a line where compute-sanitizer is not installed
#   7. epkit verify --backend nccl at world size 1, 8. via torchrun at the GPU count when > 1
#   9. the kernel benchmark (scripts/gpu_bench.py): its kernels checked bit for bit against the
#      C++ CPU kernels first, then pack, unpack, gather and reduce timed at 16384 tokens, hidden
#      7168, bfloat16, top-8 of 256 experts, against a device copy of the same bytes (the goal:
#      70 % of copy bandwidth or better on an H200)
#  10. each phase of a small step (T = 128 a rank, every GPU, NCCL) timed next to the launches,
#      collectives and host waits it issues (scripts/gpu_phases.py; the goal: dispatch + combine
#      under 100 us on 8 ranks of one node)
#
#
# then a summary table, last, always: every step runs under `timeout` (its own limit, cut to
# what is left of the whole budget), a step that hangs is killed and reported TIMEOUT, a step
# that fails FAILED, steps the budget cannot fit "skipped", and an interrupted run (a signal, an
# outer timeout) still prints the table, with the steps it never reached as "not run".
# Budget: EPKIT_GPU_CHECK_BUDGET seconds (default 360: 6 minutes on one H200, build included).
# Full logs go to $EPKIT_GPU_LOGS (default out/gpu-check-<time>). Python: $EPKIT_PYTHON, else
# .venv (a CUDA torch kept by `make setup`), else a .venv-gpu made here on the system's CUDA
# torch (no network: the project is installed without dependencies; missing modules reported).
#
# Exit codes: 0 every step passed; 1 a step failed or timed out; 3 no GPU here: nothing was
# checked (the steps are listed as skipped). EPKIT_GPU_CHECK_FORCE=1 runs the steps without a
# GPU (any torch will do): a dry run of this script's step list and time boxes; the GPU steps
# then skip or fail. EPKIT_GPU_CHECK_HANG=<n> replaces step n by a hang (`sleep`), to show its
# time box; EPKIT_GPU_CHECK_SCALE=<f> multiplies every step's limit (e.g. 0.05 for a quick dry
# run).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS="${EPKIT_GPU_LOGS:-$ROOT/out/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$LOGS"
T0=$(date +%s)
BUDGET="${EPKIT_GPU_CHECK_BUDGET:-360}"
SCALE="${EPKIT_GPU_CHECK_SCALE:-1}"
declare -a NAMES STATUS SECS NOTES

STEPS=("build + Triton compile gate" "Triton tests on the GPU" "sync counts + CUDA graphs"
       "EPKIT_HOST_PLAN=1 end to end" "compute-sanitizer memcheck" "compute-sanitizer racecheck"
       "verify nccl, world size 1" "verify nccl, all GPUs (torchrun)"
       "kernel benchmark (CPU-checked)" "phase times at T=128 (launch-bound)")
# Each step's own time box in seconds (before SCALE and the remaining budget cut it).
LIMITS=(100 70 30 20 40 40 25 40 35 40)
CURRENT=""  # the running step's pid (a signal stops it before the table is printed)

record() {  # name status seconds note
  NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3"); NOTES+=("$4")
  printf '== %-34s %-7s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

SUMMARY_DONE=0
summary() {
  [ "$SUMMARY_DONE" = 1 ] && return
  SUMMARY_DONE=1
  local s seen
  for s in "${STEPS[@]}"; do  # steps never reached (an interrupted run)
    seen=0
    for n in "${NAMES[@]:-}"; do [ "$n" = "$s" ] && seen=1; done
    [ $seen = 0 ] && NAMES+=("$s") && STATUS+=("not run") && SECS+=(0) && NOTES+=("${1:-}")
  done
  echo
  echo "epkit GPU check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - T0 )) s of ${BUDGET} s, logs in $LOGS"
  printf '%-36s %-8s %6s  %s\n' "step" "result" "secs" "notes"
  printf '%-36s %-8s %6s  %s\n' "----" "------" "----" "-----"
  for i in "${!NAMES[@]}"; do
    printf '%-36s %-8s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
  done | tee "$LOGS/summary.txt"
}
on_signal() {
  echo "gpu_check: interrupted ($1)"
  if [ -n "$CURRENT" ]; then
    kill -TERM "$CURRENT" 2>/dev/null
    record "$CURRENT_NAME" INTERRUPTED $(( $(date +%s) - CURRENT_T )) "stopped by $1"; FAILED=1
  fi
  summary "interrupted ($1)"
  exit 1
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'summary "the script stopped before this step"' EXIT

# ---- 0. is there a GPU? --------------------------------------------------------------------
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  timeout 20 nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || true
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
  if [ "${FORCED:-0}" = 1 ]; then timeout 60 "$1" -c 'import torch' >/dev/null 2>&1  # dry run: any torch
  else timeout 60 "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; fi
}
PY="${EPKIT_PYTHON:-}"
if [ -z "$PY" ] && [ -x .venv/bin/python ] && has_cuda_torch .venv/bin/python; then PY=.venv/bin/python; fi
if [ -z "$PY" ]; then
  SYS=$(command -v python3 || command -v python)
  if [ -n "$SYS" ] && has_cuda_torch "$SYS"; then
    [ -x .venv-gpu/bin/python ] || timeout 60 "$SYS" -m venv --system-site-packages .venv-gpu >> "$LOGS/env.log" 2>&1
    PY=.venv-gpu/bin/python
  fi
fi
if [ -z "$PY" ] || ! has_cuda_torch "$PY"; then
  echo "gpu_check: $NGPU GPU(s), but no Python with a CUDA build of torch (set EPKIT_PYTHON)" | tee "$LOGS/skipped.txt"
  for s in "${STEPS[@]}"; do record "$s" skipped 0 "no CUDA torch"; done
  summary
  exit 1
fi
if ! timeout 60 "$PY" -c 'import epkit' >/dev/null 2>&1; then  # install the project itself, offline
  timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$LOGS/env.log" 2>&1
fi
if ! timeout 60 "$PY" -c 'import epkit' >/dev/null 2>&1; then  # no install possible: epkit from the tree
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
MISSING=$(timeout 60 "$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("numpy", "ml_dtypes", "pytest", "hypothesis", "tqdm")
               if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$MISSING" ] && [ "${FORCED:-0}" != 1 ]; then  # one try, quietly; offline machines keep what they have
  timeout 60 "$PY" -m pip install -q $MISSING >> "$LOGS/env.log" 2>&1 || true
fi
timeout 60 "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")' > "$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi  # compute-sanitizer
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export EPKIT_BUILD_DIR="${EPKIT_BUILD_DIR:-$ROOT/build/gpu-ext}"
FAILED=0

note_of() {  # a short line from a log: pytest's or verify's summary, else the first exception
  local n
  n=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)|^epkit verify:.*(pass|fail)|^check .* against the CPU|ERROR SUMMARY' "$1" 2>/dev/null | tail -1)
  [ -z "$n" ] && n=$(grep -E '^[A-Za-z_.]*(Error|Exception)\b' "$1" 2>/dev/null | head -1)
  [ -z "$n" ] && n=$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -1)
  echo "$n" | sed 's/^=* *//' | cut -c1-80
}

# run_step <index> <log> command...: STEPS[index] under its time box, recorded.
run_step() {
  local idx=$1 log=$2; shift 2
  local name=${STEPS[$idx]}
  local left=$(( BUDGET - ($(date +%s) - T0) - 5 ))
  local limit
  limit=$(awk -v l="${LIMITS[$idx]}" -v s="$SCALE" 'BEGIN { v = int(l * s); print (v < 1 ? 1 : v) }')
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    record "$name" skipped 0 "budget of ${BUDGET}s spent"; return 0
  fi
  if [ "${EPKIT_GPU_CHECK_HANG:-}" = "$((idx + 1))" ]; then set -- sleep 100000; fi  # the time box, shown
  local t=$(date +%s)
  # in the background and waited for, so that a signal to this script is handled at once
  timeout -k 5 "$limit" "$@" > "$LOGS/$log" 2>&1 < /dev/null &
  CURRENT=$! CURRENT_NAME=$name CURRENT_T=$t
  wait "$CURRENT"
  local rc=$? secs=$(( $(date +%s) - t ))
  CURRENT=""
  local note
  note=$(note_of "$LOGS/$log")
  if [ $rc -eq 0 ] && [ "${FORCED:-0}" != 1 ] && [[ "$*" == *pytest* ]] \
      && ! grep -qE '[0-9]+ passed' "$LOGS/$log"; then  # on a GPU, tests that all skip failed
    rc=5; note="no test ran: $note"
  fi
  if [ $rc -eq 0 ]; then record "$name" ok "$secs" "${note:-$log}"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" TIMEOUT "$secs" "over ${limit}s (killed), see $log"; FAILED=1
  else record "$name" FAILED "$secs" "rc $rc: ${note:-see $log}"; FAILED=1
  fi
  return $rc
}

# ---- 1. build the C++ oracle, compile the Triton kernels for this GPU -------------------------
ARCH=$(timeout 60 "$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"sm_{m}{n}")' 2>/dev/null || echo sm_90)
if ! run_step 0 build.log "$PY" -m epkit.tools.cli kernels --compile "$ARCH" \
    && [ "${FORCED:-0}" != 1 ]; then
  for i in "${!STEPS[@]}"; do [ "$i" -gt 0 ] && record "${STEPS[$i]}" skipped 0 "build failed"; done
  summary
  exit 1
fi  # (a dry run goes on: the steps' time boxes are what it shows)

# ---- 2, 3, 4. tests --------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts="" tests/cuda)
run_step 1 triton-tests.log env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
  -p no:xdist -o addopts="" tests/triton/test_group_sim.py
run_step 2 sync-graph-tests.log "${PYTEST[@]}" -k "not verify_nccl"
run_step 3 host-plan-tests.log env EPKIT_HOST_PLAN=1 "${PYTEST[@]}" \
  -k "cuda_equals_cpu or host_waits or lazy"

# ---- 5, 6. compute-sanitizer on a small case ----------------------------------------------------
cat > "$LOGS/sanitize_case.py" <<EOF
# pack, unpack, combine and every backward kernel on small groups, on CUDA (tests/triton/sim.py:
# torch.ops.epkit on CUDA tensors runs the Triton kernels)
import sys
sys.path.insert(0, "$ROOT/tests/triton")
import torch
import sim
from epkit.device import unpack_status
for R, L, K, Ts, opts in [(2, 3, 3, [9, 5], dict(transport="dedup", exchange="ragged")),
                          (2, 3, 3, [9, 5], dict(transport="pairs", exchange="static", align=2)),
                          (2, 2, 3, [7, 3], dict(transport="dedup", exchange="static", capacity=2)),
                          (1, 160, 130, [3], dict(transport="dedup", exchange="ragged"))]:
    case = sim.make_case(R, L, K, 40, Ts, torch.bfloat16, seed=R + K, hot=True)
    cpu = sim.run(case, device="cpu", **opts)
    gpu = sim.run(case, device="cuda", **opts)
    sim.assert_same(cpu, gpu)
assert unpack_status() == 0
print("sanitize case: ok")
EOF
SAN=$(command -v compute-sanitizer || true)
[ -z "$SAN" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] && SAN="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
if [ -n "$SAN" ]; then
  SANOPTS=(--error-exitcode 9 --print-limit 20 --target-processes application-only)
  run_step 4 memcheck.log "$SAN" --tool memcheck "${SANOPTS[@]}" "$PY" "$LOGS/sanitize_case.py"
  run_step 5 racecheck.log "$SAN" --tool racecheck "${SANOPTS[@]}" "$PY" "$LOGS/sanitize_case.py"
else
  record "${STEPS[4]}" skipped 0 "no compute-sanitizer here (CUDA_HOME/bin, PATH)"
  record "${STEPS[5]}" skipped 0 "no compute-sanitizer here (CUDA_HOME/bin, PATH)"
fi

# ---- 7, 8. verify over NCCL ----------------------------------------------------------------------
VERIFY=(-m epkit.verify --backend nccl --examples "${EPKIT_VERIFY_EXAMPLES:-4}" --no-progress)
run_step 6 verify-nccl-1.log "$PY" -m torch.distributed.run --standalone \
  --nproc-per-node 1 "${VERIFY[@]}" --json "$LOGS/verify-nccl-1.json"
if [ "$NGPU" -gt 1 ]; then
  run_step 7 "verify-nccl-$NGPU.log" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$NGPU" "${VERIFY[@]}" --json "$LOGS/verify-nccl-$NGPU.json"
else
  record "${STEPS[7]}" skipped 0 "one GPU"
fi

# ---- 9. kernel benchmark, its outputs checked against the CPU first ------------------------------
run_step 8 bench.log "$PY" scripts/gpu_bench.py --reps 10 --json "$LOGS/bench.json"
sed -n '1,200p' "$LOGS/bench.log"

# ---- 10. each phase of a small step, timed, next to what it launches (docs/design.md, budget) --
run_step 9 phases.log "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  scripts/gpu_phases.py --tokens 128 --iters 30 --json "$LOGS/phases.json"
sed -n '1,40p' "$LOGS/phases.log"

summary
exit $FAILED
