#!/bin/bash
# Run HERE (the machine without a GPU, in the repository the device tool
# sends) before the GPU session: puts into two ignored folders what
# scripts/gpu_session.sh needs on the device machine, which has no network.
#
#   .whl/        wheels for Python 3.12 x86-64: mpich (gradsync builds
#                against it; the device has no MPI), mpi4py built for it,
#                pytest-mpi (the device has pytest and hypothesis already)
#   .gpu-cache/  src/cuda_kernels.cu compiled for sm_90 with setup.py's flags
#                (scripts/nvcc_cache.sh's key), so the device does not spend
#                lease minutes compiling it; if anything differs there, it
#                compiles as usual
#
# Then name both in the device tool's `carry` (docs/GPU.md has the calls).
# Takes a few minutes (the CUDA compile); run again after changing src/.
set -eu
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
grep -qx '/.whl/' .gitignore && grep -qx '/.gpu-cache/' .gitignore ||
  { echo "gpu_prepare.sh: .gitignore must ignore /.whl/ and /.gpu-cache/" >&2; exit 1; }

# The versions tested with this repository (same as install_deps.sh picks here).
WHEELS="mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6"
mkdir -p .whl
for spec in $WHEELS; do
  name=${spec%%==*}
  ls .whl/"${name//-/_}"-"${spec##*==}"-*.whl >/dev/null 2>&1 && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$spec"
done
# One version of each: two would stop the install on the device.
for name in mpich mpi4py pytest_mpi; do
  n=$(ls .whl/"$name"-*.whl 2>/dev/null | wc -l)
  [ "$n" = 1 ] || { echo "gpu_prepare.sh: $n wheels of $name in .whl (want 1)" >&2; exit 1; }
done

# The CUDA object, exactly as setup.py compiles it with GRADSYNC_CUDA_ARCHS=90
# (its compile_cuda: keep the two in step, or the device just compiles).
NVCC_REAL=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ -x "$NVCC_REAL" ]; then
  tmp=$(mktemp -d)
  for cu in src/*.cu; do
    GS_NVCC_CACHE=$ROOT/.gpu-cache GS_REAL_NVCC=$NVCC_REAL scripts/nvcc_cache.sh \
      -std=c++17 -O3 --fmad=false -Xcompiler -fPIC,-fvisibility=hidden \
      "-I$ROOT/include" "-I$ROOT/src" -DGS_BUILDING_LIBRARY \
      -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
      -c "$ROOT/$cu" -o "$tmp/$(basename "$cu").o"
  done
  rm -rf "$tmp"
  # keep only each source's newest object (the current key: a hit is touched)
  for cu in src/*.cu; do
    ls -t .gpu-cache/"$(basename "$cu" .cu)"-*.o | tail -n +2 | xargs -r rm -f
  done
else
  echo "gpu_prepare.sh: no nvcc here: the device will compile the kernels itself"
fi
mkdir -p .gpu-cache && git rev-parse --short HEAD > .gpu-cache/commit 2>/dev/null || true
du -sh .whl .gpu-cache 2>/dev/null
echo "gpu_prepare.sh: ready; carry [\".whl\", \".gpu-cache\"]"
