"""pytest setup for the GPU suite (tests/gpu).

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/gpu

Every test here is skipped when this process sees no CUDA device
(gs.build_info()["cuda_devices"] == 0), so the directory can always be run.
Ranks share the GPUs round robin (local rank modulo the device count): 2 to 4
ranks on one GPU exercise the MPI device path, one rank NCCL.

Without a GPU, two ways to check the tests themselves (nothing about the CUDA
arithmetic), skipping what needs torch or CuPy on a GPU:
- against the emulated CUDA runtime (`make build/emulated/libgradsync.so`,
  then LD_PRELOAD=$PWD/build/emulated/libgradsync.so): one "CUDA device" whose
  memory is host memory, so the Python device path runs end to end;
- GRADSYNC_GPU_TESTS_ON_HOST=1: gradsync's own arrays in host memory
  (DeviceArray(device="cpu")).
"""

import os
import sys

import pytest
from mpi4py import MPI

import gradsync as gs

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "python"))

from gsutil import Inputs  # noqa: E402

ON_HOST = os.environ.get("GRADSYNC_GPU_TESTS_ON_HOST", "") == "1"
CUDA_DEVICES = gs.build_info()["cuda_devices"]
from gsfixtures import comm, make_watchdog, small_comm  # noqa: E402,F401

_watchdog = make_watchdog(300)


def pytest_collection_modifyitems(config, items):
    if CUDA_DEVICES == 0 and not ON_HOST:
        skip = pytest.mark.skip(reason="no CUDA device visible to this process "
                                       "(gs.build_info()['cuda_devices'] == 0)")
        here = os.path.dirname(os.path.abspath(__file__))
        for item in items:  # only this directory's tests: others may share the session
            if os.path.abspath(str(item.fspath)).startswith(here + os.sep):
                item.add_marker(skip)




@pytest.fixture(scope="session")
def device(comm):  # noqa: F811 (the fixture imported above)
    """Where this rank's arrays live: a CUDA ordinal, or 'cpu' with
    GRADSYNC_GPU_TESTS_ON_HOST=1."""
    if ON_HOST:
        return "cpu"
    try:
        import torch
        has_torch_cuda = torch.cuda.is_available()
    except ImportError:
        has_torch_cuda = False
    if not has_torch_cuda:
        # __cuda_array_interface__ inputs are read as on the current device,
        # which only torch sets here: without it every rank uses device 0
        return 0
    ordinal = comm.local_rank % max(CUDA_DEVICES, 1)
    torch.cuda.set_device(ordinal)
    return ordinal


@pytest.fixture
def inputs(request):
    return Inputs(request.node.nodeid, MPI.COMM_WORLD.size)
