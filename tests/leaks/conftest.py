"""pytest fixtures for the per-call memory check (issue 34).

Run with (2 ranks: `make py-tests` does):
    PYTHONPATH=pyx:. mpiexec -n 2 python -m mpi4py -m pytest --with-mpi tests/leaks
"""
# isort: off
import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)
# isort: on
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gsfixtures import comm, make_watchdog  # noqa: E402,F401

_watchdog = make_watchdog(300)
