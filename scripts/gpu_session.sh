#!/bin/bash
# The GPU session of issue 13, on the device machine (docs/GPU.md gives the
# exact device-tool calls). Usage:
#
#   bash scripts/gpu_session.sh STEP|GROUP ...
#
# Groups: tests (the `make gpu-test` pieces), bench, sanitizer, all;
# `retry` reruns every step that did not pass in an earlier call on this
# (still warm) machine. Steps run in the order given, each under its own
# timeout, its log kept; a failing step never stops the ones after it. Every
# call starts with `setup` (carried wheels, environment) and `build` (skipped
# when the build of these same sources is already there), and ends with the
# summary table (printed last, also $OUT/summary.txt).
#
# The whole call keeps inside GS_SESSION_SECONDS (default 560: the device
# tool's 600 s limit less a margin): a step gets the time left, and one that
# cannot get its minimum is recorded as skipped. Under $OUT (at most 8
# files): session.log (every step's output, as it runs), summary.txt,
# bench.json, logs.tar.gz (each step's log, info files, traces) at the end.
#
# Without $OUT (trying it out elsewhere), the same files go to
# build/gpu-session/out; the steps' records stay in build/gpu-session (remove
# it to start over). GS_SANITIZER_SECONDS (240) bounds each sanitizer
# step, GPU_NP (2) is the shared-GPU rank count.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
T0=$(date +%s)
BUDGET=${GS_SESSION_SECONDS:-560}
STATE=$ROOT/build/gpu-session           # kept between calls while the machine is warm
LOGS=$STATE/logs
OUTD=${OUT:-$STATE/out}
SITE=${GS_SITE:-/tmp/gs-site}
mkdir -p "$LOGS" "$OUTD" "$STATE/traces"
touch "$STATE/steps.tsv"
SESSION_LOG=$OUTD/session.log
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export GRADSYNC_CUDA_ARCHS=${GRADSYNC_CUDA_ARCHS:-90}
export GRADSYNC_TIMEOUT_SECONDS=${GRADSYNC_TIMEOUT_SECONDS:-120}  # a hang is an error
PY=${PYTHON:-python3}
NP2=${GPU_NP:-2}

note() { echo "[gpu_session $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$SESSION_LOG"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# step NAME MAX_SECONDS MIN_SECONDS COMMAND: runs COMMAND (bash) with a
# timeout of min(MAX, time left - 25 s), unless less than MIN is left.
# Records "name<TAB>status<TAB>seconds<TAB>rc" in steps.tsv.
step() {
  local name=$1 max=$2 min=$3 cmd=$4 avail t rc start
  avail=$(( $(left) - 25 ))
  if [ "$avail" -lt "$min" ]; then
    note "$name: SKIPPED (${avail}s left, needs ${min}s)"
    printf '%s\tskipped\t0\t-\n' "$name" >> "$STATE/steps.tsv"
    return 0
  fi
  t=$(( max < avail ? max : avail ))
  note "== $name (timeout ${t}s): $cmd"
  start=$(date +%s)
  # timeout signals the whole process group it leads: mpiexec and its ranks too
  timeout -k 10 "$t" bash -c "$cmd" 2>&1 | tee "$LOGS/$name.log" >> "$SESSION_LOG"
  rc=${PIPESTATUS[0]}
  local status=pass
  [ "$rc" = 0 ] || status=fail
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && status=timeout
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - start ))" "$rc" >> "$STATE/steps.tsv"
  note "$name: $status (rc $rc, $(( $(date +%s) - start ))s)"
  write_summary
  return 0
}

write_summary() {
  "$PY" scripts/gpu_summary.py "$STATE" > "$OUTD/summary.txt" 2>&1 || true
}

# ---------------------------------------------------------------- setup
setup() {
  # --prefix, not --target: the mpich wheel's libraries are data files that
  # pip --target drops (its lib/ clashes with the target's own)
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
      --prefix "$SITE" .whl/*.whl || note "setup: installing the carried wheels FAILED"
  else
    note "setup: no .whl/ carried (scripts/gpu_prepare.sh makes it): using what is installed"
  fi
  # where pip put them depends on the Python's install scheme: look
  local pkgs bin lib
  pkgs=$(find "$SITE" -maxdepth 6 -type d \( -name site-packages -o -name dist-packages \) \
    2>/dev/null | head -1)
  bin=$(dirname "$(find "$SITE" -maxdepth 4 -path '*/bin/mpicc' 2>/dev/null | head -1)")
  lib=$(dirname "$(find "$SITE" -maxdepth 4 -name 'libmpi.so.12' 2>/dev/null | head -1)")
  [ -n "$pkgs" ] && export PYTHONPATH=$pkgs${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONPATH=$ROOT/pyx${PYTHONPATH:+:$PYTHONPATH}
  [ "$bin" != . ] && export PATH=$bin:$PATH MPICC=$bin/mpicc
  [ "$lib" != . ] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export HYDRA_LAUNCHER=fork  # one machine: no ssh
  MPIEXEC=$(command -v mpiexec || true)
  export MPIEXEC
  # NVIDIA's tools live beside nvcc when not on PATH
  local nv
  nv=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -x "$nv" ] && export PATH=$PATH:$(dirname "$nv")
  SANITIZER=$(command -v compute-sanitizer || true)
  if [ -d .gpu-cache ]; then
    export GS_REAL_NVCC=$nv GS_NVCC_CACHE=$ROOT/.gpu-cache NVCC=$ROOT/scripts/nvcc_cache.sh
  fi
  GS_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || cat .gpu-cache/commit 2>/dev/null || echo unknown)
  export GS_COMMIT
}

info() {
  {
    echo "date: $(date -u +%FT%TZ)   commit: $GS_COMMIT"
    nvidia-smi || echo "nvidia-smi: not available"
    nvidia-smi -L || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    echo "uname: $(uname -a)"; echo "nproc: $(nproc)"
    "$PY" --version; echo "python: $(command -v "$PY")"
    "${NVCC:-nvcc}" --version 2>/dev/null | tail -2 || echo "nvcc: not found"
    echo "compute-sanitizer: ${SANITIZER:-not found}"
    [ -n "$SANITIZER" ] && "$SANITIZER" --version | tail -1
    echo "mpicc: ${MPICC:-$(command -v mpicc || echo none)}   mpiexec: ${MPIEXEC:-none}"
    "$PY" - <<'EOF'
import importlib
for name in ("numpy", "torch", "cupy", "jax", "mpi4py", "Cython", "ml_dtypes", "pytest",
             "pytest_mpi", "hypothesis", "pycuda", "nvidia.nccl"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
try:
    import torch
    print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
    if torch.cuda.is_available():
        print("torch nccl", torch.cuda.nccl.version(), "gpu", torch.cuda.get_device_name())
    print("torch.Tensor.__dlpack_c_exchange_api__:",
          hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
except Exception as exc:
    print("torch:", exc)
try:
    import mpi4py.MPI as MPI
    print("mpi4py MPI library:", MPI.Get_library_version().splitlines()[0])
except Exception as exc:
    print("mpi4py.MPI:", exc)
EOF
  } > "$STATE/info.txt" 2>&1
  cat "$STATE/info.txt"
}

# ---------------------------------------------------------------- build
source_hash() {
  { echo "$GRADSYNC_CUDA_ARCHS ${MPICC:-}"; cat setup.py src/* include/* pyx/gradsync/*.pyx \
      pyx/gradsync/*.pxi pyx/gradsync/*.pxd tests/c/*.c tests/c/*.h; } | sha1sum | cut -c1-40
}

build() {
  local want
  want=$(source_hash)
  if [ -f "$STATE/build.sha" ] && [ "$(cat "$STATE/build.sha")" = "$want" ] &&
     [ -x tests/c/bin/test_device_paths ] && "$PY" -c "import gradsync" 2>/dev/null; then
    note "build: these sources are built already (warm machine): skipped"
    return 0
  fi
  rm -f "$STATE/build.sha"
  step build 420 60 "set -e; $PY setup.py -q build_ext --inplace && $PY -c 'import gradsync, json; \
print(json.dumps(gradsync.build_info(), indent=1))' && make --no-print-directory \
tests/c/bin/test_device_paths tests/c/bin/test_device_streams MPICC=\$MPICC"
  if tail -1 "$STATE/steps.tsv" | grep -q "^build	pass"; then
    echo "$want" > "$STATE/build.sha"
  fi
}

# ---------------------------------------------------------------- steps
PYTEST="$PY -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider -rs"

run_named() {
  case $1 in
    visible) step visible 60 10 "$PY scripts/gpu_visible.py && $PY -c 'import gradsync as g; \
i = g.build_info(); print(\"cuda_devices\", i[\"cuda_devices\"], \"nccl\", i[\"nccl\"], \
\"archs\", i[\"cuda_archs\"], \"error\", i[\"cuda_error\"]); assert i[\"cuda_devices\"] > 0'" ;;
    c_np1) step c_np1 150 20 "$MPIEXEC -n 1 tests/c/bin/test_device_paths" ;;
    c_np2) step c_np2 200 20 "$MPIEXEC -n $NP2 tests/c/bin/test_device_paths" ;;
    c_streams) step c_streams 90 10 "$MPIEXEC -n 1 tests/c/bin/test_device_streams && \
$MPIEXEC -n $NP2 tests/c/bin/test_device_streams" ;;
    pytest_np1) step pytest_np1 330 60 "$MPIEXEC -n 1 $PYTEST tests/gpu tests/python/test_dlpack.py" ;;
    pytest_np2) step pytest_np2 330 60 "$MPIEXEC -n $NP2 $PYTEST tests/gpu tests/python/test_dlpack.py" ;;
    bench_np1) step bench_np1 240 60 "$MPIEXEC -n 1 $PY -m gradsync.bench.gpu \
--only accumulate,bert,allreduce --max-seconds 20 --json $STATE/bench_np1.json" ;;
    bench_np2) step bench_np2 300 90 "$MPIEXEC -n $NP2 $PY -m gradsync.bench.gpu --only train \
--max-seconds 90 --json $STATE/bench_np2.json --trace-dir $STATE/traces" ;;
    memcheck|racecheck)
      if [ -z "$SANITIZER" ]; then
        note "$1: compute-sanitizer not found: SKIPPED"
        printf '%s\tskipped\t0\t-\n' "$1" >> "$STATE/steps.tsv"
      else
        # racecheck: gradsync's kernels (races inside NCCL's are NCCL's)
        local only=""
        [ "$1" = racecheck ] && "$SANITIZER" --help 2>/dev/null | grep -q kernel-name-exclude &&
          only="--kernel-name-exclude kns=nccl"
        step "$1" "${GS_SANITIZER_SECONDS:-240}" 60 "GRADSYNC_NCCL=0 $MPIEXEC -n 1 $SANITIZER --tool $1 $only \
--error-exitcode 3 --print-limit 50 tests/c/bin/test_device_paths"
      fi ;;
    *) note "unknown step $1"; return 1 ;;
  esac
}

TESTS="visible c_np1 c_np2 c_streams pytest_np1 pytest_np2"
BENCH="bench_np1 bench_np2"
SANI="memcheck racecheck"
expand() {
  local w
  for w in "$@"; do
    case $w in
      tests) echo $TESTS ;; bench) echo $BENCH ;; sanitizer) echo $SANI ;;
      all) echo $TESTS $BENCH $SANI ;;
      retry) awk -F'\t' '!($1 in s) {o[++n] = $1} {s[$1] = $2}
               END {for (i = 1; i <= n; i++) if (s[o[i]] != "pass") print o[i]}' \
               "$STATE/steps.tsv" | grep -vx build ;;
      *) echo "$w" ;;
    esac
  done
}

finish() {
  write_summary
  cp -f "$STATE"/bench_np*.json "$OUTD"/ 2>/dev/null
  "$PY" - "$STATE" "$OUTD/bench.json" <<'EOF' 2>/dev/null
import glob, json, os, sys
merged = {}
for p in sorted(glob.glob(os.path.join(sys.argv[1], "bench_np*.json"))):
    with open(p) as f:
        merged[os.path.basename(p)[:-5]] = json.load(f)
with open(sys.argv[2], "w") as f:
    json.dump(merged, f, indent=1)
EOF
  rm -f "$OUTD"/bench_np*.json
  # traces can be large: they go alone, and only while under 15 MiB compressed
  tar -C "$STATE" -czf "$OUTD/logs.tar.gz" logs info.txt steps.tsv $(cd "$STATE" && ls *.json 2>/dev/null) 2>/dev/null
  if [ -n "$(ls "$STATE/traces" 2>/dev/null)" ]; then
    tar -C "$STATE" -czf "$OUTD/traces.tar.gz" traces
    [ "$(stat -c %s "$OUTD/traces.tar.gz")" -lt $((15 * 1024 * 1024)) ] ||
      { rm -f "$OUTD/traces.tar.gz"; note "traces over 15 MiB compressed: not returned"; }
  fi
  echo; cat "$OUTD/summary.txt"
}
trap finish EXIT

setup
note "session: $* (budget ${BUDGET}s; state in $STATE)"
info > "$LOGS/info.log" 2>&1
head -30 "$STATE/info.txt" >> "$SESSION_LOG"
build
for s in $(expand "${@:-tests}"); do
  [ "$s" = build ] && continue
  run_named "$s"
done
