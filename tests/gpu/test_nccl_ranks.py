"""gradsync's NCCL path across ranks (issue 13): tests that need n ranks on
n GPUs, one each, or sharing one under NCCL 2.30+'s multi-rank mode
(``@requires_gpus(2)``; older NCCL refuses two ranks on one
GPU), and one that needs two GPUs in one process. Where the run has fewer,
they skip and say what it has. `make test-emulated` runs them over the
emulated NCCL (one emulated GPU per process); on hardware, a machine with
2+ GPUs or one GPU shared under NCCL 2.30+ (scripts/gpu_session.sh nccl2).

- min/max keep NaN and order -0 below +0 on NCCL exactly as on the host and
  the staged MPI path: the same bits on every path (NCCL's own fmin/fmax
  would drop the NaN);
- a peer that never joins: the NCCL wait ends in gs.TimeoutError naming the
  collective, the communicator is unusable afterwards, and an asynchronous
  request handed to a stream times out in the background;
- the background thread's abort and this thread's polls of the same NCCL
  communicator take turns (NCCL frees it in the abort);
- an NCCL initialization that never completes (a rank's bootstrap cannot
  reach the others) ends in the timeout, and every rank falls back to the
  staged MPI path; Ctrl-C during it raises KeyboardInterrupt (emulated NCCL
  only: its GS_EMU_NCCL_STALL_INIT_RANK stalls a rank's bootstrap);
- a process that uses only GPU 1 creates no context on GPU 0 (NVML's list
  of compute processes).
"""
import ctypes
import json
import os
import signal
import threading

import numpy as np
import pytest
from gpu_util import requires_gpus
from mpi4py import MPI

import gradsync as gs
from gsutil import BF16, collectively, run_child

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
try:
    EMULATED = bool(getattr(ctypes.CDLL("libgradsync.so"), "gs_emulated_busy", None))
except OSError:
    EMULATED = False
CANONICAL_NAN = {np.dtype(np.float16): 0x7E00, BF16: 0x7FC0,
                 np.dtype(np.float32): 0x7FC00000, np.dtype(np.float64): 0x7FF8000000000000}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def minmax_inputs(rank, n):
    """Per rank: NaN (various payloads and signs) on one rank only at some
    positions, +0 on some ranks and -0 on others, infinities, finite values."""
    rng = np.random.default_rng([77, rank])
    x = rng.normal(0, 100, n)
    i = np.arange(n)
    x[i % 11 == rank % 11] = np.nan
    x[(i % 13 == 0)] = 0.0 if rank % 2 else -0.0
    x[(i % 17 == 5)] = np.inf if rank == 0 else -np.inf
    x[(i % 19 == 3)] = -0.0 if rank == 1 else 0.0
    return x


def minmax_reference(per_rank, op, dtype):
    """The documented result: NaN (canonical bits) where any rank has NaN,
    else the min/max with -0 below +0; computed on the dtype's values."""
    vals = np.stack([p.astype(dtype).astype(np.float64) for p in per_rank])
    nan = np.isnan(vals).any(axis=0)
    # zeros as the two values nearest zero, -0 below +0 (the inputs' other
    # magnitudes are all far larger); NaN out of the way (overwritten below)
    tiny = np.nextafter(0.0, 1.0)
    key = np.where(vals == 0, np.where(np.signbit(vals), -tiny, tiny), vals)
    if op == "min":
        pick = np.argmin(np.where(nan, np.inf, key), axis=0)
    else:
        pick = np.argmax(np.where(nan, -np.inf, key), axis=0)
    best = vals[pick, np.arange(vals.shape[1])].astype(dtype)
    bits = best.view(UINT[dtype.itemsize]).copy()
    bits[nan] = CANONICAL_NAN[dtype]
    return bits


@pytest.fixture(scope="module")
def staged_comm(device):
    """A communicator whose device path is MPI staged through host memory
    (GRADSYNC_NCCL=0 is read at its first device call)."""
    old = os.environ.get("GRADSYNC_NCCL")
    os.environ["GRADSYNC_NCCL"] = "0"
    c = gs.Communicator()
    try:
        if device != "cpu":
            c.allreduce_(gs.to_device(np.ones(4, np.float32), device))
    finally:
        if old is None:
            del os.environ["GRADSYNC_NCCL"]
        else:
            os.environ["GRADSYNC_NCCL"] = old
    yield c
    c.close()


@requires_gpus(2)
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64),
                                   np.dtype(np.float16), BF16], ids=lambda d: d.name)
def test_nccl_min_max_keep_nan_on_every_path(comm, staged_comm, device, op, dtype):
    n = 4099
    per_rank = [minmax_inputs(r, n) for r in range(comm.size)]
    mine = per_rank[comm.rank].astype(dtype)
    want = minmax_reference(per_rank, op, dtype)
    with collectively(what="NCCL"):
        nccl = gs.to_device(mine, device)
        comm.allreduce_(nccl, op=op)
        assert comm.device_transport == "nccl", comm.device_transport
        got_nccl = nccl.numpy().view(UINT[dtype.itemsize])
    with collectively(what="staged"):
        staged = gs.to_device(mine, device)
        staged_comm.allreduce_(staged, op=op)
        assert staged_comm.device_transport != "nccl"
        got_staged = staged.numpy().view(UINT[dtype.itemsize])
    with collectively(what="host"):
        host = mine.copy()
        comm.allreduce_(host, op=op)
        got_host = host.view(UINT[dtype.itemsize])
    with collectively():
        for name, got in (("NCCL", got_nccl), ("staged MPI", got_staged), ("host", got_host)):
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (
                f"{name} {op} {dtype.name}: {bad.size} of {n} differ from the reference, first "
                f"at {bad[0]}: {got[bad[0]]:#x} vs {want[bad[0]]:#x} (inputs "
                f"{[float(p[bad[0]]) for p in per_rank]})")


def _unchecked_comm():
    """A communicator without cross-rank validation (so one rank can enter a
    collective alone and wait in NCCL itself), its NCCL path up."""
    c = gs.Communicator(_handle=gs._core.Comm.create(WORLD, -1, 0, -1.0))
    return c


def _comm_on_nccl(x, timeout):
    """_unchecked_comm() with its NCCL communicator made (by both ranks),
    then `timeout` set: NCCL's set-up on a real GPU may itself take seconds,
    which the short limit under test must not cut."""
    gs.set_timeout(0)
    c = _unchecked_comm()
    with collectively():
        c.allreduce_(x)
        assert c.device_transport == "nccl"
    gs.set_timeout(timeout)
    return c


@requires_gpus(2)
def test_nccl_peer_that_never_joins_times_out(device):
    x = gs.to_device(np.ones(1024, np.float32), device)
    try:
        c = _comm_on_nccl(x, 3.0)
        with collectively():
            if WORLD.rank == 0:
                with pytest.raises(gs.TimeoutError, match="allreduce"):
                    c.allreduce_(x)
                with pytest.raises(gs.Error, match="unusable"):
                    c.allreduce_(x)
        c.close()

        c = _comm_on_nccl(x, 3.0)
        with collectively(what="background timeout of a handed-off request"):
            if WORLD.rank == 0:
                req = c.allreduce_async_(x)
                req.wait(stream=1)  # handed to the stream: the host goes on
                with pytest.raises(gs.TimeoutError):
                    req.synchronize()
                with pytest.raises(gs.Error):
                    c.barrier()  # unusable: fails at once
        c.close()
    finally:
        gs.set_timeout(float(os.environ.get("GRADSYNC_TIMEOUT_SECONDS") or 0))


@requires_gpus(2)
def test_polls_take_turns_with_the_background_abort(device, capfd):
    """A handed-off request whose peer never joins, polled with test() in a
    loop: the background thread and this one both poll it, and whichever
    sees the timeout aborts the NCCL communicator, which frees it. A poll
    running during that abort would use the freed communicator (a crash
    with NCCL; the emulated NCCL takes 50 ms to abort and reports every call
    on a freed handle). Polls and aborts take turns: the request ends in
    TimeoutError and NCCL is never called on a freed communicator."""
    x = gs.to_device(np.ones(1024, np.float32), device)
    try:
        c = _comm_on_nccl(x, 2.0)
        with collectively():
            if WORLD.rank == 0:
                req = c.allreduce_async_(x)
                req.wait(stream=1)
                with pytest.raises(gs.TimeoutError):
                    while not req.test():
                        pass
        c.close()
        err = capfd.readouterr().err
        with collectively():
            assert "use after free" not in err, err
    finally:
        gs.set_timeout(float(os.environ.get("GRADSYNC_TIMEOUT_SECONDS") or 0))


class _StalledInit:
    """Rank 1's NCCL bootstrap never reaches the others (emulated NCCL), with
    `timeout` as gradsync's limit, for a block."""

    def __init__(self, timeout):
        self.timeout = timeout

    def __enter__(self):
        if not EMULATED:
            pytest.skip("needs the emulated NCCL (it stalls one rank's bootstrap)")
        os.environ["GS_EMU_NCCL_STALL_INIT_RANK"] = "1"
        gs.set_timeout(self.timeout)

    def __exit__(self, *exc):
        del os.environ["GS_EMU_NCCL_STALL_INIT_RANK"]
        gs.set_timeout(float(os.environ.get("GRADSYNC_TIMEOUT_SECONDS") or 0))


@requires_gpus(2)
def test_nccl_initialization_that_never_completes_falls_back(device, capfd):
    """A blocking ncclCommInitRank would wait here for NCCL's own bootstrap
    limit (20 s in the emulation) and then report that; gradsync polls its
    non-blocking initialization and gives up at GRADSYNC_TIMEOUT_SECONDS."""
    mine = np.arange(1001, dtype=np.float32) * (WORLD.rank + 1)
    want = np.arange(1001, dtype=np.float32) * sum(range(1, WORLD.size + 1))
    c = gs.Communicator()
    x = gs.to_device(mine, device)
    with _StalledInit(3.0):
        with collectively():
            c.allreduce_(x)
            assert c.device_transport == "mpi-staged", c.device_transport
            np.testing.assert_array_equal(x.numpy(), want)
        c.close()
    err = capfd.readouterr().err
    with collectively():
        assert "NCCL initialization failed (ncclCommInitRankConfig did not complete within " \
            "GRADSYNC_TIMEOUT_SECONDS=3 s" in err, err


@requires_gpus(2)
def test_interrupt_during_nccl_initialization(device):
    """Ctrl-C (on every rank, as mpiexec forwards it) during a stalled NCCL
    initialization raises KeyboardInterrupt: it is not taken for a failed
    initialization to fall back from, and the communicator is unusable."""
    x = gs.to_device(np.ones(64, np.float32), device)
    got = None
    c = gs.Communicator()
    with _StalledInit(0):
        pid = os.getpid()
        timer = threading.Timer(1.0, lambda: os.kill(pid, signal.SIGINT))
        timer.start()
        try:
            c.allreduce_(x)
        except KeyboardInterrupt as exc:
            got = exc
        finally:
            timer.join()
    with collectively():
        assert got is not None, "the allreduce ended without the interrupt"
        # (the communicator keeps the status it was abandoned with)
        with pytest.raises((gs.Error, KeyboardInterrupt), match="unusable.*interrupted"):
            c.allreduce_(x)
    c.close()


_CONTEXTS = """
import json, os, numpy as np, gradsync as gs, pynvml
c = gs.Communicator()
x = gs.to_device(np.ones(1 << 16, np.float32), 1)
c.allreduce_(x)
c.allreduce_async_(x, op="max").synchronize()
r = c.allreduce_async_(x); r.wait(); r.synchronize()
gs.scale_(x, 2.0); gs.accumulate_(x, x); gs.zero_(x)
out = c.allreduce(x)
pynvml.nvmlInit()
pids = []
for i in range(2):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pids.append([p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])
print(json.dumps({"pid": os.getpid(), "pids": pids, "transport": c.device_transport}))
"""


def test_no_context_on_gpu0_for_a_process_on_gpu1():
    """Issue 13 item 4 on hardware: every call kind, on device 1 only."""
    if gs.build_info()["cuda_devices"] < 2 or gs._core.build_info_c().get("cuda_error"):
        pytest.skip("needs 2 CUDA devices in one process")
    if EMULATED or os.environ.get("GRADSYNC_GPU_TESTS_ON_HOST") == "1":
        pytest.skip("real hardware only (test_streams.py covers the emulated runtime)")
    pytest.importorskip("pynvml")
    verdict = None
    if WORLD.rank == 0:
        p = run_child(_CONTEXTS, timeout=120)
        if p.returncode != 0:
            verdict = ("fail", f"child failed: {p.stderr[-2000:]}")
        else:
            r = json.loads(p.stdout.strip().splitlines()[-1])
            if r["pid"] not in r["pids"][1]:
                why = f"NVML does not list this process on GPU 1 (PID namespace?): {r}"
                verdict = ("skip", why)
            elif r["pid"] in r["pids"][0]:
                verdict = ("fail", f"a context on GPU 0 that nothing asked for: {r}")
            else:
                verdict = ("pass", str(r))
    verdict = WORLD.bcast(verdict, root=0)
    if verdict[0] == "skip":
        pytest.skip(verdict[1])
    with collectively():
        assert verdict[0] == "pass", verdict[1]


@requires_gpus(2)
def test_a_device_list_is_fused_into_one_nccl_launch(comm, device):
    """Tensors at or above the direct size (256 KiB, which the host path
    sends alone to save a copy) are fused with the rest on a device: one
    NCCL launch for a list under the fusion threshold (issue 50's session:
    ResNet-50's list made 85 NCCL calls, 390 ms instead of 6). The sums
    equal NumPy's (integer values: exact in float32 in any order)."""
    counts = [100_000, 3, 70_000, 0, 1, 65_537]  # 400 KB, 280 KB, 262,148 B: direct-size

    def inputs(rank):
        g = np.random.default_rng([50, rank])
        return [g.integers(-1000, 1000, n).astype(np.float32) for n in counts]
    every = [inputs(r) for r in range(WORLD.size)]
    want = [np.sum([every[r][i].astype(np.float64) for r in range(WORLD.size)], axis=0)
            for i in range(len(counts))]
    launches = getattr(ctypes.CDLL("libgradsync.so"), "gs_emulated_nccl_launches", None)
    if launches:
        launches.restype = ctypes.c_long
    with collectively():
        xs = [gs.to_device(m, device) for m in every[WORLD.rank]]
        before = launches() if launches else 0
        comm.allreduce_(xs)
        made = (launches() if launches else 0) - before
        for i, x in enumerate(xs):
            np.testing.assert_array_equal(x.numpy(), want[i].astype(np.float32),
                                          err_msg=f"tensor {i}")
        if launches:  # the emulated NCCL counts; on hardware the sums alone
            assert made == 1, f"{made} NCCL launches for one fused list"
