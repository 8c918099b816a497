"""Helpers for the tests in tests/gpu that need real hardware or NCCL.

- ``requires_gpus(n)``: the test needs n ranks whose device collectives
  take NCCL: n GPUs, one each, or ranks sharing a GPU under NCCL 2.30+'s
  NCCL_MULTI_RANK_GPU_ENABLE=1 (older NCCL refuses two ranks on one
  GPU). Elsewhere it skips, saying what this run has. The decision is made
  once, by all ranks together (a collective at the first such test, which
  every rank reaches in the same order), so every rank skips or runs alike.
- ``spin_torch(stream)`` / ``spin_cupy(stream)``: keep a stream busy for
  about 1.5-2 s (3e9 GPU cycles), so that work queued behind it is
  still pending when the host looks: a call that blocked the host, or work
  put on the wrong stream, shows.
"""
import functools
import inspect

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs

WORLD = MPI.COMM_WORLD
SPIN_CYCLES = 3_000_000_000   # ~1.5-2 s at an H100's 1.5-2 GHz: a margin for a busy host

_nccl = {}


def nccl_ranks(device):
    """(ranks gradsync's NCCL path spans in this run, why not more): the
    world size when a communicator's device collectives on `device` (the
    conftest fixture's: this rank's GPU) go through NCCL, else 0.
    Collective on its first call."""
    if "n" not in _nccl:
        devices = gs.build_info()["cuda_devices"]
        why = f"{WORLD.size} rank(s), {devices} CUDA device(s) visible per process"
        n = 0
        if WORLD.allreduce(0 if device == "cpu" else devices, op=MPI.MIN) > 0:
            c = gs.Communicator()
            try:
                x = gs.to_device(np.ones(4, np.float32), device)
                c.allreduce_(x)
                transport = c.device_transport
            finally:
                c.close()
            why += f", device transport {transport!r}"
            n = WORLD.size if transport == "nccl" else 0
        _nccl["n"], _nccl["why"] = n, why
    return _nccl["n"], _nccl["why"]


def requires_gpus(n):
    """Decorator: run only where n or more ranks reduce over NCCL (n GPUs,
    one per rank); otherwise skip with the reason. The test must take the
    `device` fixture."""
    def deco(fn):
        if "device" not in inspect.signature(fn).parameters:
            raise TypeError(f"{fn.__name__}: @requires_gpus needs the test to take `device`")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            have, why = nccl_ranks(kwargs["device"])
            if have < n:
                pytest.skip(f"needs {n} ranks on {n} GPUs, one each, reducing over NCCL "
                            f"(or NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1); this run: {why}")
            return fn(*args, **kwargs)
        return wrapper
    return deco


def spin_torch(torch, stream, cycles=SPIN_CYCLES):
    """Queues a busy-wait of `cycles` GPU cycles on a torch stream."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


_SPIN_SRC = r"""
extern "C" __global__ void gs_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def spin_cupy(cupy, stream, cycles=SPIN_CYCLES):
    """Queues a busy-wait of `cycles` GPU cycles on a CuPy stream."""
    kernel = cupy.RawKernel(_SPIN_SRC, "gs_spin")
    with stream:
        kernel((1,), (1,), (np.int64(cycles),))
