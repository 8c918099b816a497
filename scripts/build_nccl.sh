#!/bin/bash
# A carryable NCCL (issue 50): NCCL 2.30 or newer built from NVIDIA's source
# for one GPU architecture, stripped and xz-compressed, so that it travels
# to the lent GPU machine beside the gradsync build (the device tool
# carries 64 MiB in all; NVIDIA's wheel holds every architecture and is
# 344 MB). NCCL 2.30 is the first that runs several ranks on one GPU
# (NCCL_MULTI_RANK_GPU_ENABLE=1), which is how the one-GPU machine runs
# gradsync's 2-rank NCCL tests and the latency race against torch's NCCL.
#
#   bash scripts/build_nccl.sh            build into .nccl/ (ignored; carry it)
#   bash scripts/build_nccl.sh --check    check .nccl/ only (no build)
#   bash scripts/build_nccl.sh --pack LIB pack an existing library as the
#                                         bundle (the dry run in make test
#                                         packs the emulated NCCL)
#
# Environment:
#   GS_NCCL_SRC    an NCCL checkout to build (else GS_NCCL_REPO is cloned)
#   GS_NCCL_REPO   default https://github.com/NVIDIA/nccl
#   GS_NCCL_TAG    default v2.30.7-1 (what docs/GPU.md's figures used)
#   GS_NCCL_ARCH   default 90 (sm_90: the H100 and H200); one number
#   GS_NCCL_OUT    default .nccl
#   GS_NCCL_JOBS   make -j (default: nproc)
#   GS_NCCL_FUNCS  NCCL's ONLY_FUNCS filter; default: every collective,
#                  reduction and type but the 8-bit floats, over the ring,
#                  tree and PAT algorithms only (NVLS needs NVSwitch
#                  multicast and CollNet a network plugin: a single GPU
#                  uses neither, and the session sets NCCL_NVLS_ENABLE=0 so
#                  nothing selects them). A function filtered out runs as a
#                  no-op, so the bundle is for the session, not for users.
#                  About 20 minutes on 2 cores (the full set has 60% more
#                  kernels); GS_NCCL_FUNCS="" builds all.
#   GS_NCCL_MAX_MIB  the bundle's limit, default 40
#
# The bundle: libnccl.so.2.xz and MANIFEST (version, architectures, sizes,
# sha1 of the library). On the device, scripts/gpu_session.sh unpacks it and
# points gradsync at it (GRADSYNC_NCCL_LIBRARY) and torch too, by LD_PRELOAD:
# torch's libtorch_cuda.so needs libnccl.so.2 by its SONAME, and a library
# of that SONAME already loaded satisfies the need whatever path torch's
# wheel would search (its RUNPATH into the nvidia-nccl package, or its own
# preloading of that package). The session checks that torch reports the
# carried version (torch.cuda.nccl.version()).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUTB=${GS_NCCL_OUT:-$ROOT/.nccl}
ARCH=${GS_NCCL_ARCH:-90}
TAG=${GS_NCCL_TAG:-v2.30.7-1}
TYPES="(i8|u8|i32|u32|i64|u64|f16|f32|f64|bf16)"
FUNCS=${GS_NCCL_FUNCS-"(SendRecv|(AllGather|AllGatherV|Broadcast) (RING|PAT) *|\
(AllReduce|Reduce) * $TYPES (RING|TREE) *|ReduceScatter * $TYPES (RING|PAT) *)"}
MAX_MIB=${GS_NCCL_MAX_MIB:-40}
WANT_VERSION=${GS_NCCL_MIN_VERSION:-23000} # 2.30: several ranks on one GPU

# check LIB: the version NCCL reports and the architectures its fatbinary
# holds (scripts/nccl_bundle.py), against what was asked for
check() {
  "$PY" "$ROOT/scripts/nccl_bundle.py" check "$1" --arch "$ARCH" \
    --min-version "$WANT_VERSION" ${GS_NCCL_CHECK_FLAGS:-}
}

# pack LIB: strip, check, compress, write the MANIFEST
pack() {
  local lib=$1 tmp
  mkdir -p "$OUTB"
  tmp=$OUTB/libnccl.so.2
  cp -L "$lib" "$tmp"
  strip --strip-unneeded "$tmp" 2> /dev/null || true
  check "$tmp" > "$OUTB/MANIFEST"
  {
    cat "${BUILD:-/dev/null}/FUNCS" 2> /dev/null || echo "funcs (packed: unknown)"
    echo "sha1 $(sha1sum "$tmp" | cut -c1-40)"
    echo "bytes $(stat -c %s "$tmp")"
  } >> "$OUTB/MANIFEST"
  xz -T0 -9 -f "$tmp"
  echo "xz_bytes $(stat -c %s "$tmp.xz")" >> "$OUTB/MANIFEST"
  local mib=$(($(stat -c %s "$tmp.xz") / 1048576))
  if [ "$mib" -ge "$MAX_MIB" ]; then
    echo "build_nccl.sh: $tmp.xz is ${mib} MiB, over the ${MAX_MIB} MiB limit" >&2
    exit 1
  fi
  cat "$OUTB/MANIFEST"
}

case ${1:-} in
  --check)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    xz -dc "$OUTB/libnccl.so.2.xz" > "$tmp/libnccl.so.2"
    check "$tmp/libnccl.so.2"
    exit 0
    ;;
  --pack)
    pack "$2"
    exit 0
    ;;
  "") ;;
  *)
    sed -n '2,30p' "$0"
    exit 2
    ;;
esac

command -v nvcc > /dev/null || { echo "build_nccl.sh: nvcc not found" >&2; exit 1; }
SRC=${GS_NCCL_SRC:-$ROOT/build/nccl-src}
if [ ! -d "$SRC/src" ]; then
  git clone -q --depth 1 --branch "$TAG" "${GS_NCCL_REPO:-https://github.com/NVIDIA/nccl}" "$SRC"
fi
BUILD=${GS_NCCL_BUILD:-$ROOT/build/nccl}
# the toolkit: CUDA_HOME, else the usual place, else beside nvcc (which may
# be a wrapper script elsewhere)
for cand in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
  [ -n "$cand" ] && [ -f "$cand/include/cuda_runtime.h" ] && CUDA_HOME=$cand && break
done
[ -f "${CUDA_HOME:-}/include/cuda_runtime.h" ] ||
  { echo "build_nccl.sh: no CUDA toolkit (cuda_runtime.h) found: set CUDA_HOME" >&2; exit 1; }
echo "build_nccl.sh: NCCL $(git -C "$SRC" describe --tags 2> /dev/null || echo '(no tag)') for sm_$ARCH in $BUILD"
# one architecture's machine code, no PTX: the driver has nothing to compile
# at start, and the library is a tenth of NVIDIA's
make -C "$SRC" -j"${GS_NCCL_JOBS:-$(nproc)}" src.build CUDA_HOME="$CUDA_HOME" \
  BUILDDIR="$BUILD" NVCC_GENCODE="-gencode=arch=compute_$ARCH,code=sm_$ARCH" \
  ONLY_FUNCS="$FUNCS"
echo "funcs ${FUNCS:-all}" > "$BUILD/FUNCS"
pack "$BUILD/lib/libnccl.so.2"
