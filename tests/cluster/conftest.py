"""pytest fixtures for the tests that need simulated hosts (scripts/simcluster).

The MPI tests here (test_topology.py) run inside a simulated cluster:
    scripts/simcluster --hosts 2 --ranks-per-host 2 -- \\
        python -m mpi4py -m pytest --with-mpi tests/cluster/test_topology.py
and skip outside one. test_cluster_faults.py is a plain (one-process) pytest
that starts simulated clusters itself; `make cluster-test` runs both.
"""
import os
import sys

import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gsfixtures import comm, make_watchdog  # noqa: E402,F401

_watchdog = make_watchdog(300)
