"""Losing a host and training on (issue 48), on a simulated cluster of two
hosts of two ranks (scripts/simcluster --per-host; tests/cluster/
elastic_job.py): singletons joined through a torch TCPStore at host 0 train
with gradsync.elastic; host 1's data link goes down at a known step, during
the step's (hierarchical) allreduce. Host 0's ranks time out
(GRADSYNC_TIMEOUT_SECONDS), agree without host 1, whose ranks can no longer
reach the store, and train every remaining step as two; their weights are
bit for bit NumPy's replay of the history they report. Host 1's ranks end
with an error, not a hang.

A plain pytest (one process, root, no MPI of its own):
    python -m pytest tests/cluster/test_cluster_elastic.py
"""
import json
import os
import socket
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import elastic_job  # noqa: E402
from joined import replay  # noqa: E402
from simcluster_skip import HERE, ROOT, SIMCLUSTER, needs_simcluster  # noqa: E402

TIMEOUT = 5.0
pytestmark = needs_simcluster


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_a_host_lost_the_other_trains_on(tmp_path):
    pytest.importorskip("torch")  # the rendezvous is torch's TCPStore
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    env.update(PYTHONPATH=os.path.join(ROOT, "pyx"), GRADSYNC_TIMEOUT_SECONDS=str(TIMEOUT),
               GRADSYNC_FLIGHT_DIR=str(tmp_path / "flight"), TMPDIR=str(tmp_path))
    cmd = [sys.executable, SIMCLUSTER, "--hosts", "2", "--per-host", "--timeout", "200", "--",
           sys.executable, os.path.join(HERE, "elastic_job.py"), str(out), str(_free_port())]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=260)
    log = run.stdout + run.stderr
    recs = {}
    for r in range(4):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n{log[-6000:]}"
        recs[r] = json.loads(path.read_text())
    for r in (2, 3):  # host 1, cut off: an error, not a hang
        assert "error" in recs[r], recs[r]
    for r in (0, 1):
        assert "error" not in recs[r], recs[r].get("error", "") + "\n" + log[-4000:]
    history = recs[0]["history"]
    assert recs[1]["history"] == history and recs[1]["w"] == recs[0]["w"]
    k = elastic_job.LINK_STEP
    assert history in ([[0, 1, 2, 3]] * s + [[0, 1]] * (elastic_job.STEPS - s)
                       for s in (k, k + 1)), history
    assert bytes.fromhex(recs[0]["w"]) == replay(history, elastic_job.N).tobytes()
