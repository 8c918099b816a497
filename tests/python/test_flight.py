"""The flight recorder and the doctor (issue 31): a rank that skips a
collective, a rank that calls another one, shapes that differ on a
subgroup, a rank stuck in its own code; each run leaves one dump per rank
and `gradsync.doctor` names the rank, the call and the test's own line.
Dumps on demand and on SIGUSR1 are checked against the calls this test
made; the doctor is also checked on dumps written by hand."""
import inspect
import json
import os
import re
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gradsync import doctor
from gsutil import collectively, run_child, run_joined

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
HERE = os.path.basename(__file__)


def line():
    """The caller's line number (the call on the next line is recorded there)."""
    return inspect.currentframe().f_back.f_lineno + 1


@pytest.fixture
def flight():
    """A dump directory all ranks share, the callers' stacks on."""
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="gs-flight-") if WORLD.rank == 0 else None)
    gs.flight_record_dir(folder)
    gs.flight_stacks(True)
    yield folder
    gs.flight_stacks(False)
    gs.set_timeout(0)
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def read_dump(path):
    with open(path) as f:
        recs = [json.loads(ln) for ln in f]
    assert all(r["v"] == 1 for r in recs)
    return recs


def wait_for(paths, limit=60.0):
    """Polls until every path exists (bounded: a result or a failure)."""
    deadline = time.monotonic() + limit
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.005)
    return all(os.path.exists(p) for p in paths)


def rank_file(folder, r):
    return os.path.join(folder, "rank-%d.jsonl" % r)


def diagnose_on_root(folder):
    """Rank 0's doctor verdict (code, verdict) for every rank."""
    WORLD.Barrier()
    rep = doctor.diagnose(folder) if WORLD.rank == 0 else None
    return WORLD.bcast((rep.code, rep.verdict, "\n".join(rep.evidence)) if rep else None)


def test_dump_on_demand(flight):
    comm = gs.Communicator()
    x = np.ones(40, np.float32)
    lines = []
    for _k in range(3):
        lines.append(line())
        comm.allreduce_(x, op="max")
    path = gs.dump_flight_record("checkpoint")
    recs = read_dump(path)
    comm.close()
    with collectively():
        assert path == rank_file(flight, WORLD.rank)
        head = recs[0]
        assert head["type"] == "header" and head["reason"] == "checkpoint"
        assert head["rank"] == WORLD.rank and head["world_size"] == WORLD.size
        sites = {r["site"]: r["stack"] for r in recs if r["type"] == "site"}
        calls = [r for r in recs if r["type"] == "call"][-3:]
        assert [c["op"] for c in calls] == ["allreduce"] * 3
        assert [c["seq"] for c in calls] == [calls[0]["seq"] + k for k in range(3)]
        for c, ln in zip(calls, lines):
            assert (c["dtype"], c["count"], c["n"], c["bytes"], c["redop"], c["status"]) == (
                "float32", 40, 1, 160, "max", "ok")
            assert c["t_enter"] <= c["t_done"]
            first = sites[c["site"]].split("\n")[0]
            assert first.endswith("%s:%d in test_dump_on_demand" % (HERE, ln)), first


def test_sigusr1_dumps_while_in_user_code(flight):
    comm = gs.Communicator()
    y = np.arange(5, dtype=np.int64)
    comm.broadcast_(y, root=0)
    path = rank_file(flight, WORLD.rank)
    gs.flight_on_signal()  # opt-in: importing gradsync takes no signal
    os.kill(os.getpid(), signal.SIGUSR1)
    seen = wait_for([path])  # this rank sleeps in its own code meanwhile
    recs = read_dump(path) if seen else []
    z = comm.allreduce_(np.ones(3))  # the job goes on
    comm.close()
    with collectively():
        assert seen, "no dump after SIGUSR1"
        assert recs[0]["reason"] == "SIGUSR1"
        last = [r for r in recs if r["type"] == "call"][-1]
        assert (last["op"], last["dtype"], last["count"], last["root"], last["status"]) == (
            "broadcast", "int64", 5, 0, "ok")
        assert np.array_equal(z, np.full(3, WORLD.size))


def test_rank_that_skips_a_collective(flight):
    """The last rank skips an allreduce and waits in a receive instead: every
    rank times out and dumps; the doctor names the rank, the call and lines."""
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    late = WORLD.size - 1
    comm = gs.Communicator(stall_seconds=0)
    x, y = np.ones(100, np.float32), np.zeros(3, np.int32)
    comm.allreduce_(x)
    comm.broadcast_(y, root=0)
    gs.set_timeout(1.0)
    raised = None
    try:
        if WORLD.rank == late:
            recv_line = line()
            comm.recv_(y, source=0, tag=5)
        else:
            call_line = line()
            comm.allreduce_(x)
    except gs.TimeoutError as exc:
        raised = exc
    gs.set_timeout(0)
    lines = WORLD.allgather(recv_line if WORLD.rank == late else call_line)
    code, verdict, evidence = diagnose_on_root(flight)
    comm.close()
    with collectively():
        assert raised is not None
        assert "flight record: " + rank_file(flight, WORLD.rank) in str(raised)
        assert os.path.exists(rank_file(flight, WORLD.rank))
        assert code == doctor.NEVER_CALLED, verdict
        assert verdict.startswith("rank %d never called allreduce #3 on WORLD" % late), verdict
        assert "recv int32[3] from rank 0 tag 5 at %s:%d" % (HERE, lines[late]) in verdict, verdict
        assert "at %s:%d" % (HERE, lines[0]) in verdict, verdict  # where the others wait
        assert "last call on WORLD" in verdict and "broadcast #2" in verdict, verdict


def test_rank_stuck_in_its_own_code(flight):
    """The last rank skips an allreduce and stays in its own loop; SIGUSR1
    dumps it there. The doctor says it is in its own code."""
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    late = WORLD.size - 1
    comm = gs.Communicator(stall_seconds=0)
    x = np.ones(10, np.float64)
    last_line = line()
    comm.allreduce_(x)
    gs.set_timeout(1.0)
    ok = True
    if WORLD.rank == late:
        gs.flight_on_signal()
        os.kill(os.getpid(), signal.SIGUSR1)
        # stays out of gradsync until the others have given up (their dumps)
        ok = wait_for([rank_file(flight, r) for r in range(WORLD.size)])
    else:
        with pytest.raises(gs.TimeoutError):
            comm.allreduce_(x)
    gs.set_timeout(0)
    lines = WORLD.bcast(last_line)
    code, verdict, _ = diagnose_on_root(flight)
    comm.close()
    with collectively():
        assert ok
        assert code == doctor.NEVER_CALLED, verdict
        assert verdict.startswith("rank %d never called allreduce #2 on WORLD" % late), verdict
        assert "its last call was allreduce float64[10] sum #1 at %s:%d" % (HERE, lines) in verdict
        assert "so it is in its own code" in verdict, verdict


def test_rank_that_calls_another_collective(flight):
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    comm = gs.Communicator()
    x = np.ones(100, np.float32)
    comm.barrier()
    with pytest.raises(gs.MismatchError) as info:
        if WORLD.rank == 0:
            my_line = line()
            comm.allreduce_(x)
        else:
            my_line = line()
            comm.broadcast_(x, root=0)
    lines = WORLD.allgather(my_line)
    code, verdict, _ = diagnose_on_root(flight)
    comm.close()
    others = "rank 1" if WORLD.size == 2 else "ranks 1-%d" % (WORLD.size - 1)
    with collectively():
        assert "flight record: " in str(info.value)
        assert code == doctor.MISMATCH, verdict
        assert re.fullmatch(
            "ranks disagree at call #2 on WORLD(#[0-9]+)?: " + re.escape(
                "rank 0 allreduce float32[100] sum at %s:%d vs %s broadcast float32[100] root 0 "
                "at %s:%d" % (HERE, lines[0], others, HERE, lines[1])), verdict), verdict


def test_shapes_differ_on_a_subgroup(flight):
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    comm = gs.Communicator()
    sub = comm.split(color=0 if WORLD.rank < 2 else 1)
    failed = None
    if WORLD.rank < 2:
        x = np.ones(100 if WORLD.rank == 0 else 50, np.float32)
        with pytest.raises(gs.MismatchError) as info:
            sub_line = line()
            sub.allreduce_(x)
        failed = str(info.value)
    else:
        gs.dump_flight_record("bystander")
    sub_line = WORLD.bcast(sub_line if WORLD.rank == 0 else None)
    code, verdict, _ = diagnose_on_root(flight)
    sub.close()
    comm.close()
    with collectively():
        assert WORLD.rank >= 2 or "flight record: " in failed
        assert code == doctor.MISMATCH, verdict
        # named by its members; at 2 ranks the subgroup is every rank
        name = r"WORLD#\d+" if WORLD.size == 2 else r"communicator \w+\.\d+ of ranks 0-1"
        assert re.match("ranks disagree at call #1 on %s: rank 0 allreduce float32\\[100\\] sum "
                        "at %s:%d" % (name, HERE, sub_line), verdict), verdict
        assert "vs rank 1 allreduce float32[50] sum" in verdict, verdict


def test_uncaught_gradsync_error_dumps(tmp_path):
    script = (
        "import numpy as np, gradsync as gs\n"
        "comm = gs.Communicator()\n"
        "comm.allreduce_(np.ones(4))\n"
        "comm.allreduce_(np.ones(4), op='no such op')\n")
    res = run_child(script, {"GRADSYNC_FLIGHT_DIR": str(tmp_path)})
    dumps = sorted(os.listdir(tmp_path))
    recs = read_dump(os.path.join(tmp_path, dumps[0])) if dumps else []
    with collectively():
        assert res.returncode != 0 and "ArgumentError" in res.stderr, res.stderr
        assert dumps == ["rank-0.jsonl"], (dumps, res.stderr)
        assert recs[0]["reason"].startswith("uncaught ArgumentError"), recs[0]
        # the rejected call still meets the other ranks, as "abandon"
        calls = [(r["op"], r["status"]) for r in recs if r["type"] == "call"]
        assert calls == [("allreduce", "ok"), ("abandon", "invalid_argument")], calls



def test_import_takes_no_signal_and_the_handler_chains(tmp_path):
    """Importing gradsync leaves SIGUSR1's handler as it was (MPI may have
    its own: read with sigaction before and after the import);
    gs.flight_on_signal() dumps on it and then calls the handler the program
    had installed first (Lightning's Slurm requeue uses SIGUSR1), and
    GRADSYNC_FLIGHT_SIGNAL=1 asks for it at import."""
    plain = run_child(
        "import ctypes, signal\n"
        "from mpi4py import MPI\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def handler():  # struct sigaction begins with the handler's address\n"
        "    old = ctypes.create_string_buffer(512)\n"
        "    assert libc.sigaction(signal.SIGUSR1, None, old) == 0\n"
        "    return old.raw[:8]\n"
        "before = handler()\n"
        "import gradsync as gs\n"
        "after = handler()\n"
        "gs.flight_on_signal()\n"
        "print(before == after, handler() != after)\n")
    chained = run_child(
        "import os, signal, time, gradsync as gs\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR1, lambda *a: seen.append(1))\n"
        "gs.flight_on_signal()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "for _ in range(2000):\n"
        "    d = gs.flight_record_dir()\n"
        "    if seen and os.path.isdir(d) and os.listdir(d): break\n"
        "    time.sleep(0.01)\n"
        "print('handler', len(seen), 'dumps', sorted(os.listdir(gs.flight_record_dir())))\n",
        {"GRADSYNC_FLIGHT_DIR": str(tmp_path / "chained")})
    by_env = run_child("import os, signal, time, gradsync as gs\n"
                       "os.kill(os.getpid(), signal.SIGUSR1)\n"
                       "for _ in range(2000):\n"
                       "    d = gs.flight_record_dir()\n"
                       "    if os.path.isdir(d) and os.listdir(d): break\n"
                       "    time.sleep(0.01)\n"
                       "print('dumps', sorted(os.listdir(gs.flight_record_dir())))\n",
                       {"GRADSYNC_FLIGHT_DIR": str(tmp_path / "env"),
                        "GRADSYNC_FLIGHT_SIGNAL": "1"})
    with collectively():
        assert plain.returncode == 0 and plain.stdout.split() == ["True", "True"], \
            (plain.stdout, plain.stderr[-800:])
        assert chained.returncode == 0, chained.stderr[-1500:]
        assert chained.stdout.split() == ["handler", "1", "dumps", "['rank-0.jsonl']"], \
            chained.stdout
        assert by_env.returncode == 0 and by_env.stdout.split() == ["dumps", "['rank-0.jsonl']"], \
            (by_env.stdout, by_env.stderr[-800:])

KILLED_JOB = r"""
import os, signal, sys, time
import numpy as np
import gradsync as gs


from joined import DirStore  # tests/python: the child's PYTHONPATH has it

rank, store = int(sys.argv[1]), DirStore(sys.argv[2])
gs.init(store, rank=rank, world_size=3)
gs.flight_stacks(True)
comm = gs.Communicator(stall_seconds=0)
x = np.ones(10, np.float32)
comm.allreduce_(x)
comm.allreduce_(x)
gs.set_timeout(3.0)
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)  # dies between two collectives
try:
    comm.allreduce_(x)
except gs.Error as e:
    print("rank %d raised %s" % (rank, type(e).__name__), flush=True)
# survivors leave together: a peer's wait ends within milliseconds now (the
# watch on the peers' processes), and one that exits while another still posts
# MPI operations to it can crash MPICH over UCX in that post (a segfault in
# MPI_Iallgatherv seen once at 4 ranks), which no caller can turn into an error
time.sleep(1.0)
os._exit(0)  # MPI_Finalize would wait for the dead rank
"""


@pytest.mark.skipif(WORLD.size > 1, reason="starts its own 3-rank job: runs at one rank")
def test_killed_rank(tmp_path):
    """Three processes joined into one world (no MPI launcher, as torchrun
    starts them) whose last rank is killed between two collectives: the
    survivors raise (timeout or the MPI's failure report) and dump, the dead
    rank leaves none, and the doctor says rank 2 left no dump while ranks 0-1
    wait in allreduce #3, exit status MISSING."""
    flight, store = tmp_path / "flight", tmp_path / "store"
    flight.mkdir()
    store.mkdir()
    procs, outs = run_joined(KILLED_JOB, 3, {
        "GRADSYNC_FLIGHT_DIR": str(flight),
        "GRADSYNC_TIMEOUT_SECONDS": "60"},  # the join's; the collective's is 3 s
        args=(store,))
    dumps = sorted(os.listdir(flight))
    rep = doctor.diagnose(str(flight))
    assert procs[2].returncode == -signal.SIGKILL, outs[2]
    for r in (0, 1):
        assert procs[r].returncode == 0 and "rank %d raised" % r in outs[r], outs[r][-3000:]
    assert dumps == ["rank-0.jsonl", "rank-1.jsonl"], (dumps, outs)
    assert rep.code == doctor.MISSING, rep.verdict
    assert rep.verdict.startswith("rank 2 left no dump (dead, or its host is down) and ranks 0-1 "
                                  "wait in allreduce #3 on WORLD"), rep.verdict
