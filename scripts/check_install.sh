#!/bin/sh
# make check-install: what a newcomer's `pip install .` gives, in a fresh venv
# with nothing installed first (issue 26): pip builds a wheel in its isolated
# build environment (mpich is a build requirement, so the library is built
# against the mpich wheel's MPI), the wheel is installed into a second fresh
# venv (pulling mpich, mpi4py, numpy and ml_dtypes as its dependencies), and a
# 2-rank allreduce there is checked against NumPy. The venvs live in a
# temporary folder removed on exit, also on failure.
set -eu
PYTHON=${PYTHON:-python3}
SRC=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gs-check-install.XXXXXX")
trap 'rm -rf "$TMP"' EXIT INT TERM
"$PYTHON" -m venv "$TMP/build"
# a copy without build outputs, so the wheel is built from sources only
# (one tar reading the names: xargs may split them over several tars, and the
# reading tar stops at the first archive's end, losing the rest)
git -C "$SRC" ls-files -z --cached --others --exclude-standard |
  (cd "$SRC" && tar cf - --null --no-recursion --ignore-failed-read -T -) |
  (mkdir "$TMP/src" && cd "$TMP/src" && tar xf -)
echo "check-install: building a wheel from a clean copy (pip's isolated build)"
"$TMP/build/bin/python" -m pip wheel -q --no-deps -w "$TMP/wheels" "$TMP/src"
"$PYTHON" -m venv "$TMP/run"
echo "check-install: installing $(basename "$TMP"/wheels/gradsync-*.whl) into a fresh venv"
"$TMP/run/bin/python" -m pip install -q "$TMP"/wheels/gradsync-*.whl
cd "$TMP"
"$TMP/run/bin/python" -c "import mpi4py, gradsync; print('check-install: mpi4py', mpi4py.__version__, '|', gradsync.build_info()['mpi_library'])"
timeout 300 "$TMP/run/bin/mpiexec" -n 2 "$TMP/run/bin/python" -c '
import numpy as np
import gradsync as gs
comm = gs.Communicator()
x = np.arange(1001, dtype=np.float32) * (comm.rank + 1)
want = np.arange(1001, dtype=np.float64) * sum(r + 1 for r in range(comm.size))
got = comm.allreduce(x)
assert comm.size == 2 and np.array_equal(got, want.astype(np.float32)), got
print(f"check-install: rank {comm.rank} of {comm.size}: allreduce matches NumPy")
'
echo "check-install: ok"
