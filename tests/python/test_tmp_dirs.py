"""tests/conftest.py gives every rank a temporary base directory of its own,
outside pytest's shared /tmp/pytest-of-<user>, where concurrent sessions
prune each other's numbered directories."""
import os

from mpi4py import MPI

from gsutil import collective_assert


def test_each_rank_has_its_own_base_directory(tmp_path_factory, tmp_path):
    world = MPI.COMM_WORLD
    base = str(tmp_path_factory.getbasetemp())
    bases = world.allgather(base)
    collective_assert(len(set(bases)) == world.size, "ranks share a base directory: %s" % bases)
    under_base = str(tmp_path).startswith(base + os.sep)
    collective_assert(under_base, "%s is not under %s" % (tmp_path, base))
    shared_root = os.path.basename(os.path.dirname(base)).startswith("pytest-of-")
    collective_assert(not shared_root, "%s is in pytest's shared numbered directory" % base)
