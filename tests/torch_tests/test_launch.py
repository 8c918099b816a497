"""Launching gradsync without mpiexec (issue 29; docs/TORCH_BACKEND.md,
"Launching"): torchrun, torch's own spawn harness, and an MPI launcher with
MASTER_ADDR/MASTER_PORT but no RANK, each starting one gradsync world whose
allreduce matches NumPy; and the join's faults (a rank that never arrives,
a wrong WORLD_SIZE) ending in an error on every rank that names them.

These tests start their own processes, so they run at one MPI rank only
(skipped at more); the processes they start get an environment without the
outer mpiexec's PMI variables, as a torchrun launch has.
"""
import ast
import faulthandler
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from launch_env import singleton_env  # tests/python (conftest puts it on sys.path)
from mpi4py import MPI

import gradsync as gs
from gradsync import _world

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="starts its own processes: runs at one MPI rank")

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch")
TOP = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the checkout
LAUNCH_SECONDS = 600  # a bound for a whole launch on a loaded two-core machine


@pytest.fixture(autouse=True)
def _launch_watchdog():
    """The suite's 180 s watchdog (conftest) re-armed above LAUNCH_SECONDS:
    these tests wait for whole launches, each bounded by LAUNCH_SECONDS."""
    faulthandler.dump_traceback_later(LAUNCH_SECONDS + 120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _can_join():
    try:
        _world.check_can_join()
    except gs.UnsupportedError as e:
        return str(e)
    return ""


needs_join = pytest.mark.skipif(bool(_can_join()), reason=_can_join() or "")


def _singleton_env(**extra):
    """This environment less what an MPI launcher put there (the processes
    started from it are MPI singletons, as torchrun's are)."""
    return singleton_env(TOP, **extra)


def _log_dir(tmp_path):
    """torchrun's --log-dir: without one, its agent makes TMPDIR/torchelastic_*
    for the workers' logs and never removes it."""
    return "--log-dir=" + str(tmp_path / "torchrun-logs")


def _run(cmd, env, timeout=LAUNCH_SECONDS):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _contribution(rank, n=5):
    return np.arange(n, dtype=np.float64) * (rank + 1) + 0.25 * rank  # worker.py's


def _check_records(out_dir, size, log):
    expected = sum(_contribution(r) for r in range(size))
    for rank in range(size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote nothing:\n{log[-4000:]}"
        with open(path) as f:
            rec = json.load(f)
        assert (rec["rank"], rec["size"]) == (rank, size)
        assert (rec["gs_rank"], rec["gs_size"]) == (rank, size)  # gs.Communicator() too
        np.testing.assert_array_equal(rec["torch_sum"], expected)
        np.testing.assert_array_equal(rec["gs_sum"], expected)
        assert rec["gathered"] == list(range(size))
    return rec


@needs_join
@pytest.mark.parametrize("nproc,mode", [(2, ""), (3, "communicator-first")])
def test_torchrun_standalone(tmp_path, nproc, mode):
    """torchrun --standalone starts N singletons; init_process_group("gradsync")
    and gs.Communicator() see one world of N ranks numbered as torchrun did,
    whichever comes first (a Communicator first joins from torchrun's
    environment, and torch's group then reuses that world)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", _log_dir(tmp_path), os.path.join(HERE, "worker.py"),
           str(tmp_path)] + ([mode] if mode else [])
    rc, log = _run(cmd, _singleton_env())
    assert rc == 0, log[-6000:]
    rec = _check_records(str(tmp_path), nproc, log)
    assert rec["mpi_world"] == [0, 1]  # singletons: the world is the joined one


@needs_join
@pytest.mark.extended  # 23 s here; test_torch_upstream.py runs the same tests in make test
def test_torch_spawn_harness():
    """torch's MultiProcessTestCase spawns the ranks itself; file:// and
    tcp:// init_method both start a gradsync world (spawn_case.py)."""
    rc, log = _run([sys.executable, os.path.join(HERE, "spawn_case.py")],
                   _singleton_env(GS_LAUNCH_WORLD_SIZE=2))
    assert rc == 0 and "Ran 2 tests" in log and "\nOK" in log, log[-6000:]


# torch's whole DistributedTest suite through torch's own harness (issue 29
# item 5). The ranks fork from a server that imported torch's test module
# once (dist_suite.py, GS_SPAWN_START_METHOD): with torch's spawn each rank
# imports it afresh, 4 s of CPU a rank a test on two cores (hours for the
# suite); test_torch_spawn_harness above runs torch's spawn itself.
# GS_TORCH_SUITE_SIZES (space-separated) picks the sizes: make test runs none
# (the Makefile's TORCH_SUITE_SIZES: 5 minutes a size here; torch's suite runs
# there through the mpiexec adapter, test_torch_upstream.py), make
# test-extended all three.
SUITE_SIZES = tuple(int(n) for n in os.environ.get("GS_TORCH_SUITE_SIZES", "2 3 4").split()) or (
    pytest.param(0, marks=pytest.mark.skip(
        reason="GS_TORCH_SUITE_SIZES is empty: `make test-extended` runs torch's suite "
               "through its harness (make test runs it through the mpiexec adapter)")),)


def _suite_tests():
    """The test methods of torch's _DistTestBase, read from the installed
    wheel's source (importing it reads BACKEND and WORLD_SIZE)."""
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    base = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                and n.name == "_DistTestBase")
    return {n.name for n in base.body if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")}


def _run_suite(tmp_path, backend, world_size):
    """{test: (status, reason)} of the whole suite on one backend."""
    report = tmp_path / f"{backend}-{world_size}.txt"
    rc, log = _run([sys.executable, os.path.join(HERE, "dist_suite.py")],
                   _singleton_env(BACKEND=backend, WORLD_SIZE=world_size,
                                  GS_SPAWN_START_METHOD="forkserver", GS_SPAWN_REPORT=report))
    return rc, log, _compare().read(report) if report.exists() else {}


def _compare():
    """launch/compare.py, the reports' reader (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("compare", os.path.join(HERE, "compare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_join
@pytest.mark.parametrize("world_size", SUITE_SIZES)
def test_torch_suite_through_its_harness(tmp_path, world_size):
    """Every test of torch's suite runs through TestDistBackend on "gradsync"
    (ranks joined from file://) and none fails; torch's harness decides
    every skip. (`make torch-upstream-spawn` runs gloo as well and compares
    the two test by test: launch/compare.py, docs/TORCH_BACKEND.md.)"""
    rc, log, ours = _run_suite(tmp_path, "gradsync", world_size)
    assert set(ours) == _suite_tests(), log[-6000:]
    failed = {n: r for n, (s, r) in ours.items() if s == "fail"}
    assert not failed and rc == 0, f"failed: {sorted(failed)}\n{log[-6000:]}"
    assert any(s == "pass" for s, _ in ours.values())
    # a skip torch decided inside the ranks carries its reason, not a crash's
    assert all(r for s, r in ours.values() if s == "skip"), sorted(ours.items())


def _mpiexec():
    near = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return near if os.path.exists(near) else shutil.which("mpiexec")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec")
def test_mpiexec_with_master_and_no_rank(tmp_path):
    """mpiexec with MASTER_ADDR/MASTER_PORT set (for a side gloo group) and
    no RANK/WORLD_SIZE: torch's env:// rendezvous takes them from MPI."""
    env = _singleton_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    rc, log = _run([_mpiexec(), "-n", "2", sys.executable, os.path.join(HERE, "worker.py"),
                    str(tmp_path)], env)
    assert rc == 0, log[-6000:]
    rec = _check_records(str(tmp_path), 2, log)
    assert rec["mpi_world"] == [1, 2]


def _demo_digest(log):
    """The weights digest line `make demo` prints (every rank's weights equal)."""
    lines = [x for x in log.splitlines() if x.startswith("weights identical on all 2 ranks: yes")]
    assert lines, log[-6000:]
    return lines[-1]


@needs_join
@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec")
@pytest.mark.extended  # 18 s here; the torchrun tests above launch the same way
def test_demo_torchrun_matches_mpiexec(tmp_path):
    """`make demo`'s torch-ddp backend launched by torchrun (singletons
    joined) trains to the same weights, bit for bit, as under mpiexec."""
    demo = [os.path.join(TOP, "scripts", "demo.py"), "--backend", "torch-ddp", "--steps", "40",
            "--check-every", "20", "--progress", "lines", "--min-loss-ratio", "1.0"]
    rc, by_mpiexec = _run([_mpiexec(), "-n", "2", sys.executable] + demo, _singleton_env())
    assert rc == 0, by_mpiexec[-6000:]
    rc, by_torchrun = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=2", _log_dir(tmp_path)] + demo, _singleton_env())
    assert rc == 0, by_torchrun[-6000:]
    assert _demo_digest(by_torchrun) == _demo_digest(by_mpiexec)


SIMCLUSTER = os.path.join(TOP, "scripts", "simcluster")


def _no_simcluster():
    """Why the simulated cluster cannot run here ('' when it can)."""
    r = subprocess.run([sys.executable, SIMCLUSTER, "--check"], capture_output=True, text=True,
                       timeout=120)
    return "" if r.returncode == 0 else "simcluster: " + (r.stderr.strip() or "unavailable")


@needs_join
def test_torchrun_two_nodes_on_simcluster(tmp_path):
    """torchrun --nnodes 2 --nproc_per_node 2, one agent on each simulated
    host (its own network namespace and hostname; scripts/simcluster
    --per-host), rendezvous at host 0's data address: the four singletons
    join into one world of 4, ranked as torchrun ranked them, and the
    allreduces match NumPy."""
    why = _no_simcluster()
    if why:
        pytest.skip(why)
    line = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc_per_node", "2", "--node_rank", "$SIMCLUSTER_HOST_INDEX",
            "--master_addr", "$SIMCLUSTER_HOST0_ADDR", "--master_port", str(_free_port()),
            _log_dir(tmp_path),
            os.path.join(HERE, "worker.py"), str(tmp_path)]
    rc, log = _run([sys.executable, SIMCLUSTER, "--hosts", "2", "--per-host", "--timeout",
                    str(LAUNCH_SECONDS - 60), "--"] + line, _singleton_env())
    assert rc == 0, log[-6000:]
    _check_records(str(tmp_path), 4, log)
    hosts = [json.load(open(tmp_path / f"rank{r}.json"))["host"] for r in range(4)]
    # torchrun's node ranks: ranks 0-1 on host 0, 2-3 on host 1
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts


def _join(tmp_path, sizes, timeout_s=4, store=None, retry_size=None, whole=False):
    """Starts one join_fault.py per entry of ``sizes`` (rank i told WORLD_SIZE
    sizes[i]; after a JoinError, retried with ``retry_size``); returns each
    one's last line (``whole``: every line)."""
    store = store or str(tmp_path / "store")
    env = _singleton_env(GRADSYNC_TIMEOUT_SECONDS=timeout_s)
    retry = [str(retry_size)] if retry_size else []
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "join_fault.py"), str(r),
                               str(n), store, str(len(sizes))] + retry, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, n in enumerate(sizes)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=LAUNCH_SECONDS)
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0] + "\n<hung>"
        assert p.returncode == 0, out[-4000:]
        lines = out.strip().splitlines()
        outs.append(lines if whole else lines[-1])
    return outs


@needs_join
def test_join_rank_never_arrives(tmp_path):
    """WORLD_SIZE=3 and only ranks 0 and 1 started: both raise JoinError
    naming rank 2, within the timeout (no hang in MPI_Comm_accept)."""
    outs = _join(tmp_path, [3, 3])
    for line in outs:
        assert "JoinError" in line and "rank(s) 2 of WORLD_SIZE=3 never arrived" in line, outs


@needs_join
def test_join_world_size_differs(tmp_path):
    """Rank 0 told WORLD_SIZE=2, rank 1 told 3: both raise JoinError naming
    the two sizes."""
    outs = _join(tmp_path, [2, 3])
    for line in outs:
        assert "JoinError" in line and "WORLD_SIZE differs" in line, outs
        assert "has 2" in line and "has 3" in line, outs


@needs_join
def test_join_four_ranks(tmp_path):
    """Four singletons join (two rounds) and come out ranked 0..3."""
    outs = _join(tmp_path, [4, 4, 4, 4], timeout_s=120)
    assert outs == [f"joined {r} of 4, sum 6" for r in range(4)], outs


@needs_join
def test_join_retried_in_the_same_process(tmp_path):
    """A failed join (the ranks disagree on WORLD_SIZE) followed by gs.init
    again in the same processes, now agreeing: the retry joins (fresh keys,
    the first attempt's ports closed) and its allreduce is right."""
    outs = _join(tmp_path, [2, 3], timeout_s=60, retry_size=2, whole=True)
    for r, lines in enumerate(outs):
        failed = [x for x in lines if "JoinError" in x]
        assert len(failed) == 1 and "WORLD_SIZE differs" in failed[0], lines
        assert lines[-1] == f"joined {r} of 2, sum 1", lines


@needs_join
def test_two_jobs_on_one_rendezvous(tmp_path):
    """A second job started on the first one's store (two jobs on one
    MASTER_PORT, or a store file left from an earlier run): every rank of the
    second job raises JoinError saying the rendezvous is shared, and none is
    joined to the first job's processes."""
    store = str(tmp_path / "store")
    first = _join(tmp_path, [2, 2], timeout_s=60, store=store)
    assert first == [f"joined {r} of 2, sum 1" for r in range(2)], first
    second = _join(tmp_path, [2, 2], timeout_s=60, store=store)
    for line in second:
        assert "JoinError" in line and "two jobs" in line and "share one" in line, second


@needs_join
def test_join_store_goes_away(tmp_path):
    """The store's host exits while rank 0 waits for rank 1 (never started):
    rank 0 raises JoinError saying it lost the store."""
    port = _free_port()
    host = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch.distributed as d; "
         f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
         "print('up', flush=True); s.wait(['gradsync/join/1/arrived/0']); time.sleep(1)"],
        env=_singleton_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        outs = _join(tmp_path, [2], timeout_s=60, store=f"tcp:{port}")
    finally:
        host.kill()
        host.wait()
    # raised on the loss (a timeout would say "waited ... for")
    assert "JoinError" in outs[0] and "lost the rendezvous store" in outs[0], outs


def test_mpich5_is_refused_by_name(monkeypatch):
    """An MPI known to fail connect/accept between singletons (MPICH 5.0.x)
    is refused before any rank waits, naming it and the fix."""
    class FakeMPI:
        @staticmethod
        def Get_library_version():
            return "MPICH Version:      5.0.2\nMPICH Release date: x\n"

    monkeypatch.setattr(_world, "MPI", FakeMPI)
    with pytest.raises(gs.UnsupportedError, match=r"5\.0\.2.*mpich>=4\.3,<5"):
        _world.check_can_join()


def test_init_refuses_missing_rendezvous(monkeypatch):
    """A singleton told WORLD_SIZE=2 with no store and no MASTER_ADDR raises
    naming what to set."""
    for var in _world.LAUNCHER_VARS + ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        gs.init()
