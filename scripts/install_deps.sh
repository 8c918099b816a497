#!/bin/sh
# Installs what gradsync builds and tests with into the running Python:
# MPI (the `mpich` wheel unless MPICC names a system MPI), mpi4py built for that
# MPI, and the Python packages. Fast when everything is already there.
set -eu
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

"$PY" -c "import numpy, Cython, pytest, pytest_mpi, ml_dtypes, setuptools, hypothesis" 2>/dev/null ||
  pip_install "numpy>=1.24" "cython>=3.0" pytest pytest-mpi "ml_dtypes>=0.3" setuptools hypothesis

# gradsync.jax's tests (tests/jax_tests): the CPU build of JAX from PyPI (about 90 MB
# to download, 10-20 s to install). Optional: without it those tests are skipped.
"$PY" -c "import jax" 2>/dev/null || pip_install "jax[cpu]" ||
  echo "gradsync: could not install jax[cpu]; tests/jax_tests will be skipped"

# gradsync.torch's tests (tests/torch_tests, tests/horovod_tests, torch's own
# distributed suite): torch, through pip as this machine configures it. The
# version is the one the suites were last run against (GRADSYNC_TORCH
# overrides it); where the configured sources hold its CPU build (a
# "+cpu" local version sorts above the plain one) pip takes that.
"$PY" -c "import torch" 2>/dev/null || pip_install "${GRADSYNC_TORCH:-torch==2.13.0}" ||
  echo "gradsync: could not install torch; tests/torch_tests and tests/horovod_tests will be skipped"

scripts=$("$PY" -c "import sysconfig; print(sysconfig.get_path('scripts'))")
if [ -n "${MPICC:-}" ]; then
  # A system MPI: mpi4py must be compiled against it, or the two would load
  # different MPI libraries into one process.
  if ! "$PY" -c "import mpi4py" 2>/dev/null; then
    echo "gradsync: building mpi4py against $MPICC"
    MPICC="$MPICC" pip_install --no-binary=mpi4py --no-cache-dir "mpi4py>=3.1"
  fi
else
  # The mpich wheel, below 5: MPICH 5.0.x cannot connect singleton processes,
  # which is how gradsync joins a torchrun launch (docs/decisions/launch.md). A 5.x
  # wheel already here is replaced; mpi4py's PyPI wheel loads whichever
  # mpich wheel is installed (libmpi.so.12), so it stays.
  mpich_wheel="mpich>=4.3,<5"
  have=$("$PY" -c "from importlib.metadata import version; print(version('mpich'))" 2>/dev/null || true)
  case "$have" in
    5.*) echo "gradsync: replacing the mpich $have wheel with $mpich_wheel" \
              "(docs/decisions/launch.md)"
         pip_install "$mpich_wheel" ;;
    "") if ! command -v mpicc >/dev/null 2>&1 && [ ! -x "$scripts/mpicc" ]; then
          echo "gradsync: no mpicc found: installing MPICH from PyPI (the mpich wheel)"
          pip_install "$mpich_wheel"
        fi ;;
  esac
  "$PY" -c "import mpi4py" 2>/dev/null || pip_install "mpi4py>=4.0"
fi

# With nvcc present the CUDA code is built, and with it the NCCL backend,
# whose header comes from the nvidia-nccl-cu13 wheel (or NCCL_HOME): so a
# machine without a GPU still compiles every line a GPU machine would run.
if [ "${GRADSYNC_CUDA:-}" != "0" ] && [ -z "${NCCL_HOME:-}" ] &&
   { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  "$PY" -c "import nvidia.nccl" 2>/dev/null || {
    echo "gradsync: nvcc found: installing the NCCL header and library (nvidia-nccl-cu13)"
    pip_install nvidia-nccl-cu13
  }
fi

# `make lint`: ruff, cython-lint and clang-format (the PyPI wheel, so every
# machine checks with the same clang-format as .clang-format was tuned with).
if [ "${1:-}" = "lint" ]; then
  "$PY" -m ruff --version >/dev/null 2>&1 || pip_install "ruff>=0.5"
  "$PY" -c "import cython_lint" 2>/dev/null || pip_install cython-lint
  "$PY" -c "import clang_format" 2>/dev/null || pip_install "clang-format>=18"
  exit 0
fi

# torch's own distributed tests (tests/torch_tests/test_torch_upstream.py) import
# torch.testing._internal, which needs expecttest; only where torch is installed.
if "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -c "import expecttest" 2>/dev/null || pip_install expecttest
fi
