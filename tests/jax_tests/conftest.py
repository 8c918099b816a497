"""pytest fixtures for the gradsync.jax suite (skipped without jax).

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/jax_tests

64-bit JAX types are switched on (jax_enable_x64) so float64 and int64 arrays
run through gradsync too. The collective helpers come from
tests/python/gsutil.py.
"""
# isort: off
import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)
# isort: on
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gsfixtures import comm, make_watchdog, small_comm  # noqa: E402,F401

_watchdog = make_watchdog(180)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
try:
    import jax
except ImportError:  # the test modules skip themselves
    jax = None
else:
    jax.config.update("jax_enable_x64", True)
