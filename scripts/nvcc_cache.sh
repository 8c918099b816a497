#!/bin/bash
# nvcc with a content-addressed object cache, for scripts/gpu_session.sh:
# setup.py compiles src/*.cu through $NVCC, and on the GPU machine every
# minute of compiling is a minute of the lease. An object compiled ahead
# (scripts/gpu_prepare.sh, same flags, same nvcc major.minor) is copied
# instead of compiled; anything else, or any other nvcc call, goes to nvcc.
#
# The key hashes the nvcc release, the arguments (the repository's path and
# the output name taken out) and every file the kernels can include
# (src/*.cu, src/*.cuh, src/*.h, include/*.h): a change to any of them is a
# new key, so a stale object is never used.
#
#   GS_NVCC_CACHE   the cache directory (required)
#   GS_REAL_NVCC    the real nvcc (default: the first nvcc on PATH that is
#                   not this script, else /usr/local/cuda/bin/nvcc)
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
real=${GS_REAL_NVCC:-}
if [ -z "$real" ]; then
  for cand in $(type -ap nvcc) /usr/local/cuda/bin/nvcc; do
    [ "$(readlink -f "$cand")" != "$(readlink -f "${BASH_SOURCE[0]}")" ] && [ -x "$cand" ] &&
      { real=$cand; break; }
  done
fi
[ -n "$real" ] || { echo "nvcc_cache.sh: no nvcc found (set GS_REAL_NVCC)" >&2; exit 127; }

src="" obj="" key_args=() all=()
while [ $# -gt 0 ]; do
  case $1 in
    -c) src=$2; key_args+=("-c" "${2#"$root"/}"); all+=("$1" "$2"); shift 2; continue ;;
    -o) obj=$2; all+=("$1" "$2"); shift 2; continue ;;
  esac
  key_args+=("${1//$root\//}")
  all+=("$1")
  shift
done
set -- "${all[@]}"
if [ -z "$src" ] || [ -z "$obj" ] || [[ $src != *.cu ]] || [ -z "${GS_NVCC_CACHE:-}" ]; then
  exec "$real" "$@"
fi

key=$({
  "$real" --version | grep -o 'release [0-9]*\.[0-9]*'
  printf '%s\n' "${key_args[@]}"
  cd "$root" && cat src/*.cu src/*.cuh src/*.h include/*.h
} | sha1sum | cut -c1-20)
cached="$GS_NVCC_CACHE/$(basename "$src" .cu)-$key.o"
if [ -f "$cached" ]; then
  echo "nvcc_cache.sh: $(basename "$src"): cached object $cached (no compile)"
  cp "$cached" "$obj" && touch "$cached"
  exit $?
fi
echo "nvcc_cache.sh: $(basename "$src"): no cached object for key $key; compiling"
"$real" "$@" || exit $?
mkdir -p "$GS_NVCC_CACHE" && cp "$obj" "$cached.tmp.$$" && mv "$cached.tmp.$$" "$cached"
