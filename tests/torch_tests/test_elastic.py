"""DDP on the gradsync backend trains on after a rank is lost (issue 48 item 4).

Four processes joined by gs.init through a folder store make torch's default
group with init_method="gradsync://" and train a linear layer with DDP under
gradsync.elastic.run; rank 2 is SIGKILLed before a chosen step. DDP's
reducer re-raises the collective's PeerLostError as a RuntimeError: run()
tells it from other errors by the world's lost member, shrinks, restores
the last commit, and on_change remakes the default group
(gradsync.torch.distributed.remake_default_group) and DDP. The survivors'
weights are checked bit for bit against NumPy's float32 replay of what DDP
computes from the history they report: each member's gradient divided by
the world size, summed in rank order, subtracted (SGD, lr 1).
"""
import json
import signal

import numpy as np
import pytest
from mpi4py import MPI

pytest.importorskip("torch")

from gsutil import run_joined  # noqa: E402

STEPS = 6

JOB = r"""
import json, os, signal, sys
import numpy as np
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import gradsync as gs
import gradsync.torch.distributed as gsd
from joined import DirStore

rank, store, kill_step = int(sys.argv[1]), DirStore(sys.argv[2]), int(sys.argv[3])
gs.init(store, rank=rank, world_size=4)
gs.set_timeout(60.0)
dist.init_process_group("gradsync", init_method="gradsync://")
net = torch.nn.Linear(8, 3, bias=False)
with torch.no_grad():
    net.weight.zero_()
opt = torch.optim.SGD(net.parameters(), lr=1.0)
model = DDP(net)

def batch(step, who):
    return torch.arange(16, dtype=torch.float32).reshape(2, 8) %% 5 + (step + 1) * (who + 1)

def on_change(comm):
    global model
    gsd.remake_default_group()
    model = DDP(net)

def train(state, comm):
    members = [int(r) for r in comm.allgather(np.array([rank], np.int64))]
    while state.step < %(steps)d:
        if rank == 2 and state.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(batch(state.step, rank)).sum().backward()
        opt.step()
        state.history.append(members)
        state.step += 1
        state.commit()

state = gs.elastic.State(weight=net.weight.data, step=0, history=[])
gs.elastic.run(train, state, on_change=on_change)
result = {"rank": rank, "w": net.weight.data.numpy().tobytes().hex(), "history": state.history}
os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
os._exit(0)  # MPI_Finalize would wait for the lost rank
""" % {"steps": STEPS}


def _reference(history):
    """DDP's arithmetic in float32: per step, each member's gradient (the
    column sums of its batch, for every output row) divided by the world
    size, summed in rank order, subtracted from the weights."""
    w = np.zeros((3, 8), np.float32)
    for step, members in enumerate(history):
        total = np.zeros((3, 8), np.float32)
        for who in members:
            x = (np.arange(16, dtype=np.float32).reshape(2, 8) % 5 + (step + 1) * (who + 1))
            g = np.broadcast_to(x.sum(axis=0, dtype=np.float32), (3, 8))
            total = total + g / np.float32(len(members))
        w = w - total
    return w


@pytest.mark.skipif(MPI.COMM_WORLD.size > 1, reason="starts its own 4-process job")
def test_ddp_trains_on_after_a_rank_is_lost(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    procs, outs = run_joined(JOB, 4, {"GRADSYNC_TIMEOUT_SECONDS": "60",
                                      "GRADSYNC_FLIGHT_DIR": str(tmp_path / "flight")},
                             args=(store, 2), timeout=150)
    assert procs[2].returncode == -signal.SIGKILL, outs[2][-4000:]
    got = {}
    for r in (0, 1, 3):
        assert procs[r].returncode == 0, f"rank {r}:\n{outs[r][-4000:]}"
        line = [ln for ln in outs[r].splitlines() if ln.startswith("RESULT ")]
        got[r] = json.loads(line[-1][len("RESULT "):])
    history = got[0]["history"]
    assert history == [[0, 1, 2, 3]] * 2 + [[0, 1, 3]] * (STEPS - 2), history
    assert all(got[r]["w"] == got[0]["w"] and got[r]["history"] == history for r in (1, 3))
    assert bytes.fromhex(got[0]["w"]) == _reference(history).tobytes()
