"""Memory kept per call, for every public call kind (issue 34).

    PYTHONPATH=pyx:. mpiexec -n 2 python -m bench.leaks [--calls 400]
        [--samples 6] [--kinds allreduce,...] [--fronts numpy,torch,...]

Each kind runs ``--calls`` times as warm-up, then ``--samples`` times
``--calls`` more, with the resident set size (bench/memory.py: mmap
threshold pinned, heap trimmed) read after each batch; the figure is the
least-squares slope of RSS over the call count, in bytes per call, the
largest over the ranks. RSS is read with malloc as the user's process has
it (bench/memory.py: rss_mb(pin=False)). One difference between two readings would mistake
a heap step for a leak; a slope over several readings does not. Every
call hands gradsync arrays made for that call (a new output, a new input),
as a training loop does: memory that MPI keeps per buffer shows up only so.

Sizes (float32 elements): small 1Ki (4 KiB: the recursive-doubling
allreduce), mid 48Ki (192 KiB: below the direct threshold, above MPI's
registration size), direct 128Ki (512 KiB: above the direct threshold,
below the pipeline's 1 MiB), large 512Ki (2 MiB: in pipeline pieces).

--fronts soak: scripts/soak.py's mixed-phase kinds one at a time, each call
drawing the soak's random dtypes (float16 to int64), sizes (log-uniform up
to 2**--max-log2 elements), lists and ops (Adasum, prod, prescale ...), after
the soak's warm-up at the largest sizes; where the soak's slope comes from.
"""
import argparse
import gc
import importlib.util
import os
import sys

import numpy as np

import gradsync as gs
from bench.memory import rss_mb
from gradsync import MPI

SIZES = {"small": 1 << 10, "mid": 48 << 10, "direct": 128 << 10, "large": 512 << 10}


def slope(xs, ys):
    """Least-squares slope of ys over xs."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


_RING_FULL = [False]  # the ring is the process's, whichever communicator


def fill_flight_ring(comm):
    """Records a full ring's worth of barriers into the flight recorder, once
    a process. Its ring (GRADSYNC_FLIGHT_ENTRIES, 4096 records of 136 bytes)
    is calloc'd: each page enters RSS when the first record lands in it, so
    until the ring has wrapped every call reads as 136.5 bytes kept (a page
    per 30 calls), whatever the call -- bounded at the ring's 544 KiB, and a
    job's steady state after its first 4096 calls."""
    if _RING_FULL[0]:
        return
    get = getattr(getattr(gs, "_core", None), "flight_record_capacity", None)
    for _ in range(get() if get else 4096):
        comm.barrier()
    _RING_FULL[0] = True


def growth(call, comm, calls=400, samples=6):
    """Bytes per call kept by ``call()`` (a slope over ``samples`` readings
    after ``calls`` warm-up calls), the largest over comm's ranks."""
    fill_flight_ring(comm)
    for _ in range(calls):
        call()
    xs, ys = [], []
    for s in range(samples):
        for _ in range(calls):
            call()
        comm.barrier()
        xs.append((s + 1) * calls)
        # live memory: not CPython's free lists or cycles awaiting collection
        # (bounded; filled by the first calls of kinds that make many tuples)
        gc.collect()
        ys.append(rss_mb(pin=False) * 1048576.0)
    return MPI.COMM_WORLD.allreduce(slope(xs, ys), op=MPI.MAX)


def numpy_kinds(comm):
    """name -> call, the NumPy front door's call kinds."""
    p, me = comm.size, comm.rank
    kinds = {}
    for label, n in SIZES.items():
        x = np.ones(n, np.float32)
        kinds["allreduce out-of-place " + label] = lambda x=x: comm.allreduce(x)
        kinds["allreduce_ in place, new array " + label] = lambda x=x: comm.allreduce_(x.copy())
        kinds["allreduce_ in place, same array " + label] = lambda x=x: comm.allreduce_(x)
    x = np.ones(SIZES["direct"], np.float32)
    mine = np.ones(SIZES["direct"] // p, np.float32)
    lst = [np.ones(n, np.float32) for n in (1000, 70000, 3, 40000)]
    feedback, feedback8 = gs.ErrorFeedback(), gs.ErrorFeedback()

    def shards():  # a tensor per rank, each filling its range (ShardLayout's padding)
        r = x.size // p
        return [np.ones(r if k < p - 1 else r - 32, np.float32) for k in range(p)]
    kinds.update({
        "allreduce list of 4, new arrays": lambda: comm.allreduce([t.copy() for t in lst]),
        "allreduce average, prescale": lambda: comm.allreduce(x, op="average", prescale=0.5),
        "allreduce_async_": lambda: comm.allreduce_async_(x.copy()).wait(),
        # the wire formats, a new list and error feedback (its residuals kept) per call
        "allreduce_ wire bfloat16, residual": lambda: comm.allreduce_(
            [t.copy() for t in lst], wire="bfloat16", residual=feedback),
        "allreduce_async_ wire float8_e4m3, residual": lambda: comm.allreduce_async_(
            [t.copy() for t in lst], wire="float8_e4m3", residual=feedback8).wait(),
        "allgather": lambda: comm.allgather(mine),
        "allgather_async": lambda: comm.allgather_async(mine, np.empty(mine.size * p,
                                                                       np.float32)).wait(),
        "reduce_scatter": lambda: comm.reduce_scatter(x),
        "reduce_scatter_async": lambda: comm.reduce_scatter_async(
            x, np.empty(x.size // p, np.float32)).wait(),
        "alltoall": lambda: comm.alltoall(x),
        "alltoall_async": lambda: comm.alltoall_async(x, np.empty_like(x)).wait(),
        "gather": lambda: comm.gather(mine, root=0),
        "scatter": lambda: comm.scatter(x if me == 0 else None, root=0),
        "reduce": lambda: comm.reduce(x, root=0),
        "reduce_async_": lambda: comm.reduce_async_(x.copy(), root=0).wait(),
        "broadcast": lambda: comm.broadcast(x, root=0),
        "broadcast_ new array": lambda: comm.broadcast_(x.copy(), root=0),
        "broadcast_async_": lambda: comm.broadcast_async_(x.copy(), root=0).wait(),
        "reduce_scatter_shards_": lambda: comm.reduce_scatter_shards_(shards()),
        "allgather_shards_": lambda: comm.allgather_shards_(shards()),
        "shards async": lambda: comm.reduce_scatter_shards_async_(shards()).wait(),
        "kernels (accumulate_, scale_, zero_, all_finite)": lambda: (
            gs.accumulate_([x.copy()], [x]), gs.scale_([x.copy()], 0.5),
            gs.zero_([x.copy()]), gs.all_finite([x.copy()])),
    })
    if p > 1:
        peer = me ^ 1

        def p2p():
            if peer >= p:
                return
            if me % 2 == 0:
                comm.send(x.copy(), peer)
                comm.recv_(np.empty_like(x), peer)
            else:
                comm.recv_(np.empty_like(x), peer)
                comm.send(x.copy(), peer)
        kinds["send / recv_"] = p2p
    return kinds


def device_kinds(comm):
    """DeviceArray calls (the emulated runtime: LD_LIBRARY_PATH=build/emulated)."""
    try:
        d = gs.to_device(np.ones(SIZES["direct"], np.float32))
    except gs.Error:
        return {}
    return {"DeviceArray allreduce_": lambda: comm.allreduce_(d),
            "DeviceArray new each call": lambda: comm.allreduce_(
                gs.to_device(np.ones(SIZES["direct"], np.float32)))}


def torch_kinds(comm):
    import torch
    import torch.distributed as dist

    import gradsync.torch.distributed  # noqa: F401  (registers the backend)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29577")
        dist.init_process_group("gradsync", rank=comm.rank, world_size=comm.size)
    p = comm.size
    x = torch.ones(SIZES["direct"])
    return {
        "torch all_reduce": lambda: dist.all_reduce(x.clone()),
        "torch broadcast": lambda: dist.broadcast(x.clone(), 0),
        "torch all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(x.numel() // p * p), x[:x.numel() // p].clone()),
        "torch reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(x.numel() // p), x.clone()),
        "torch all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x.clone()),
    }


def horovod_kinds(comm):
    import torch

    import gradsync.horovod.torch as hvd
    hvd.init()
    x = torch.ones(SIZES["direct"])
    return {
        "hvd.allreduce": lambda: hvd.allreduce(x),
        "hvd.allreduce_ async": lambda: hvd.synchronize(hvd.allreduce_async_(x.clone())),
        "hvd.allgather": lambda: hvd.allgather(x),
        "hvd.broadcast": lambda: hvd.broadcast(x, 0),
        "hvd.alltoall": lambda: hvd.alltoall(x),
        "hvd.reducescatter": lambda: hvd.reducescatter(x),
    }


def jax_kinds(comm):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp

    import gradsync.jax as gj
    x = jnp.ones(SIZES["direct"], jnp.float32)
    return {
        "jax allreduce": lambda: gj.allreduce(x, comm),
        "jax allgather": lambda: gj.allgather(x, comm),
        "jax reduce_scatter": lambda: gj.reduce_scatter(x, comm),
        "jax broadcast": lambda: gj.broadcast(x, comm),
    }


def soak_kinds(comm, max_log2=18, seed=7):
    """scripts/soak.py's mixed kinds (a shared seed: the same draws on every
    rank), after its warm-up at the largest sizes. The Mixed object (its two
    communicators) is soak_kinds.mixed, for main to close."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "scripts", "soak.py")
    spec = importlib.util.spec_from_file_location("gradsync_soak", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    mixed = soak_kinds.mixed = soak.Mixed(seed, max_log2)
    mixed.largest = True
    for _ in range(3):
        for kind in soak.Mixed.KINDS:
            mixed.step(kind)
    mixed.largest = False
    return {"soak " + k: (lambda k=k: mixed.step(k)) for k in dict.fromkeys(soak.Mixed.KINDS)}


FRONTS = {"numpy": numpy_kinds, "device": device_kinds, "torch": torch_kinds,
          "horovod": horovod_kinds, "jax": jax_kinds, "soak": soak_kinds}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="calls per sample")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--fronts", default="numpy", help="comma list of " + ",".join(FRONTS))
    ap.add_argument("--kinds", default="", help="only kinds whose name contains one of these")
    ap.add_argument("--max-log2", type=int, default=18, help="soak: largest tensor, 2**N elements")
    args = ap.parse_args(argv)
    comm = gs.Communicator()
    rows = []
    for front in args.fronts.split(","):
        try:
            kinds = (soak_kinds(comm, args.max_log2) if front == "soak" else
                     FRONTS[front](comm))
        except ImportError as e:
            if comm.rank == 0:
                print("%s: skipped (%s)" % (front, e), flush=True)
            continue
        for name, call in kinds.items():
            if args.kinds and not any(k in name for k in args.kinds.split(",")):
                continue
            b = growth(call, comm, args.calls, args.samples)
            rows.append((name, b))
            if comm.rank == 0:
                print("%-52s %8.1f B/call" % (name, b), flush=True)
        if front == "soak":
            soak_kinds.mixed.close()
    comm.close()
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
