"""What `pip install .` installed, checked from outside the checkout.

Run by scripts/test_installed.sh (`make test-installed`, part of `make
test`) with the Python of a fresh venv that holds the package pip built from
a clean copy of the sources: the files here are copied next to the other
suites of the tier into a folder outside the checkout, so `import gradsync`
can only find the installed package. The environment names the checkout
(GS_CHECKOUT, to compare the installed files with the sources), the build
info of `make`'s in-place library (GS_INSTALLED_REFERENCE, a JSON file), the
MPI compiler wrapper and launcher (GS_TEST_MPICC, MPIEXEC).

Each test runs in this one process (no MPI communication of its own: the
2-rank runs are child jobs), so the module runs at one rank.
"""
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import gradsync

CHECKOUT = os.environ.get("GS_CHECKOUT", "")
REFERENCE = os.environ.get("GS_INSTALLED_REFERENCE", "")
MPIEXEC = os.environ.get("MPIEXEC", "mpiexec")
BIN = sysconfig.get_path("scripts")
PACKAGE = os.path.dirname(os.path.realpath(gradsync.__file__))
needs_checkout = pytest.mark.skipif(not CHECKOUT, reason="GS_CHECKOUT not set")


def _child_env():
    """This process's environment without the launcher's variables, so a
    child mpiexec starts a job of its own."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_CVAR_CH", "OMPI_"))}


def _run(cmd, timeout=300, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env=kw.pop("env", _child_env()), **kw)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n" \
        f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_gradsync_comes_from_the_install():
    assert PACKAGE.startswith(os.path.realpath(sys.prefix) + os.sep), \
        f"gradsync imported from {PACKAGE}, not from this venv ({sys.prefix})"
    if CHECKOUT:
        assert not PACKAGE.startswith(os.path.realpath(CHECKOUT) + os.sep), PACKAGE


@needs_checkout
def test_every_package_file_is_installed():
    """Every module, .pxd/.pxi and data file of the checkout's pyx/gradsync
    (as git tracks it) is in the installed package: a subpackage missing
    from setup.py's packages fails here."""
    tracked = subprocess.run(["git", "-C", CHECKOUT, "ls-files", "pyx/gradsync"],
                             capture_output=True, text=True, check=True).stdout.split()
    shipped = (".py", ".pxd", ".pxi", ".pyx", ".json", ".h")
    missing = [p for p in tracked if p.endswith(shipped) and not os.path.exists(
        os.path.join(PACKAGE, os.path.relpath(p, "pyx/gradsync")))]
    assert tracked and not missing, f"not installed: {missing}"
    headers = sorted(os.listdir(os.path.join(CHECKOUT, "include")))
    assert sorted(os.listdir(gradsync.get_include())) == headers


@pytest.mark.skipif(not REFERENCE, reason="GS_INSTALLED_REFERENCE not set")
def test_build_matches_make():
    """The library pip built is the one `make` builds on this machine: same
    MPI, CUDA version and architectures, NCCL, SIMD, version."""
    with open(REFERENCE) as f:
        want = json.load(f)
    got = gradsync.build_info()
    keys = ("version", "mpi_library", "cuda", "nccl", "cuda_archs", "simd", "fusion_threshold")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert importlib.metadata.version("gradsync") == gradsync.__version__ == got["version"]


@pytest.mark.parametrize("name", ["gsbench", "gradsyncrun", "gradsync-doctor"])
def test_console_script_is_installed(name):
    path = os.path.join(BIN, name)
    assert os.access(path, os.X_OK), f"{name} is not installed in {BIN}"
    assert _run([path, "--help"], timeout=120).startswith("usage: " + name)


def test_gsbench_runs_at_two_ranks():
    """The installed gsbench times and checks an allreduce at 2 ranks."""
    out = _run([MPIEXEC, "-n", "2", os.path.join(BIN, "gsbench"), "-b", "4K", "-e", "16K",
                "-n", "2", "-w", "1", "-c", "1", "--no-progress"])
    rows = [line.split() for line in out.splitlines()
            if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [4096, 8192, 16384], out
    # columns: size count type redop, then time algbw busbw #wrong per mode
    assert all(r[7] == "0" and r[11] == "0" for r in rows), out
    assert "# Out of bounds values : 0 OK" in out, out


def test_horovod_alias_resolves_to_the_install():
    folder = _run([sys.executable, "-m", "gradsync.horovod.alias"]).strip()
    assert os.path.realpath(folder) == os.path.join(PACKAGE, "horovod", "alias")
    probe = "import horovod, horovod.common.exceptions as e; print(horovod.__file__)"
    env = dict(_child_env(), PYTHONPATH=folder)
    printed = _run([sys.executable, "-c", probe], env=env).strip()
    assert os.path.realpath(printed).startswith(folder), printed


@needs_checkout
def test_c_example_builds_against_the_wheel(tmp_path):
    """tests/c/example_allreduce.c compiled with `python -m gradsync --cflags
    --libs` against the installed package and run at 2 ranks (it checks its
    own averages and exits non-zero on a wrong element)."""
    flags = _run([sys.executable, "-m", "gradsync", "--cflags", "--libs"]).split()
    exe = str(tmp_path / "example_allreduce")
    mpicc = shlex.split(os.environ.get("GS_TEST_MPICC", "mpicc"))
    _run(mpicc + [os.path.join(CHECKOUT, "tests", "c", "example_allreduce.c"), "-o", exe]
         + flags + ["-lm"])
    _run([MPIEXEC, "-n", "2", exe])


def test_allreduce_at_two_ranks_matches_numpy(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(
        "import numpy as np, gradsync as gs\n"
        "comm = gs.Communicator()\n"
        "x = np.arange(1001, dtype=np.float32) * (comm.rank + 1)\n"
        "got = comm.allreduce(x)\n"
        "np.save(f'{__file__}.{comm.rank}.npy', got)\n"
        "comm.close()\n")
    _run([MPIEXEC, "-n", "2", sys.executable, str(script)])
    want = (np.arange(1001, dtype=np.float64) * 3).astype(np.float32)
    for rank in range(2):
        assert np.array_equal(np.load(f"{script}.{rank}.npy"), want)
