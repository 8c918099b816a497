"""tests/conftest.py gives every rank a temporary base directory of its own,
outside pytest's shared /tmp/pytest-of-<user>, where concurrent sessions
prune each other's numbered directories; and make's run folder, and the
check of TMPDIR that `make test` ends with (scripts/test_run.sh)."""
import os
import subprocess
import time

import pytest
from mpi4py import MPI

from gsutil import collective_assert


def test_each_rank_has_its_own_base_directory(tmp_path_factory, tmp_path):
    world = MPI.COMM_WORLD
    base = str(tmp_path_factory.getbasetemp())
    bases = world.allgather(base)
    collective_assert(len(set(bases)) == world.size, "ranks share a base directory: %s" % bases)
    under_base = str(tmp_path).startswith(base + os.sep)
    collective_assert(under_base, "%s is not under %s" % (tmp_path, base))
    shared_root = os.path.basename(os.path.dirname(base)).startswith("pytest-of-")
    collective_assert(not shared_root, "%s is in pytest's shared numbered directory" % base)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_RUN = os.path.join(ROOT, "scripts", "test_run.sh")


def _test_run(args, tmpdir):
    env = dict(os.environ, TMPDIR=str(tmpdir), KEEP_TEST_FILES="")
    env.pop("MPIEXEC", None)  # no hydra topology copy: not what is tested here
    return subprocess.run(["sh", TEST_RUN] + args, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(MPI.COMM_WORLD.size > 1, reason="no communication: runs at one rank")
def test_run_folder_and_the_check_of_tmpdir(tmp_path):
    """make's run folder (scripts/test_run.sh, what `make test` ends with):
    made under TMPDIR and removed once the process it was made for exits;
    the check fails naming a gs-* entry made in TMPDIR during the run, and
    not one that was there before or one another program names."""
    real = tmp_path / "tmp"
    real.mkdir()
    (real / "gs-before").mkdir()
    make = subprocess.Popen(["sleep", "600"])  # stands for make's process
    try:
        started = _test_run(["start", str(make.pid)], real)
        run = started.stdout.strip()
        assert started.returncode == 0 and os.path.dirname(run) == str(real), started
        assert os.path.isdir(run)
        (real / "gs-left").mkdir()
        (real / "someone-elses").mkdir()
        checked = _test_run(["check", run], real)
        assert checked.returncode == 1, checked
        assert str(real / "gs-left") in checked.stdout, checked.stdout
        assert "gs-before" not in checked.stdout and "someone-elses" not in checked.stdout
        (real / "gs-left").rmdir()
        checked = _test_run(["check", run], real)
        assert checked.returncode == 0 and "nothing left" in checked.stdout, checked
    finally:
        make.kill()
        make.wait()
    deadline = time.monotonic() + 60
    while os.path.exists(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(run), "the run folder outlived the process it was made for"
