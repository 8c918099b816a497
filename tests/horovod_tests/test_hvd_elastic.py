"""The Horovod drop-in's elastic mode across a lost rank (issue 48 item 4):
``horovod.run(train, np=4, min_np=3)`` with ``@hvd.elastic.run`` and a
``TorchState``, as Horovod's elastic examples write it. The run is
gradsyncrun's elastic launch; rank 2 SIGKILLs itself at epoch 2. The
survivors' HorovodInternalError resets the world (a shrink to three, no
NotImplementedError), the state goes back to its last commit and training
goes on; horovod.run returns the three survivors' results in their final
rank order. The weights are checked bit for bit against a float64 replay of
the members each epoch reports (the gradients are whole numbers)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import gradsync.horovod.torch as hvd  # noqa: E402

HOROVOD = os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__)))  # gradsync/horovod
PYX = os.path.dirname(os.path.dirname(HOROVOD))
ALIAS = os.path.join(HOROVOD, "alias")
EPOCHS = 5

JOB = r"""
import json, os, signal
import horovod


def train_job():
    import torch
    import horovod.torch as hvd
    hvd.init()
    who = hvd.rank()  # the rank it started as: its gradients' identity
    model = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    state = hvd.elastic.TorchState(model, None, epoch=0, history=[])

    @hvd.elastic.run
    def train(state):
        members = [int(m) for m in hvd.allgather(torch.tensor([who]))]
        while state.epoch < %(epochs)d:
            if who == 2 and state.epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.full((2, 4), float((state.epoch + 1) * (who + 1)))
            total = hvd.allreduce(g, op=hvd.Sum, name="g")
            with torch.no_grad():
                model.weight.sub_(total)
            state.history.append(members)
            state.epoch += 1
            state.commit()
        return hvd.size()

    size = train(state)
    return who, size, state.history, model.weight.detach().numpy().tobytes().hex()


if __name__ == "__main__":
    print("RESULT", json.dumps(horovod.run(train_job, np=4, min_np=3)), flush=True)
""" % {"epochs": EPOCHS}


@pytest.mark.skipif(MPI.COMM_WORLD.size > 1, reason="starts a job of its own: runs at one rank")
def test_horovod_run_min_np_survives_a_lost_rank(tmp_path):
    script = tmp_path / "elastic_job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join([ALIAS, PYX, env.get("PYTHONPATH", "")])
    env.update(GRADSYNC_TIMEOUT_SECONDS="60", GRADSYNC_FLIGHT_DIR=str(tmp_path / "flight"),
               TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=240)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    assert [r[0] for r in results] == [0, 1, 3]  # the survivors, in their final rank order
    assert all(r[1] == 3 for r in results)
    history = results[0][2]
    assert history == [[0, 1, 2, 3]] * 2 + [[0, 1, 3]] * (EPOCHS - 2), history
    w = np.zeros((2, 4))
    for epoch, members in enumerate(history):
        w -= sum((epoch + 1) * (m + 1) for m in members)
    assert all(r[3] == results[0][3] for r in results)
    assert bytes.fromhex(results[0][3]) == w.astype(np.float32).tobytes()
    assert "gradsyncrun: rank 2 ended with signal 9 (SIGKILL)" in out.stderr, out.stderr[-3000:]
