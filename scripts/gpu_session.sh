#!/bin/bash
# The GPU session (issues 13 and 30), on the device machine: ONE call of at
# most GS_SESSION_SECONDS (470 s) that yields the most evidence, in priority
# order. docs/GPU.md gives the exact device-tool call. Usage:
#
#   bash scripts/gpu_session.sh [STEP|GROUP ...]      (default: all)
#   bash scripts/gpu_session.sh --source-hash         (the build key; no run)
#
# Steps, in this order (GROUP all):
#   visible      gradsync sees the GPU nvidia-smi lists
#   c_np1 c_np2  tests/c/bin/test_device_paths on the real runtime, 1 rank
#                (staged MPI, then NCCL) and 2 ranks sharing the GPU
#   pytest_np1   tests/gpu and tests/python/test_dlpack.py at 1 rank
#   memcheck     compute-sanitizer memcheck, test_device_paths at 2 ranks
#   initcheck    compute-sanitizer initcheck, test_device_paths at 1 rank
#   nccl_shared  NCCL 2.30+'s multi-rank-per-GPU mode (NCCL_MULTI_RANK_GPU_ENABLE=1):
#                tests/gpu/test_nccl_ranks.py at 2 ranks over NCCL on one GPU
#                (skipped when the device's NCCL is older)
#   probes       scripts/gpu_probes.py: issue 30's defects on hardware
#   bench        bench.gpu: accumulate_ vs copy, BERT-base list,
#                ResNet-50 allreduce vs torch.distributed NCCL (1 rank)
# Also (not in all): pytest_np2, racecheck, bench_train (2-rank training).
# GROUP wire (issue 32, item 5: the wire allreduce on CUDA memory):
#   visible, then
#   wire_np1     tests/gpu/test_device_wire.py at 1 rank
#   wire_np2     the same at 2 ranks on the GPU (MPI device path)
#   wire_nccl    the same and test_device_exchange.py at 2 ranks over NCCL on one
#                GPU (NCCL_MULTI_RANK_GPU_ENABLE=1; the grouped send/receive;
#                skipped when the device's NCCL is older than 2.30)
#   wire_memcheck compute-sanitizer memcheck on test_device_wire.py at 1 rank
#   wire_bench   bench.gpu --only wire: the kernels' time and bandwidth
#   wire_profile bench.gpu_wire: torch.profiler's kernel table of one call (not in the group)
# GROUP nccl2 (issue 50: two NCCL ranks sharing the one GPU, through the
#   carried NCCL of scripts/build_nccl.sh in .nccl/, 2.30+; each step runs
#   with NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0): visible, then
#   nccl_shared, nccl_latency (bench.gpu --only latency, gradsync vs torch
#   NCCL on the same library), nccl_allreduce (the ResNet-50 list vs torch
#   per tensor and one flat call), wire_nccl, nccl_c2 (the C device-path
#   test over NCCL; test_nccl_faults needs the emulated NCCL's fault
#   switches, and the hardware's faults are in test_nccl_ranks.py),
#   nccl_pytest2 (tests/gpu at 2 ranks)
#
# Each step runs under its own timeout and keeps its log; a failing step
# never stops the next. A step's timeout is its cap, cut so the steps after
# it keep their minimum; one that cannot get its own minimum is recorded
# as skipped. After every step the results are rewritten under $OUT, so a
# call cut short still returns them (at most 8 files): session.log (every
# step's output as it runs), summary.txt (the table, printed last too),
# info.txt, bench.json, probes.json, logs.tar.gz (each step's log).
#
# The build comes from .gpu-build/ (scripts/gpu_prepare.sh, run before the
# call on the machine without a GPU) when its MANIFEST's hash matches these
# sources; otherwise it is built here (a minute or two of the lease).
# Without $OUT the files go to build/gpu-session/out.
#
#   GS_SESSION_DRY=1  a dry run on a machine without a GPU (`make test`):
#                     the emulated CUDA runtime, tiny budgets, bench
#                     --dry-run; proves the script, not the hardware
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1

# The build's key: every file the build reads, one "sha1  path" line each
# (C locale order: glob order follows LC_COLLATE). The carried build's
# MANIFEST lists the same lines, so the device compares file by file and
# names what differs; files only the device has (a leftover of a rename,
# say) do not count.
source_files() {
  LC_ALL=C
  ls setup.py Makefile $(find src -type f) include/* pyx/gradsync/*.pyx pyx/gradsync/*.pxi \
    pyx/gradsync/*.pxd tests/c/*.c tests/c/*.h tests/emulated_cuda/* 2>/dev/null
}
source_sums() { source_files | LC_ALL=C xargs sha1sum; }
source_hash() { source_sums | sha1sum | cut -c1-40; }
if [ "${1:-}" = --source-hash ]; then
  source_hash
  exit 0
fi
if [ "${1:-}" = --source-sums ]; then
  source_sums
  exit 0
fi

T0=$(date +%s)
DRY=${GS_SESSION_DRY:-0}
BUDGET=${GS_SESSION_SECONDS:-470}
STATE=${GS_SESSION_STATE:-$ROOT/build/gpu-session}
BUNDLE=${GS_BUNDLE:-$ROOT/.gpu-build}
NCCL_BUNDLE=${GS_NCCL_BUNDLE:-$ROOT/.nccl}
LOGS=$STATE/logs
OUTD=${OUT:-$STATE/out}
SITE=${GS_SITE:-/tmp/gs-site}
rm -rf "$LOGS" "$STATE/steps.tsv"
mkdir -p "$LOGS" "$OUTD"
: > "$STATE/steps.tsv"
SESSION_LOG=$OUTD/session.log
: > "$SESSION_LOG"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export GRADSYNC_TIMEOUT_SECONDS=${GRADSYNC_TIMEOUT_SECONDS:-60} # a hang is an error
PY=${PYTHON:-python3}
PYTEST="$PY -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider -rs"
# the dry run proves the command lines, not the suites (make test-emulated runs them)
GPU_TESTS=${GS_GPU_TESTS:-tests/gpu tests/python/test_dlpack.py}
# the dry run proves the step, not the suite (test-emulated runs the suite)
[ "$DRY" = 1 ] && GPU_TESTS=${GS_GPU_TESTS:-tests/gpu/test_device_arrays.py::test_build_info_reports_cuda \
tests/gpu/test_device_arrays.py::test_device_array_round_trip \
tests/gpu/test_device_arrays.py::test_broadcast}
WIRE_TESTS="tests/gpu/test_device_wire.py tests/gpu/test_device_wire_torch.py"
WIRE_NCCL_TESTS="tests/gpu/test_device_wire.py tests/gpu/test_device_exchange.py"
[ "$DRY" = 1 ] && WIRE_TESTS="tests/gpu/test_device_wire.py::test_device_refusals" &&
  WIRE_NCCL_TESTS="tests/gpu/test_device_wire.py::test_device_half_inputs_fp8_wire"

note() { echo "[gpu_session $(date +%H:%M:%S) +$(($(date +%s) - T0))s] $*" | tee -a "$SESSION_LOG"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }

# ---------------------------------------------------------------- the plan
# name cap min (seconds): the cap bounds the step; the min is what it needs
# to be worth starting, and what earlier steps leave it.
declare -A CAP MIN
plan() {
  CAP[$1]=$2
  MIN[$1]=$3
}
plan visible 40 5
plan c_np1 70 15
plan c_np2 70 15
plan pytest_np1 130 40
plan memcheck 100 30
plan initcheck 60 20
plan nccl_shared 120 30
plan probes 70 25
plan bench 90 40
plan pytest_np2 150 40
plan racecheck 150 40
plan bench_train 200 90
plan wire_np1 60 20
plan wire_np2 90 30
plan wire_nccl 90 30
plan wire_memcheck 120 40
plan wire_bench 70 30
plan wire_profile 60 20
plan nccl_c2 80 20
plan nccl_latency 100 40
plan nccl_allreduce 100 40
plan nccl_pytest2 180 60
ALL="visible c_np1 c_np2 pytest_np1 memcheck initcheck nccl_shared probes bench"
WIRE="visible wire_np1 wire_np2 wire_nccl wire_bench wire_memcheck"
# GROUP nccl2 (issue 50): two NCCL ranks sharing the one GPU, through the
# carried NCCL 2.30+ (scripts/build_nccl.sh)
NCCL2="visible nccl_shared nccl_latency nccl_allreduce wire_nccl nccl_c2 nccl_pytest2"
if [ "$DRY" = 1 ]; then # proves the script: each step a few seconds
  for k in "${!CAP[@]}"; do
    CAP[$k]=${GS_DRY_CAP:-60}
    MIN[$k]=1
  done
fi

# ---------------------------------------------------------------- results
write_results() {
  "$PY" scripts/gpu_summary.py "$STATE" > "$OUTD/summary.txt" 2>&1 || true
  cp -f "$STATE/info.txt" "$OUTD/info.txt" 2>/dev/null
  [ -f "$STATE/bench_np1.json" ] && cp -f "$STATE/bench_np1.json" "$OUTD/bench.json"
  [ -f "$STATE/probes.json" ] && cp -f "$STATE/probes.json" "$OUTD/probes.json"
  local b
  for b in "$STATE"/bench_np2_*.json; do [ -f "$b" ] && cp -f "$b" "$OUTD/"; done
  tar -C "$STATE" -czf "$OUTD/logs.tar.gz.tmp" logs steps.tsv 2>/dev/null &&
    mv -f "$OUTD/logs.tar.gz.tmp" "$OUTD/logs.tar.gz"
}

# step NAME REST COMMAND: runs COMMAND (bash) under a timeout of its cap,
# cut so the steps named in REST keep their minimum.
step() {
  local name=$1 rest=$2 cmd=$3 reserve=0 r avail t rc start status
  for r in $rest; do reserve=$((reserve + ${MIN[$r]:-0})); done
  avail=$(($(left) - 10 - reserve))
  # the steps come in priority order: when the time left cannot give every
  # later step its minimum, this one still gets its own
  [ "$avail" -lt "${MIN[$name]}" ] && avail=$(($(left) - 10))
  if [ "$avail" -lt "${MIN[$name]}" ]; then
    note "$name: SKIPPED (${avail}s left, needs ${MIN[$name]}s)"
    printf '%s\tskipped\t0\t-\n' "$name" >> "$STATE/steps.tsv"
    return 0
  fi
  t=${CAP[$name]}
  [ "$avail" -lt "$t" ] && t=$avail
  note "== $name (timeout ${t}s): $cmd"
  start=$(date +%s)
  # timeout signals the process group it leads: mpiexec and its ranks too
  timeout -k 5 "$t" bash -c "$cmd" > "$LOGS/$name.log" 2>&1
  rc=$?
  cat "$LOGS/$name.log" >> "$SESSION_LOG"
  status=pass
  [ "$rc" = 0 ] || status=fail
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status=timeout
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" "$rc" >> "$STATE/steps.tsv"
  note "$name: $status (rc $rc, $(($(date +%s) - start))s)"
  write_results
}

skip_step() {
  note "$1: SKIPPED ($2)"
  printf '%s\tskipped\t0\t-\n' "$1" >> "$STATE/steps.tsv"
}

# ---------------------------------------------------------------- setup
setup() {
  # --prefix, not --target: the mpich wheel's libraries are data files that
  # pip --target drops (its lib/ clashes with the target's own)
  if [ "$DRY" != 1 ] && ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
      --prefix "$SITE" .whl/*.whl || note "setup: installing the carried wheels FAILED"
  elif [ "$DRY" != 1 ]; then
    note "setup: no .whl/ carried (scripts/gpu_prepare.sh makes it): using what is installed"
  fi
  local pkgs bin lib nccl
  pkgs=$(find "$SITE" -maxdepth 6 -type d \( -name site-packages -o -name dist-packages \) \
    2> /dev/null | head -1)
  bin=$(dirname "$(find "$SITE" -maxdepth 4 -path '*/bin/mpicc' 2> /dev/null | head -1)")
  lib=$(dirname "$(find "$SITE" -maxdepth 4 -name 'libmpi.so.12' 2> /dev/null | head -1)")
  [ -n "$pkgs" ] && [ "$DRY" != 1 ] && export PYTHONPATH=$pkgs${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONPATH=$ROOT/pyx:$ROOT:$ROOT/tests/python${PYTHONPATH:+:$PYTHONPATH}
  [ "$bin" != . ] && [ "$DRY" != 1 ] && export PATH=$bin:$PATH MPICC=$bin/mpicc
  [ "$lib" != . ] && [ "$DRY" != 1 ] &&
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # the C tests find libgradsync here (their RUNPATH names the build machine's tree)
  export LD_LIBRARY_PATH=$ROOT/pyx/gradsync${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export HYDRA_LAUNCHER=fork # one machine: no ssh
  MPIEXEC=${MPIEXEC:-$(command -v mpiexec || true)}
  # NCCL: the carried one (scripts/build_nccl.sh: 2.30+, two ranks on one
  # GPU) for gradsync and, preloaded by its SONAME, for torch too; else the
  # device's own wheel (torch's), not the build machine's path
  if [ -f "$NCCL_BUNDLE/libnccl.so.2.xz" ]; then
    nccl=$("$PY" scripts/nccl_bundle.py unpack "$NCCL_BUNDLE" "$SITE/nccl") ||
      note "setup: unpacking the carried NCCL FAILED"
    # the dry run's stand-in is a copy of the emulated runtime, which must
    # not load beside the bundle's own: unpacked and checked, not used
    if [ -f "$nccl" ] && [ "$DRY" != 1 ]; then
      export GRADSYNC_NCCL_LIBRARY=$nccl LD_PRELOAD=$nccl${LD_PRELOAD:+:$LD_PRELOAD}
      note "setup: the carried NCCL ($(grep -h '^version' "$NCCL_BUNDLE/MANIFEST")) at $nccl, preloaded for torch"
    elif [ -f "$nccl" ]; then
      note "setup: the carried NCCL unpacked at $nccl (dry run: not loaded)"
    fi
  else
    nccl=$("$PY" -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], \
'lib', 'libnccl.so.2'))" 2> /dev/null)
    [ "$DRY" != 1 ] && [ -f "$nccl" ] && export GRADSYNC_NCCL_LIBRARY=${GRADSYNC_NCCL_LIBRARY:-$nccl}
  fi
  local nv
  nv=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -x "$nv" ] && export PATH=$PATH:$(dirname "$nv")
  SANITIZER=$(command -v compute-sanitizer || true)
  if [ "$DRY" = 1 ]; then # a stand-in: runs the program, says what the tool would
    SANITIZER=$STATE/dry-sanitizer
    printf '%s\n' '#!/bin/bash' 'while [ "${1#-}" != "$1" ]; do case $1 in' \
      '--tool|--print-limit|--error-exitcode|--kernel-name-exclude|--report-api-errors) shift 2 ;; *) shift ;;' \
      'esac; done; "$@" && echo "========= ERROR SUMMARY: 0 errors (dry run)"' > "$SANITIZER"
    chmod +x "$SANITIZER"
  fi
  GS_COMMIT=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
  export GS_COMMIT
}

info() {
  {
    echo "date: $(date -u +%FT%TZ)   commit: $GS_COMMIT   dry: $DRY"
    echo "bundle: $(tr '\n' ' ' < "$BUNDLE/MANIFEST" 2> /dev/null || echo none)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 ||
      echo "nvidia-smi: not available"
    echo "uname: $(uname -a)"
    echo "nproc: $(nproc)"
    "$PY" --version
    nvcc --version 2> /dev/null | tail -2 || echo "nvcc: not found"
    echo "compute-sanitizer: ${SANITIZER:-not found}"
    [ -n "$SANITIZER" ] && [ "$DRY" != 1 ] && "$SANITIZER" --version | tail -1
    echo "mpiexec: ${MPIEXEC:-none}   GRADSYNC_NCCL_LIBRARY: ${GRADSYNC_NCCL_LIBRARY:-unset}"
    "$PY" - << 'EOF'
import importlib
for name in ("numpy", "torch", "cupy", "mpi4py", "ml_dtypes", "pytest", "pytest_mpi",
             "nvidia.nccl"):
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
except Exception as exc:
    print("torch:", exc)
try:
    import mpi4py.MPI as MPI
    print("mpi4py MPI library:", MPI.Get_library_version().splitlines()[0])
except Exception as exc:
    print("mpi4py.MPI:", exc)
try:
    import gradsync as gs
    i = gs.build_info()
    print("gradsync:", {k: i.get(k) for k in ("cuda_devices", "cuda_archs", "cuda_error",
                                              "nccl", "cuda", "mpi_library")})
except Exception as exc:
    print("gradsync: not importable:", exc)
EOF
  } > "$STATE/info.txt" 2>&1
}

# ---------------------------------------------------------------- build
# The bundle when it matches these sources, else a build here.
build() {
  local have stale
  have=$(sed -n 's/^hash //p' "$BUNDLE/MANIFEST" 2> /dev/null)
  # the bundle's files, checked here one by one (sha1sum -c), not a hash of
  # whatever this tree holds
  if [ -f "$BUNDLE/SOURCES" ]; then
    stale=$(LC_ALL=C sha1sum --quiet -c "$BUNDLE/SOURCES" 2>&1 | head -5)
  else
    stale="no $BUNDLE/SOURCES"
  fi
  if [ -z "$stale" ]; then
    cp -f "$BUNDLE"/pyx/gradsync/* pyx/gradsync/ && mkdir -p tests/c/bin &&
      cp -f "$BUNDLE"/tests/c/bin/* tests/c/bin/
    if "$PY" -c "import gradsync" > "$LOGS/build.log" 2>&1 &&
      ! ldd tests/c/bin/test_device_paths | grep -q 'not found'; then
      note "build: the carried build ($BUNDLE, hash ${have:0:12}) imports and links: no compile"
      printf 'build\tpass\t0\t0\n' >> "$STATE/steps.tsv"
      return 0
    fi
    note "build: the carried build does not load here ($(tail -1 "$LOGS/build.log")): building"
  else
    note "build: the carried build is not of these sources ($(echo "$stale" | tr '\n' ' ')): building"
  fi
  CAP[build]=300
  MIN[build]=60
  step build "" "set -e; GRADSYNC_CUDA=1 GRADSYNC_CUDA_ARCHS=90 $PY setup.py -q build_ext --inplace \
&& $PY -c 'import gradsync' && make --no-print-directory -s tests/c/bin/test_device_paths \
tests/c/bin/test_device_streams tests/c/bin/test_nccl_faults MPICC=\$MPICC"
}

# ---------------------------------------------------------------- steps
run_named() {
  local name=$1 rest=$2 c=tests/c/bin/test_device_paths
  case $name in
    visible) step visible "$rest" "$PY scripts/gpu_visible.py && $PY -c 'import gradsync as g; \
i = g.build_info(); print(\"cuda_devices\", i[\"cuda_devices\"], \"nccl\", i[\"nccl\"], \
\"archs\", i[\"cuda_archs\"], \"error\", i[\"cuda_error\"]); assert i[\"cuda_devices\"] > 0'" ;;
    c_np1) step c_np1 "$rest" "$MPIEXEC -n 1 $c" ;;
    c_np2) step c_np2 "$rest" "$MPIEXEC -n 2 $c" ;;
    pytest_np1) step pytest_np1 "$rest" "$MPIEXEC -n 1 $PYTEST $GPU_TESTS" ;;
    pytest_np2) step pytest_np2 "$rest" "$MPIEXEC -n 2 $PYTEST $GPU_TESTS" ;;
    memcheck) sanitize memcheck "$rest" 2 ;;
    initcheck) sanitize initcheck "$rest" 1 ;;
    racecheck) sanitize racecheck "$rest" 1 ;;
    nccl_shared) nccl_step nccl_shared "$rest" "$MPIEXEC -n 2 $PYTEST \
tests/gpu/test_nccl_ranks.py tests/gpu/test_device_exchange.py" ;;
    nccl_c2) nccl_step nccl_c2 "$rest" "$MPIEXEC -n 2 tests/c/bin/test_device_paths" ;;
    nccl_pytest2) nccl_step nccl_pytest2 "$rest" "$MPIEXEC -n 2 $PYTEST $GPU_TESTS" ;;
    nccl_latency) nccl_step nccl_latency "$rest" "$MPIEXEC -n 2 $PY -m bench.gpu --only latency \
--json $STATE/bench_np2_latency.json $([ "$DRY" = 1 ] && echo --dry-run)" ;;
    nccl_allreduce) nccl_step nccl_allreduce "$rest" "$MPIEXEC -n 2 $PY -m bench.gpu \
--only allreduce --max-seconds 20 --json $STATE/bench_np2_allreduce.json \
$([ "$DRY" = 1 ] && echo --dry-run)" ;;
    probes) step probes "$rest" "GS_PROBE_MPIEXEC=$MPIEXEC $PY scripts/gpu_probes.py --json $STATE/probes.json \
$([ "$DRY" = 1 ] && echo --dry-run --timeout 12 || echo --timeout 35)" ;;
    bench) step bench "$rest" "$MPIEXEC -n 1 $PY -m bench.gpu \
--only accumulate,bert,allreduce --max-seconds 15 --json $STATE/bench_np1.json \
$([ "$DRY" = 1 ] && echo --dry-run)" ;;
    wire_np1) step wire_np1 "$rest" "$MPIEXEC -n 1 $PYTEST $WIRE_TESTS" ;;
    wire_np2) step wire_np2 "$rest" "$MPIEXEC -n 2 $PYTEST $WIRE_TESTS" ;;
    wire_nccl)
      nccl_step wire_nccl "$rest" "$MPIEXEC -n 2 $PYTEST $WIRE_NCCL_TESTS && \
$MPIEXEC -n 2 $PY -c 'import gradsync as g, numpy as np; \
c = g.Communicator(); x = g.to_device(np.ones(4, np.float32)); c.allreduce_(x, wire=\"bfloat16\"); \
print(\"device transport\", c.device_transport, x.numpy())'" ;;
    wire_memcheck)
      if [ -z "$SANITIZER" ]; then skip_step wire_memcheck "compute-sanitizer not found"; else
        step wire_memcheck "$rest" "$MPIEXEC -n 1 $SANITIZER --tool memcheck --report-api-errors no \
--error-exitcode 3 --print-limit 50 $PY -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider \
$([ "$DRY" = 1 ] && echo "$WIRE_TESTS" || echo "tests/gpu/test_device_wire.py -k 'not large'")"
      fi ;;
    wire_profile) step wire_profile "$rest" "$MPIEXEC -n 1 $PY -m bench.gpu_wire bfloat16 && \
$MPIEXEC -n 1 $PY -m bench.gpu_wire float8_e4m3" ;;
    wire_bench) step wire_bench "$rest" "$MPIEXEC -n 1 $PY -m bench.gpu --only wire \
--max-seconds 10 --json $STATE/bench_np1.json $([ "$DRY" = 1 ] && echo --dry-run)" ;;
    bench_train) step bench_train "$rest" "$MPIEXEC -n 2 $PY -m bench.gpu --only train \
--max-seconds 90 --json $STATE/bench_np2.json --trace-dir $STATE/traces \
$([ "$DRY" = 1 ] && echo --dry-run)" ;;
    *)
      note "unknown step $name"
      return 1
      ;;
  esac
}

# nccl_step NAME REST COMMAND: a step whose ranks share the one GPU over
# NCCL (2.30+'s NCCL_MULTI_RANK_GPU_ENABLE=1, for gradsync's NCCL and
# torch's alike); skipped when the NCCL loaded is older. NVLS off: NVSwitch
# multicast is no single GPU's, and the carried build leaves its kernels out.
nccl_step() {
  if ! nccl_shares_gpu; then
    skip_step "$1" "the NCCL loaded is older than 2.30 (no multi-rank-per-GPU mode)"
  else
    step "$1" "$2" "export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0; $3"
  fi
}

# Whether NCCL can put two ranks on one GPU (2.30+, NCCL_MULTI_RANK_GPU_ENABLE).
nccl_shares_gpu() {
  [ "$DRY" = 1 ] || "$PY" -c "import gradsync as g, sys; \
v = (g.build_info()['nccl'] or '0.0').split('.'); sys.exit(0 if (int(v[0]), int(v[1])) >= (2, 30) else 1)" \
    2> /dev/null
}

# sanitize TOOL REST RANKS: compute-sanitizer on the C device-path test
# (NCCL's own kernels are NCCL's: left out of racecheck and initcheck)
sanitize() {
  local tool=$1 rest=$2 np=$3 only=""
  if [ -z "$SANITIZER" ]; then
    skip_step "$tool" "compute-sanitizer not found"
    return 0
  fi
  [ "$tool" != memcheck ] && [ "$DRY" != 1 ] &&
    "$SANITIZER" --help 2> /dev/null | grep -q kernel-name-exclude &&
    only="--kernel-name-exclude kns=nccl"
  step "$tool" "$rest" "$MPIEXEC -n $np $SANITIZER --tool $tool $only \
--error-exitcode 3 --print-limit 50 tests/c/bin/test_device_paths"
}

expand() {
  local w
  for w in "$@"; do
    case $w in
      all) echo $ALL ;;
      wire) echo $WIRE ;;
      nccl2) echo $NCCL2 ;;
      *) echo "$w" ;;
    esac
  done
}

trap 'write_results; echo; cat "$OUTD/summary.txt"' EXIT

setup
note "session: ${*:-all} (budget ${BUDGET}s; state in $STATE; dry $DRY)"
build
info
cat "$STATE/info.txt" >> "$SESSION_LOG"
write_results
# each step once, in its first place, however many of the groups named hold it
STEPS=$(expand "${@:-all}" | tr ' ' '\n' | awk 'NF && !seen[$0]++' | tr '\n' ' ')
set -- $STEPS
while [ $# -gt 0 ]; do
  s=$1
  shift
  [ "$s" = build ] && continue
  run_named "$s" "$*"
done
