"""srun starts one gradsync world (issue 29), on a real one-node Slurm
(scripts/slurmlocal: slurmctld, slurmd and munged of Debian's slurm-wlm,
started for this module and stopped after it):

- `srun --mpi=pmi2`: MPI's world (MPICH takes Slurm's PMI-2), ranks as
  Slurm's task ids, for a plain Communicator and for the torch backend;
- srun without PMI (`--mpi=none`, the MpiDefault of many sites) and
  MASTER_ADDR/MASTER_PORT set: the tasks are MPI singletons, and gradsync
  joins them, numbered by SLURM_PROCID of SLURM_STEP_NUM_TASKS;
- srun without PMI and no rendezvous: every task raises, naming srun
  --mpi=pmi2 (before, each task was silently a world of 1).

A plain pytest (one process, root; skipped without slurm-wlm and munge):
    python -m pytest tests/cluster/test_slurm.py
"""
import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SLURMLOCAL = os.path.join(ROOT, "scripts", "slurmlocal")
JOB = os.path.join(HERE, "slurm_job.py")


def _possible():
    r = subprocess.run([sys.executable, SLURMLOCAL, "--check"], capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


POSSIBLE, WHY = _possible()
pytestmark = pytest.mark.skipif(not POSSIBLE, reason=WHY)

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

# name: (srun arguments, tasks, extra environment, job mode)
STEPS = {"pmi2": (["--mpi=pmi2"], 3, {}, "allreduce"),
         "none": (["--mpi=none"], 2, {}, "allreduce"),
         "joined": (["--mpi=none"], 3, {"MASTER_ADDR": "127.0.0.1"}, "allreduce")}
if HAVE_TORCH:
    STEPS["torch"] = (["--mpi=pmi2"], 2, {}, "torch")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Runs every step inside one slurmlocal; returns name -> (srun's exit
    status, {task: record}, log)."""
    base = tmp_path_factory.mktemp("slurm")
    lines = []
    for name, (args, n, env, mode) in STEPS.items():
        out = base / name
        out.mkdir()
        env = dict(env)
        if "MASTER_ADDR" in env:
            env["MASTER_PORT"] = str(free_port())
        exports = " ".join("%s=%s" % kv for kv in env.items())
        lines.append("%s timeout 150 srun -n %d %s %s %s %s %s > %s/log 2>&1; echo $? > %s/rc" % (
            exports, n, " ".join(args), sys.executable, JOB, mode, out, out, out))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "pyx"))
    for var in [v for v in env if v.startswith(("PMI_", "PMIX_", "HYDRA_", "SLURM_"))]:
        env.pop(var)
    r = subprocess.run([sys.executable, SLURMLOCAL, "--", "bash", "-c", "\n".join(lines)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {}
    for name in STEPS:
        out = base / name
        recs = {}
        for f in out.glob("*.json"):
            rec = json.loads(f.read_text())
            recs[rec["task"]] = rec
        got[name] = (int((out / "rc").read_text()), recs, (out / "log").read_text())
    return got


def assert_one_world(step, n):
    rc, recs, log = step
    assert rc == 0, log
    assert sorted(recs) == list(range(n)), log
    want = [n * (n + 1) / 2] * 5
    for task, rec in recs.items():
        assert "error" not in rec, rec
        assert (rec["rank"], rec["size"]) == (task, n), rec   # ranked as Slurm ranked them
        assert rec["got"] == want, rec


def test_srun_with_pmi2_is_mpis_world(steps):
    assert_one_world(steps["pmi2"], 3)


def test_srun_without_pmi_joins_through_master_addr(steps):
    assert_one_world(steps["joined"], 3)


def test_srun_without_pmi_or_rendezvous_raises_on_every_task(steps):
    rc, recs, log = steps["none"]
    assert rc != 0, log
    assert sorted(recs) == [0, 1], log
    for rec in recs.values():
        assert rec.get("error") == "ValueError", rec
        assert "srun started 2 tasks" in rec["message"] and "--mpi=pmi2" in rec["message"], rec
        assert "MASTER_ADDR" in rec["message"], rec


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not importable")
def test_torch_backend_under_srun(steps):
    assert_one_world(steps["torch"], 2)
