"""gradsyncrun: horovodrun's arguments as an mpiexec command line (both MPI
flavours), and a real two-process launch."""
import os
import subprocess
import sys

import pytest
from hvdtest import Checks, hvd

from gradsync.horovod import run  # noqa: E402

pytestmark = pytest.mark.mpi
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _cmd(argv, kind):
    args = run.parser().parse_args(argv)
    return run.command(args, kind)


def test_command_lines(tmp_path):
    c = Checks()
    argv = ["-np", "4", "-H", "h1:2,h2:2", "--fusion-threshold-mb", "32", "--no-stall-check",
            "--mpiexec", "mpiexec", "python", "train.py", "--lr", "0.1"]
    c.check(_cmd(argv, "mpich") == [
        "mpiexec", "-n", "4", "-hosts", "h1:2,h2:2", "-genv", "HOROVOD_FUSION_THRESHOLD",
        str(32 * 2**20), "-genv", "HOROVOD_STALL_CHECK_DISABLE", "1", "python", "train.py",
        "--lr", "0.1"], _cmd(argv, "mpich"))
    c.check(_cmd(argv, "openmpi") == [
        "mpiexec", "-n", "4", "-H", "h1:2,h2:2", "-x", f"HOROVOD_FUSION_THRESHOLD={32 * 2**20}",
        "-x", "HOROVOD_STALL_CHECK_DISABLE=1", "python", "train.py", "--lr", "0.1"],
        _cmd(argv, "openmpi"))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# workers\nnode1 slots=4\nnode2 slots=2  # second\nnode3\n")
    cmd = _cmd(["-np", "6", "--hostfile", str(hostfile), "--mpiexec", "mpiexec", "a.out"], "mpich")
    c.check(cmd[3] == "-f", cmd)
    with open(cmd[4]) as f:
        c.check(f.read().split() == ["node1:4", "node2:2", "node3"], "Hydra host file")
    os.unlink(cmd[4])
    cmd = _cmd(["-np", "6", "--hostfile", str(hostfile), "--mpiexec", "mpiexec", "a.out"],
               "openmpi")
    c.check(cmd[3:5] == ["--hostfile", str(hostfile)], cmd)
    c.raises(SystemExit, lambda: _cmd(["-np", "2", "--gloo", "a.out"], "mpich"), "--gloo")
    c.done()


@pytest.mark.skipif(hvd.size() != 1, reason="launches its own job: run at one rank")
def test_launch_two_processes(tmp_path):
    """Each launched rank reports into its own file: the launcher merges the
    ranks' stdout as it arrives, so lines from two ranks can interleave."""
    c = Checks()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    env["PYTHONPATH"] = os.path.join(ROOT, "pyx") + os.pathsep + env.get("PYTHONPATH", "")
    program = ("import os, gradsync.horovod.torch as hvd, torch; hvd.init(); "
               "s = int(hvd.allreduce(torch.ones(1), op=hvd.Sum)); "
               f"open(os.path.join({str(tmp_path)!r}, str(hvd.rank())), 'w')"
               ".write(f'{hvd.rank()} {hvd.size()} {s}')")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gradsyncrun"), "-np", "2",
                          sys.executable, "-c", program], env=env, capture_output=True, text=True,
                         timeout=300)
    c.check(out.returncode == 0, out.stderr[-2000:])
    reports = sorted(f.read_text() for f in tmp_path.iterdir())
    c.check(reports == ["0 2 2", "1 2 2"], reports)
    c.done()


def test_shutdown_init_and_knobs(monkeypatch):
    """HOROVOD_FUSION_THRESHOLD and HOROVOD_STALL_CHECK_TIME_SECONDS reach the
    communicator at init(); knobs gradsync has no use for are accepted; after
    shutdown() calls raise Horovod's error and init() starts again."""
    import gradsync as gs
    from gradsync.horovod import state

    c = Checks()
    hvd.shutdown()
    c.check(not hvd.is_initialized(), "is_initialized after shutdown")
    c.raises(ValueError, hvd.rank, "rank() before init")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(3 << 20))
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "17")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "0")
    from gradsync import MPI

    hvd.init(comm=MPI.COMM_WORLD)
    try:
        world = state.world_engine().comm
        c.check(world.fusion_threshold == 3 << 20, f"fusion threshold {world.fusion_threshold}")
        c.check(hvd.size() == MPI.COMM_WORLD.size and hvd.rank() == MPI.COMM_WORLD.rank,
                "topology")
        c.check(hvd.local_size() * hvd.cross_size() >= hvd.size() and
                0 <= hvd.cross_rank() < hvd.cross_size(), "cross topology")
        c.check(isinstance(world, gs.Communicator), "a gradsync communicator")
        out = hvd.allreduce(torch_ones(), op=hvd.Sum)
        c.check(int(out[0]) == hvd.size(), "allreduce after re-init")
    finally:
        hvd.shutdown()
        monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD")
        hvd.init()
    c.done()


def torch_ones():
    import torch

    return torch.ones(3)
