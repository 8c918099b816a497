#!/bin/bash
# Run HERE (the machine without a GPU, in the repository the device tool
# sends) before the GPU session: builds everything the device machine
# would otherwise spend lease minutes building, into two ignored folders.
#
#   .whl/        wheels for Python 3.12 x86-64: mpich (gradsync links it;
#                the device has no MPI library), mpi4py built for it,
#                pytest-mpi (the device has pytest and hypothesis already)
#   .gpu-build/  gradsync built for the device: the extension for CPython
#                3.12, libgradsync.so with the kernels compiled for sm_90
#                and the real (static) CUDA runtime, the C test binaries,
#                and MANIFEST (the sources' hash: scripts/gpu_session.sh
#                uses the build only when its checkout has the same hash,
#                and builds there otherwise)
#
# The build runs in a copy of the checkout (build/gpu-prep/tree), so this
# checkout's own build (the Python it runs `make` with) is untouched. It
# needs a CPython 3.12 (GS_PREP_PYTHON, else python3.12 on PATH, else
# pyenv's) and nvcc. Name both folders in the device tool's `carry`
# (docs/GPU.md has the call). Takes a few minutes; run again after any
# change to src/, include/, pyx/ or tests/c/.
#
#   GS_PREP_DRY=1   build against the emulated CUDA runtime instead (what
#                   `make test` does to dry-run the session script here)
set -eu
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
PREP=${GS_PREP_DIR:-$ROOT/build/gpu-prep}
for ignored in /.whl/ /.gpu-build/; do
  grep -qx "$ignored" .gitignore ||
    { echo "gpu_prepare.sh: .gitignore must ignore $ignored" >&2; exit 1; }
done

# ---- wheels (the versions tested with this repository) ------------------
WHEELS="mpich==4.3.2 mpi4py==4.1.2 pytest-mpi==0.6"  # mpich < 5: docs/decisions/launch.md
[ "${GS_PREP_DRY:-0}" = 1 ] && WHEELS=""
mkdir -p .whl
for spec in $WHEELS; do
  name=${spec%%==*}
  ls .whl/"${name//-/_}"-"${spec##*==}"-*.whl >/dev/null 2>&1 && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$spec"
done
for name in ${WHEELS:+mpich mpi4py pytest_mpi}; do # one of each: two stop the install there
  n=$(ls .whl/"$name"-*.whl 2>/dev/null | wc -l)
  [ "$n" = 1 ] || { echo "gpu_prepare.sh: $n wheels of $name in .whl (want 1)" >&2; exit 1; }
done

# ---- a Python 3.12 with the carried MPI ---------------------------------
DRY=${GS_PREP_DRY:-0}
if [ "$DRY" = 1 ]; then # this machine's Python and MPI (make test's dry run)
  BPY=$(command -v "$PY")
  BMPICC=${MPICC:-$(command -v mpicc || echo "$("$PY" -c "import sysconfig; print(sysconfig.get_path('scripts'))")/mpicc")}
else
  PY312=""
  for cand in ${GS_PREP_PYTHON:-} python3.12 \
    $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 2>/dev/null); do
    # a pyenv shim exists but may refuse to run: ask the candidate itself
    if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY312=$cand
      break
    fi
  done
  [ -n "$PY312" ] || { echo "gpu_prepare.sh: no CPython 3.12 (set GS_PREP_PYTHON)" >&2; exit 1; }
  VENV=$PREP/venv
  if [ ! -x "$VENV/bin/mpicc" ]; then
    "$PY312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps .whl/*.whl
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "numpy>=2" "cython>=3" \
      setuptools nvidia-nccl-cu13 ml_dtypes
  fi
  BPY=$VENV/bin/python
  BMPICC=$VENV/bin/mpicc
fi

# ---- the build, in a copy of the tracked sources -------------------------
TREE=$PREP/tree
rm -rf "$TREE" && mkdir -p "$TREE"
# what the device tool sends: tracked files and untracked ones git does not ignore
git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null |
  tar -C "$TREE" -xf -
HASH=$(bash scripts/gpu_session.sh --source-hash)
SUMS=$(bash scripts/gpu_session.sh --source-sums)
if [ "$DRY" = 1 ]; then
  # this checkout's own builds (make build, and the emulated runtime that
  # make test-emulated builds) stand in: the dry run proves the session
  make --no-print-directory -s build/emulated/libgradsync.so tests/c/bin/test_device_paths \
    tests/c/bin/test_device_streams tests/c/bin/test_nccl_faults > "$PREP/build.log" 2>&1 ||
    { tail -30 "$PREP/build.log"; echo "gpu_prepare.sh: build failed" >&2; exit 1; }
  mkdir -p "$TREE/tests/c/bin"
  cp pyx/gradsync/_core.cpython-*.so "$TREE/pyx/gradsync/"
  cp build/emulated/libgradsync.so "$TREE/pyx/gradsync/libgradsync.so"
  cp tests/c/bin/test_device_paths tests/c/bin/test_device_streams tests/c/bin/test_nccl_faults \
    "$TREE/tests/c/bin/"
else
  (
    cd "$TREE"
    export PATH=$(dirname "$BMPICC"):$PATH MPICC=$BMPICC PYTHON=$BPY
    GRADSYNC_CUDA=1 GRADSYNC_CUDA_ARCHS=90 "$BPY" setup.py -q build_ext --inplace
    make --no-print-directory -s tests/c/bin/test_device_paths tests/c/bin/test_device_streams \
      tests/c/bin/test_nccl_faults
  ) > "$PREP/build.log" 2>&1 ||
    { tail -30 "$PREP/build.log"; echo "gpu_prepare.sh: build failed" >&2; exit 1; }
fi

OUTB=${GS_PREP_OUT:-$ROOT/.gpu-build}
rm -rf "$OUTB" && mkdir -p "$OUTB/pyx/gradsync" "$OUTB/tests/c/bin"
cp "$TREE"/pyx/gradsync/_core.cpython-*.so "$TREE/pyx/gradsync/libgradsync.so" \
  "$OUTB/pyx/gradsync/"
# libgradsync needs libgomp (OpenMP); a device image without gcc may lack it
gomp=$(gcc -print-file-name=libgomp.so.1 2>/dev/null)
[ -f "$gomp" ] && cp -L "$gomp" "$OUTB/pyx/gradsync/libgomp.so.1"
cp "$TREE"/tests/c/bin/test_device_paths "$TREE"/tests/c/bin/test_device_streams \
  "$TREE"/tests/c/bin/test_nccl_faults "$OUTB/tests/c/bin/"
{
  echo "hash $HASH"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo +changes)"
  echo "built $(date -u +%FT%TZ) on $(uname -n) with $("$BPY" --version), $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no nvcc')"
  echo "dry $DRY"
} > "$OUTB/MANIFEST"
echo "$SUMS" > "$OUTB/SOURCES"  # the device checks these, file by file
du -sh .whl "$OUTB"
echo "gpu_prepare.sh: ready ($(head -1 "$OUTB/MANIFEST")); carry [\".whl\", \".gpu-build\"]"
