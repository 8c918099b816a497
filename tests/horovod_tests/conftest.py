"""pytest fixtures for the gradsync.horovod suite (skipped without torch).

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/horovod_tests

These are our tests, written from Horovod's documented behaviour and the
assertions of its own PyTorch tests (horovod/horovod test/parallel/
test_torch.py and test_adasum_pytorch.py, which are not copied here; the
suite itself runs with scripts/horovod_conformance.py), on the CPU, with
the collective helpers of tests/python/gsutil.py so that a
failure on one rank fails every rank. hvd.init() is called once per session.
"""
# isort: off
import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)
# isort: on
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gsfixtures import import_torch, make_watchdog  # noqa: E402

_watchdog = make_watchdog(180)

torch = import_torch()
