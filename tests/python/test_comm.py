"""gs.Communicator basics, build_info and op names."""

import os
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import collective_assert, collectively

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def test_rank_size(comm):
    collective_assert(comm.rank == WORLD.rank and comm.size == WORLD.size,
                      "rank/size %s/%s vs mpi4py %s/%s" % (
                          comm.rank, comm.size, WORLD.rank, WORLD.size))


def test_local_rank_size(comm):
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    try:
        ok = (comm.local_rank == node.rank and comm.local_size == node.size)
        msg = "local %s/%s vs shared-memory comm %s/%s" % (
            comm.local_rank, comm.local_size, node.rank, node.size)
        nodes = WORLD.allreduce(1 if node.rank == 0 else 0)
    finally:
        node.Free()
    collective_assert(ok, msg)
    if nodes == 1:  # one machine: local == global
        collective_assert(comm.local_rank == comm.rank and
                          comm.local_size == comm.size,
                          "single node but local rank/size differ")


def test_default_constructor_and_mpi4py_comm(comm):
    with collectively():
        c = gs.Communicator()
    try:
        with collectively():
            assert c.rank == WORLD.rank and c.size == WORLD.size
            out = c.allreduce(np.full(3, 1 + c.rank, np.int64))
            assert np.all(out == sum(range(1, c.size + 1)))
    finally:
        c.close()
    sub = WORLD.Split(WORLD.rank % 2, key=-WORLD.rank)
    with collectively():
        c = gs.Communicator(sub)
    try:
        with collectively():
            assert c.rank == sub.rank and c.size == sub.size
            out = c.allreduce(np.array([WORLD.rank], np.int32), "sum")
            expected = sum(r for r in range(WORLD.size)
                           if r % 2 == WORLD.rank % 2)
            assert out[0] == expected
    finally:
        c.close()
        sub.Free()


@pytest.mark.parametrize("key", ["default", "reversed"])
def test_split(comm, key):
    color = comm.rank % 2
    members = [r for r in range(comm.size) if r % 2 == color]
    with collectively():
        if key == "default":
            sub = comm.split(color)
        else:
            sub = comm.split(color, key=-comm.rank)
            members = members[::-1]
    try:
        with collectively():
            assert isinstance(sub, gs.Communicator)
            assert sub.size == len(members), (sub.size, members)
            assert sub.rank == members.index(comm.rank), (sub.rank, members)
        x = np.array([comm.rank, 1], dtype=np.int64)
        with collectively():
            out = sub.allreduce(x, "sum")
            assert out.tolist() == [sum(members), len(members)]
        with collectively():
            out = sub.allreduce(np.array([comm.rank], np.float32), "max")
            assert out[0] == max(members)
        with collectively():
            sub.barrier()
    finally:
        sub.close()
    # the parent is unaffected
    with collectively():
        out = comm.allreduce(np.ones(2, np.int32))
        assert np.all(out == comm.size)


def test_split_inherits_fusion_threshold(small_comm):
    with collectively():
        sub = small_comm.split(0)
    try:
        with collectively():
            assert sub.fusion_threshold == small_comm.fusion_threshold == 4096
    finally:
        sub.close()


def test_barrier_synchronizes(comm):
    # Judged by order, not by how long anyone waited: every rank leaves the
    # barrier after rank 0 entered it. CLOCK_MONOTONIC is one clock for all
    # processes of a host, and these ranks share one.
    with collectively():
        comm.barrier()
    if comm.rank == 0:
        time.sleep(0.3)  # the others are in the barrier by now, mostly
    entered = time.monotonic()
    with collectively():
        comm.barrier()
    left = time.monotonic()
    entered0 = MPI.COMM_WORLD.bcast(entered, root=0)
    collective_assert(left >= entered0,
                      "rank %d left the barrier %.3f s before rank 0 entered it"
                      % (comm.rank, entered0 - left))


def test_close_twice_and_use_after_close():
    with collectively():
        c = gs.Communicator(MPI.COMM_WORLD)
    with collectively():
        c.close()
        c.close()  # harmless
    x = np.ones(4, np.float32)
    for name, call in (("allreduce", lambda: c.allreduce(x)),
                       ("allreduce_", lambda: c.allreduce_(x)),
                       ("broadcast_", lambda: c.broadcast_(x)),
                       ("barrier", lambda: c.barrier())):
        with collectively(what=name):
            with pytest.raises(gs.Error):
                call()
            assert np.all(x == 1)


def test_context_manager():
    with collectively():
        with gs.Communicator(MPI.COMM_WORLD) as c:
            out = c.allreduce(np.ones(2, np.float64))
            assert np.all(out == c.size)
    with collectively():
        with pytest.raises(gs.Error):
            c.barrier()


def test_fusion_threshold_property(comm, small_comm):
    env = os.environ.get("GRADSYNC_FUSION_THRESHOLD")
    default = int(env) if env else 134217728
    collective_assert(comm.fusion_threshold == default,
                      "default threshold %r" % comm.fusion_threshold)
    collective_assert(small_comm.fusion_threshold == 4096,
                      "threshold %r" % small_comm.fusion_threshold)


def _find(info, *names):
    for n in names:
        if n in info:
            return n
    raise AssertionError("build_info has none of %s: keys %s" % (
        names, sorted(info)))


def test_build_info(comm):
    with collectively():
        info = gs.build_info()
        assert isinstance(info, dict)
        mpi_keys = [k for k in info if "mpi" in k.lower()]
        assert mpi_keys, "no MPI library/version key: %s" % sorted(info)
        text = " ".join(str(info[k]) for k in mpi_keys)
        assert "MPICH" in text or "Open MPI" in text or "MPI" in text, text
        cuda, nccl = info["cuda"], info["nccl"]
        assert cuda is None or re.fullmatch(r"\d+\.\d+", cuda), cuda
        assert nccl is None or re.fullmatch(r"\d+\.\d+\.\d+", nccl), nccl
        assert (info["cuda_archs"] is None) == (cuda is None), (info["cuda_archs"], cuda)
        assert nccl is None or cuda is not None, (cuda, nccl)
        assert isinstance(info["cuda_devices"], int) and info["cuda_devices"] >= 0
        assert cuda is not None or info["cuda_devices"] == 0
        simd = info[_find(info, "simd", "simd_level")]
        assert simd in ("avx2", "portable", "f16c", "avx512", "neon"), simd
        ft = info[_find(info, "fusion_threshold")]
        assert int(ft) == comm.fusion_threshold, (ft, comm.fusion_threshold)


def test_op_enum():
    with collectively():
        assert int(gs.Op.SUM) == 0 and int(gs.Op.AVERAGE) == 1
        assert int(gs.Op.MIN) == 2 and int(gs.Op.MAX) == 3
        assert int(gs.Op.PROD) == 4 and int(gs.Op.ADASUM) == 5


@pytest.mark.parametrize("name", ["sum", "average", "min", "max", "prod"])
def test_op_string_and_enum_agree(name, comm):
    x = (np.arange(6, dtype=np.float64) + 1) * (comm.rank + 1)
    enum = getattr(gs.Op, name.upper())
    with collectively():
        a = comm.allreduce(x, name)
        b = comm.allreduce(x, enum)
        st = np.stack([(np.arange(6) + 1.0) * (r + 1)
                       for r in range(comm.size)])
        ref = {"sum": st.sum(0), "average": st.sum(0) / comm.size,
               "min": st.min(0), "max": st.max(0), "prod": st.prod(0)}[name]
        assert np.array_equal(a, b)
        assert np.allclose(a, ref, rtol=1e-14, atol=0)


def test_unknown_op_string(comm):
    with collectively():
        with pytest.raises(ValueError):
            comm.allreduce(np.ones(2, np.float32), "median")
    with collectively():
        with pytest.raises(ValueError):
            comm.reduce_scatter(np.ones(2, np.float32), "nope")


SLURM_TASK = """
import gradsync as gs
try:
    c = gs.Communicator()
    print("world", c.rank, c.size)
except ValueError as e:
    print("raised", e)
"""


@pytest.mark.parametrize("env,want", [
    # an srun step of 2 tasks without PMI: alone, a world of 1 would train on its own
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
     "raised gradsync: srun started 2 tasks"),
    # a batch script run directly in an allocation: one process, a world of 1
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, "world 0 1"),
    # a step of one task
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, "world 0 1"),
], ids=["srun-without-pmi", "batch-script", "one-task-step"])
def test_slurm_environment_without_pmi(env, want):
    """What a singleton makes of Slurm's variables (the real srun runs in
    tests/cluster/test_slurm.py): one process per rank of the step, never a
    silent world of 1 for a step of several tasks."""
    from gsutil import run_child
    got = None
    if WORLD.rank == 0:
        res = run_child(SLURM_TASK, env)
        got = res.stdout.strip() or res.stderr[-2000:]
    got = WORLD.bcast(got)
    with collectively():
        assert got.startswith(want), got
        if "raised" in want:
            assert "srun --mpi=pmi2" in got and "MASTER_ADDR and MASTER_PORT" in got, got
