#!/bin/sh
# make test-installed (part of make test): a tier of the suites run against
# the package `pip install .` gives, not against the in-place build.
#
# pip builds a wheel from a clean copy of the sources (tracked files and new
# ones git does not ignore; no build outputs) in its isolated build
# environment, exactly as a newcomer's `pip install .` does, and installs it
# into a fresh venv. The venv sees this Python's site-packages (a .pth file
# naming them, after the venv's own: --system-site-packages would name the
# base interpreter's, not those of a venv make runs in) so that torch, jax,
# mpi4py and pytest are not downloaded again; gradsync itself is only in the venv, PYTHONPATH is unset
# and the suites are copied into a folder outside the checkout, so `import
# gradsync` can only find what pip installed (tests/installed checks that
# first). `make check-install` does the same with nothing pre-installed.
#
# The tier: what only an install can get wrong (tests/installed: every file
# shipped, console scripts, build info equal to make's, the Horovod alias,
# the C example built with `python -m gradsync --cflags --libs`), then the
# collectives, the doctor, the torch backend, the Horovod drop-in, JAX and
# the embedding tests at 2 ranks. Everything lives in one folder under
# TMPDIR, removed on exit, also on failure.
#
# `make test` starts the wheel's build early, in the background and niced
# (`scripts/test_installed.sh wheel DIR`, DIR/rc when it ends), so that it
# runs on the core the one-process tiers leave idle; this tier then waits
# for it (GS_INSTALLED_WHEEL=DIR) and installs that wheel. Run on its own it
# builds the wheel first.
#
# GS_INSTALLED_FRESH=1 (`make check-install`): a newcomer's machine, a venv
# with nothing in it first: pip pulls numpy, mpi4py, the mpich wheel and
# ml_dtypes as gradsync's dependencies, then pytest and pytest-mpi; the
# suites that need torch or jax say they are skipped.
set -eu
PYTHON=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
NP=${GS_INSTALLED_NP:-2}
TIMEOUT=${TEST_TIMEOUT:-900}
SRC=$(cd "$(dirname "$0")/.." && pwd)

# A clean copy of the sources (tracked files and new ones git does not
# ignore; no build outputs) into $1/src.
copy_sources() {
  mkdir "$1/src"
  git -C "$SRC" ls-files -z --cached --others --exclude-standard |
    (cd "$SRC" && tar cf - --null --no-recursion --ignore-failed-read -T -) | (cd "$1/src" && tar xf -)
}

# `pip wheel .` of a clean copy into $1/wheel, pip's isolated build as a
# newcomer's `pip install .` does it; $1/rc holds its exit status at the end.
build_wheel() {
  echo $$ > "$1/pid"
  copy_sources "$1"
  rc=0
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$1/wheel" "$1/src" \
    > "$1/pip.log" 2>&1 || rc=$?
  rm -rf "$1/src"
  echo "$rc" > "$1/rc"
  return "$rc"
}

if [ "${1:-}" = wheel ]; then
  build_wheel "${2:?usage: test_installed.sh wheel DIR}"
  exit
fi

# Waits for the wheel build in $1 (started by `make test`) to end.
wait_wheel() {
  waited=0
  while [ ! -f "$1/rc" ]; do
    if [ "$waited" -ge "$TIMEOUT" ] ||
       { [ -f "$1/pid" ] && ! kill -0 "$(cat "$1/pid")" 2>/dev/null && [ ! -f "$1/rc" ]; }; then
      echo "test-installed: the background wheel build in $1 ended without a result" \
        "(or took over $TIMEOUT s)"
      cat "$1/pip.log" 2>/dev/null
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  [ "$(cat "$1/rc")" = 0 ] || { cat "$1/pip.log"; return 1; }
}

RUN=$(mktemp -d "${TMPDIR:-/tmp}/gs-installed.XXXXXX")
trap 'rm -rf "$RUN"' EXIT
trap 'exit 130' INT TERM
unset PYTHONPATH

say() { echo "== test-installed: $*"; }

# make's in-place build, which the installed one must equal
PYTHONPATH="$SRC/pyx" "$PYTHON" -c "import json, sys, gradsync; json.dump(gradsync.build_info(), \
open(sys.argv[1], 'w'))" "$RUN/reference.json"

if [ "${GS_INSTALLED_FRESH:-0}" = 1 ]; then
  "$PYTHON" -m venv "$RUN/venv"
else
  "$PYTHON" -m venv "$RUN/venv"
  "$PYTHON" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', \
'dist-packages'))))" > "$("$RUN/venv/bin/python" -c "import sysconfig; \
print(sysconfig.get_paths()['purelib'])")/gs-outer-site-packages.pth"
fi
VPY=$RUN/venv/bin/python
if [ "${GS_INSTALLED_FRESH:-0}" = 1 ]; then
  say "pip install . from a clean copy of the sources (pip's isolated build)"
  copy_sources "$RUN"
  "$VPY" -m pip install -q --disable-pip-version-check "$RUN/src" > "$RUN/pip.log" 2>&1 ||
    { cat "$RUN/pip.log"; exit 1; }
  rm -rf "$RUN/src"
else
  if [ -n "${GS_INSTALLED_WHEEL:-}" ]; then
    say "pip wheel . of a clean copy of the sources: waiting for make test's background build"
    WHEEL_DIR=$GS_INSTALLED_WHEEL
    wait_wheel "$WHEEL_DIR"
  else
    say "pip wheel . of a clean copy of the sources (pip's isolated build)"
    WHEEL_DIR=$RUN/build
    mkdir "$WHEEL_DIR"
    build_wheel "$WHEEL_DIR" || { cat "$WHEEL_DIR/pip.log"; exit 1; }
  fi
  say "pip install of that wheel (and its dependencies) into a fresh venv"
  "$VPY" -m pip install -q --disable-pip-version-check "$WHEEL_DIR"/wheel/gradsync-*.whl \
    > "$RUN/pip.log" 2>&1 || { cat "$RUN/pip.log"; exit 1; }
fi
# A CUDA build opens NCCL at run time, here the nvidia-nccl-cu13 wheel beside
# the package as `pip install gradsync[nccl]` puts it in a user's venv (this
# venv would otherwise take it from the outer site-packages, where only the
# path baked in by `make` finds it).
if "$PYTHON" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['nccl'] else 1)" \
    "$RUN/reference.json"; then
  say "pip install nvidia-nccl-cu13 into the venv (gradsync[nccl])"
  "$VPY" -m pip install -q --disable-pip-version-check --ignore-installed --no-deps \
    nvidia-nccl-cu13 > "$RUN/pip.log" 2>&1 || { cat "$RUN/pip.log"; exit 1; }
fi

if [ "${GS_INSTALLED_FRESH:-0}" = 1 ]; then
  say "pip install pytest pytest-mpi (the test runner, nothing else)"
  "$VPY" -m pip install -q --disable-pip-version-check pytest pytest-mpi > "$RUN/pip.log" 2>&1 ||
    { cat "$RUN/pip.log"; exit 1; }
  MPIEXEC=$RUN/venv/bin/mpiexec  # the mpich wheel pip installed with gradsync
  GS_TEST_MPICC=$RUN/venv/bin/mpicc
fi
cp -R "$SRC/tests" "$RUN/tests"
cd "$RUN"
export GS_CHECKOUT="$SRC" GS_INSTALLED_REFERENCE="$RUN/reference.json" MPIEXEC
# the MPI compiler wrapper the C example is built with (make's; pip's build
# above saw only what the user's environment says, as a newcomer's does)
export GS_TEST_MPICC="${GS_TEST_MPICC:-mpicc}"
PYTEST="$VPY -m pytest -q -p no:cacheprovider"
MPI_PYTEST="$MPIEXEC -n $NP $VPY -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider"

say "what the install holds (tests/installed)"
timeout "$TIMEOUT" $PYTEST tests/installed
say "collectives and the doctor at $NP ranks"
timeout "$TIMEOUT" $MPI_PYTEST tests/python/test_allreduce.py \
  tests/python/test_broadcast_gather_scatter.py tests/python/test_doctor.py
say "embedding: a Cython extension cimporting the installed .pxd files, the flags it prints"
# (make install's own tests run in `make embed-test`, against the checkout)
timeout "$TIMEOUT" $PYTEST tests/embed -k "cython or python_m or unversioned"
if "$VPY" -c "import torch" 2>/dev/null; then
  say "the torch backend and the Horovod drop-in at $NP ranks"
  timeout "$TIMEOUT" $MPI_PYTEST tests/torch_tests/test_backend.py \
    tests/horovod_tests/test_hvd_allreduce.py tests/horovod_tests/test_hvd_conformance.py
else say "torch is not importable: the torch and Horovod tier skipped"; fi
if "$VPY" -c "import jax" 2>/dev/null; then
  say "gradsync.jax at $NP ranks"
  timeout "$TIMEOUT" $MPI_PYTEST tests/jax_tests
else say "jax is not importable: the JAX tier skipped"; fi
say "ok"
