"""pytest fixtures for the gradsync suite.

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/python

The helpers live in gsutil.py (importable from the test modules) and are
re-exported here:
    collective_assert(ok, msg)      fail on every rank if any rank failed
    collectively()                  context manager form of the same
    assert_same_on_all_ranks(a, c)  bitwise equality across ranks (sha256)
    Inputs / inputs fixture         per-test, per-rank deterministic inputs
"""

# isort: off
import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)
# isort: on
import os
import sys

import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gsfixtures import SMALL_THRESHOLD, comm, make_watchdog, small_comm  # noqa: E402,F401

from gsutil import (  # noqa: E402,F401  (re-exported helpers)
    ALL_DTYPES,
    BF16,
    FLOAT_DTYPES,
    INT_DTYPES,
    OPS,
    Inputs,
    assert_same_on_all_ranks,
    bits,
    check_result,
    check_unchanged,
    collective_assert,
    collectively,
    dtype_name,
    is_float,
    is_int,
    random_array,
    reduce_reference,
    reduce_tolerance,
    seed_for,
)

_watchdog = make_watchdog(180)



@pytest.fixture
def inputs(request):
    """Inputs(key=node id, nranks=world size): .arrays(rank, shapes, dtypes,
    kind), .all_ranks(shapes, dtypes, kind), .rng(rank=None, tag)."""
    return Inputs(request.node.nodeid, MPI.COMM_WORLD.size)


@pytest.fixture
def world():
    return MPI.COMM_WORLD
