"""Losing a rank and training on (docs/DESIGN.md section 16, issue 48).

Four processes joined by gs.init through a folder store (no launcher, so a
killed one takes nobody with it) train with gradsync.elastic; rank 2 is
SIGKILLed at a chosen step, between steps or while it waits inside a small
(shared-region) or large (cross-memory) allreduce. The three survivors
shrink, go back to their last commit and train on. Each prints its final
weights and the members of every committed step; the test recomputes the
weights from that history with NumPy (the gradients are whole numbers, so
every order of summation gives the same float32 bits) and checks that the
survivors agree bit for bit, that the loss came at the step it was made at
(or the next, when the lost rank's contribution had reached them all), and
that the survivors trained every step. A second kill while the
survivors agree (rank 3, after it registered) leaves two. Under mpiexec,
shrink raises UnsupportedError on every rank.
"""
import json
import os
import subprocess
import sys
import time

import pytest
from joined import replay
from mpi4py import MPI

import gradsync as gs
from gsutil import child_env, collectively, finish, run_joined, shm_entries, start_joined

WORLD = MPI.COMM_WORLD
STEPS = 6

JOB = r"""
import json, os, signal, sys, threading, time
import numpy as np
import gradsync as gs
from gradsync import _shrink
from joined import DirStore, train_step

rank, store, mode, kill_step, n, size, grow_step = (
    int(sys.argv[1]), DirStore(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
    int(sys.argv[6]), int(sys.argv[7]))
STEPS = %(steps)d
if mode == "launched":  # by gradsyncrun --min-np: the world from the environment
    store = DirStore(os.environ["GRADSYNC_STORE_DIR"])
    rank = int(os.environ.get("RANK", 4))  # a replacement has no RANK: it is the fifth
if mode == "newcomer" or os.environ.get("GRADSYNC_JOIN_RUNNING") == "1":
    while not store.check(["test/at-grow-step"]):  # joins at the commit after grow_step
        time.sleep(0.01)
if mode == "newcomer":
    gs.elastic.join_running(store)
elif mode != "launched":
    gs.init(store, rank=rank, world_size=size)
gs.set_timeout(60.0)  # far away: only the watch on the peers ends a wait soon

if mode == "second" and rank == 3:  # dies once it has registered with the survivors
    def decide_and_die(self, offer):
        os.kill(os.getpid(), signal.SIGKILL)
    _shrink._Agreement.decide = decide_and_die

def train(state, comm):
    members = [int(r) for r in comm.allgather(np.array([rank], np.int64))]
    while state.step < STEPS:
        if state.step == grow_step and mode != "newcomer" and comm.size < 4:  # one is on its way
            store.set("test/at-grow-step", b"1")
            while not store.check(["gradsync/grow/want/1"]):
                time.sleep(0.01)
        if rank == 2 and state.step == kill_step:
            if mode in ("between", "second", "replace", "launched"):
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif state.step == kill_step and mode.startswith("inside"):
            time.sleep(0.3)  # rank 2 waits inside the allreduce when it dies
        train_step(state, comm, rank, members, "bfloat16" if mode == "inside-wire" else None)
    return state.w

state = gs.elastic.State(w=np.zeros(n, np.float32), step=0, history=[])
w = gs.elastic.run(train, state, gs.Communicator(stall_seconds=0))
result = {"rank": rank, "w": w.tobytes().hex(), "history": state.history}
os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())  # one write: ranks share stdout
os._exit(0)  # MPI_Finalize would wait for the lost ranks
""" % {"steps": STEPS}

one_rank = pytest.mark.skipif(WORLD.size > 1, reason="starts its own 4-process job")


def _results(procs, outs, survivors):
    got = {}
    for r in survivors:
        assert procs[r].returncode == 0, f"rank {r}:\n{outs[r][-4000:]}"
        line = [ln for ln in outs[r].splitlines() if ln.startswith("RESULT ")]
        assert line, f"rank {r}:\n{outs[r][-4000:]}"
        got[r] = json.loads(line[-1][len("RESULT "):])
    return got


@one_rank
@pytest.mark.parametrize("mode,kill_step,n", [
    ("between", 2, 1001),         # rank 2 dies before its step's allreduce
    ("inside-small", 3, 1001),    # ... while it waits in a shared-region allreduce
    ("inside-large", 1, 600001),  # ... in a cross-memory one (2.4 MB: past the slot)
    ("inside-wire", 2, 300001),   # ... in a bfloat16 wire allreduce
])
def test_survivors_train_on_after_a_kill(tmp_path, mode, kill_step, n):
    store = tmp_path / "store"
    store.mkdir()
    before = shm_entries()
    procs, outs = run_joined(JOB, 4, {"GRADSYNC_TIMEOUT_SECONDS": "60",
                                      "GRADSYNC_FLIGHT_DIR": str(tmp_path / "flight")},
                             args=(store, mode, kill_step, n, 4, -1), timeout=120)
    assert procs[2].returncode == -9, outs[2][-4000:]
    got = _results(procs, outs, (0, 1, 3))
    history = got[0]["history"]
    assert all(got[r]["history"] == history and got[r]["w"] == got[0]["w"] for r in (1, 3))
    # the loss shows at the step rank 2 died in, or the next one when its
    # contribution had reached every survivor before it died; every step trained
    assert history in ([[0, 1, 2, 3]] * k + [[0, 1, 3]] * (STEPS - k)
                       for k in (kill_step, kill_step + 1)), history
    want = replay(history, n)
    assert bytes.fromhex(got[0]["w"]) == want.tobytes()
    assert shm_entries() - before == set()


@one_rank
def test_a_second_loss_while_agreeing_leaves_two(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    procs, outs = run_joined(JOB, 4, {"GRADSYNC_TIMEOUT_SECONDS": "60",
                                      "GRADSYNC_FLIGHT_DIR": str(tmp_path / "flight")},
                             args=(store, "second", 2, 33, 4, -1), timeout=120)
    assert procs[2].returncode == -9 and procs[3].returncode == -9, outs[3][-4000:]
    got = _results(procs, outs, (0, 1))
    history = got[0]["history"]
    assert got[1] == {**got[0], "rank": 1}
    assert history == [[0, 1, 2, 3]] * 2 + [[0, 1]] * (STEPS - 2), history
    assert bytes.fromhex(got[0]["w"]) == replay(history, 33).tobytes()


def test_shrink_under_an_mpi_launcher_raises_on_every_rank():
    """The MPI library owns mpiexec's world: no rank can be dropped from it."""
    comm = gs.Communicator()
    try:
        with collectively(comm, "shrink"):
            with pytest.raises(gs.UnsupportedError, match="joined from MPI singletons"):
                comm.shrink()
        assert not comm.closed  # nothing was given up
    finally:
        comm.close()


@one_rank
def test_a_newcomer_joins_at_a_commit(tmp_path):
    """Three ranks train; a fourth process, started beside them, calls
    join_running once they reach step 2 (they wait there for its ticket, so
    the step is known); they admit it at the commit after step 2: from step
    3 on, four train, the newcomer from the others' state, all bit for bit."""
    store = tmp_path / "store"
    store.mkdir()
    env = {"GRADSYNC_TIMEOUT_SECONDS": "60", "GRADSYNC_FLIGHT_DIR": str(tmp_path / "flight")}
    procs = [start_joined(JOB, r, env, (store, "member", -1, 101, 3, 2)) for r in range(3)]
    procs.append(start_joined(JOB, 3, env, (store, "newcomer", -1, 101, 3, 2)))
    outs = finish(procs)
    got = _results(procs, outs, (0, 1, 2, 3))
    history = got[0]["history"]
    assert history == [[0, 1, 2]] * 3 + [[0, 1, 2, 3]] * (STEPS - 3), history
    assert all(got[r]["w"] == got[0]["w"] and got[r]["history"] == history for r in (1, 2, 3))
    assert bytes.fromhex(got[0]["w"]) == replay(history, 101).tobytes()


@one_rank
def test_a_replacement_brings_the_world_back_to_four(tmp_path):
    """Rank 2 of 4 dies before step 1; the survivors train on as three; a
    replacement started after the loss joins at the commit after step 3."""
    store = tmp_path / "store"
    store.mkdir()
    env = {"GRADSYNC_TIMEOUT_SECONDS": "60", "GRADSYNC_FLIGHT_DIR": str(tmp_path / "flight")}
    procs = [start_joined(JOB, r, env, (store, "replace", 1, 101, 4, 3)) for r in range(4)]
    procs[2].wait(timeout=120)
    assert procs[2].returncode == -9
    procs.append(start_joined(JOB, 4, env, (store, "newcomer", -1, 101, 4, 3)))
    outs = finish(procs)
    got = _results(procs, outs, (0, 1, 3, 4))
    history = got[0]["history"]
    assert history == [[0, 1, 2, 3]] + [[0, 1, 3]] * 3 + [[0, 1, 3, 4]] * (STEPS - 4), history
    assert all(got[r]["w"] == got[0]["w"] and got[r]["history"] == history for r in (1, 3, 4))
    assert bytes.fromhex(got[0]["w"]) == replay(history, 101).tobytes()


GRADSYNCRUN = [sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts", "gradsyncrun")]


@one_rank
@pytest.mark.parametrize("replacements", [0, 1])
def test_gradsyncrun_min_np_keeps_the_survivors(tmp_path, replacements):
    """gradsyncrun -np 4 --min-np 3: rank 2 dies before step 1, the job goes
    on as three and gradsyncrun returns 0, naming the loss; with
    --replacements 1 a fifth process takes its place at the commit after
    step 3 (the survivors wait there for its ticket)."""
    grow_step = 3 if replacements else -1
    cmd = GRADSYNCRUN + ["-np", "4", "--min-np", "3", "--replacements", str(replacements),
                         sys.executable, "-c", JOB, "-1", "-", "launched", "1", "101", "4",
                         str(grow_step)]
    env = child_env()
    env.update(GRADSYNC_TIMEOUT_SECONDS="60", GRADSYNC_FLIGHT_DIR=str(tmp_path / "flight"),
               TMPDIR=str(tmp_path))
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "gradsyncrun: rank 2 ended with signal 9 (SIGKILL); 3 still running" in out, out[-4000:]
    results = [json.loads(ln[len("RESULT "):]) for ln in run.stdout.splitlines()
               if ln.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == ([0, 1, 3, 4] if replacements else [0, 1, 3])
    history = results[0]["history"]
    after = [[0, 1, 3]] * (STEPS - 1) if not replacements else \
        [[0, 1, 3]] * 3 + [[0, 1, 3, 4]] * (STEPS - 4)
    assert history == [[0, 1, 2, 3]] + after, history
    assert all(r["w"] == results[0]["w"] and r["history"] == history for r in results)
    assert bytes.fromhex(results[0]["w"]) == replay(history, 101).tobytes()
    assert not list(tmp_path.glob("gradsyncrun-store-*"))  # its store folder is gone


MPIEXEC_JOB = r"""
import os, signal, sys, time
import numpy as np
import gradsync as gs
comm = gs.Communicator(stall_seconds=0)
out = open(os.path.join(sys.argv[1], "rank%d.txt" % comm.rank), "w", buffering=1)
x = np.ones(10, np.float32)
comm.allreduce_(x)
if comm.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    comm.allreduce_(x)
except gs.PeerLostError as e:
    out.write("PeerLostError %s\n" % (e.ranks,))
    try:
        comm.shrink(e)
    except gs.UnsupportedError:
        out.write("shrink: UnsupportedError\n")
time.sleep(1.0)  # mpiexec has returned by now
out.write("still running\n")
os._exit(0)
"""


def _mpiexec():
    near = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return os.environ.get("MPIEXEC") or (near if os.path.exists(near) else "mpiexec")


@one_rank
def test_mpiexec_ends_every_rank_when_one_dies(tmp_path):
    """MPICH's mpiexec (Hydra) ends the other ranks when one dies: no
    survivor gets to train on (what docs/GUIDE.md section 2.16 says; its
    -disable-auto-cleanup leaves them running only sometimes, and MPI's
    world cannot shrink anyway: gradsyncrun --min-np is the launcher for
    that)."""
    version = subprocess.run([_mpiexec(), "--version"], capture_output=True, text=True)
    if "HYDRA" not in version.stdout.upper():
        pytest.skip("not MPICH's Hydra")
    env = {k: v for k, v in child_env().items() if not k.startswith("MPIR_CVAR")}
    run = subprocess.run([_mpiexec(), "-n", "3", sys.executable, "-c", MPIEXEC_JOB,
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0  # a rank was killed: mpiexec says so
    time.sleep(2.0)  # a survivor left running would have written "still running" by now
    files = [tmp_path / f"rank{r}.txt" for r in (0, 1)]
    assert all("still running" not in f.read_text() for f in files if f.exists())
