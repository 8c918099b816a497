"""gradsync.torch.distributed.init() (issue 46 item 3; docs/TORCH_BACKEND.md
"Frameworks"): the default group on gradsync, created once, that frameworks
choosing their own backend then find. Idempotent on a gradsync group,
refuses another backend's group, a world of one with no launcher, MPI's numbering
(and LOCAL_RANK) under mpiexec."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import os, json, sys
import torch.distributed as dist
import gradsync.torch.distributed as gtd
first = gtd.init()
again = gtd.init()
assert first is again is dist.group.WORLD, (first, again)
assert dist.get_backend() == "gradsync"
t = __import__("torch").ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
rec = json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": t.tolist(),
                  "env": [os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                      "LOCAL_WORLD_SIZE")]})
open(os.path.join(sys.argv[1], "rank%d.json" % dist.get_rank()), "w").write(rec)
dist.destroy_process_group()
"""


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "MPIR_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(TOP, "pyx")] +
                                        [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GRADSYNC_TIMEOUT_SECONDS", "60")
    return env


def _records(folder):
    import json
    return [json.load(open(p)) for p in sorted(folder.glob("rank*.json"))]


@pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a group")
def test_init_world_of_one_without_launcher(tmp_path):
    if int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) > 1:
        pytest.skip("starts its own processes: runs at one MPI rank")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=_clean_env(),
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    (rec,) = _records(tmp_path)
    assert (rec["rank"], rec["size"], rec["sum"]) == (0, 1, [1.0, 1.0, 1.0])


def test_init_under_mpiexec_fills_the_environment(tmp_path):
    if int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) > 1:
        pytest.skip("starts its own processes: runs at one MPI rank")
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", CHILD, str(tmp_path)],
                         env=_clean_env(), capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    recs = _records(tmp_path)
    assert [(r["rank"], r["size"], r["sum"]) for r in recs] == [
        (0, 2, [3.0] * 3), (1, 2, [3.0] * 3)]
    assert [r["env"] for r in recs] == [["0", "2", "0", "2"], ["1", "2", "1", "2"]]


def test_init_refuses_another_backends_group(tmp_path):
    if int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))) > 1:
        pytest.skip("starts its own processes: runs at one MPI rank")
    code = ("import torch.distributed as dist, gradsync.torch.distributed as gtd\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, "
            "world_size=1)\n"
            "try:\n    gtd.init()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                         text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED" in out.stdout and "'gloo'" in out.stdout, out.stdout
