"""pytest fixtures for the gradsync.torch suite (skipped without torch).

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/torch

The collective helpers (collective_assert, collectively, seed_for) come from
tests/python/gsutil.py.
"""
import os
import sys

import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gsfixtures import comm, make_watchdog  # noqa: E402,F401

_watchdog = make_watchdog(180)

try:
    import torch
except ImportError:  # the test modules skip themselves
    torch = None
else:
    # several ranks share few cores: one intra-op thread per rank
    torch.set_num_threads(1)


