"""pytest configuration for the tests that need simulated hosts (scripts/simcluster).

test_topology.py runs inside a simulated cluster, under MPI:
    scripts/simcluster --hosts 2 --ranks-per-host 2 -- \\
        python -m mpi4py -m pytest --with-mpi tests/cluster/test_topology.py
and skips outside one. test_cluster_faults.py is a plain one-process pytest
that starts simulated clusters itself (it must not initialize MPI, so
gradsync is only imported here inside a cluster); `make cluster-test` runs both.
"""
import os
import sys

if "SIMCLUSTER_HOSTS" in os.environ:
    import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

    from gsfixtures import comm, make_watchdog  # noqa: E402,F401

    _watchdog = make_watchdog(300)
