"""scripts/object_cache.py (GRADSYNC_OBJECT_CACHE): make's in-place build and
make test's wheel build share compiled objects by content. A compile whose
preprocessed source, flags and compiler match reuses the object wherever
the tree lies; any change the compiler would see misses. Reference: a
compile run for real (gcc), compared byte for byte."""
import os
import shutil
import sys

import pytest
from mpi4py import MPI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import object_cache  # noqa: E402

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPI.COMM_WORLD.size > 1, reason="process-local: the 1-rank pass"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc"),
]


def _tree(base, header="#define SCALE 2\n", define_user=True):
    """A tree like gradsync's: include/x.h and src/a/f.c."""
    os.makedirs(os.path.join(base, "include"))
    os.makedirs(os.path.join(base, "src", "a"))
    with open(os.path.join(base, "include", "x.h"), "w") as f:
        f.write(header)
    with open(os.path.join(base, "src", "a", "f.c"), "w") as f:
        f.write('#include "x.h"\nint f(int v) { return v * SCALE%s; }\n'
                % (" + EXTRA" if define_user else ""))
    return base


def _cmd(root, defines=("-DEXTRA=1",), flags=("-O2",)):
    src = os.path.join(root, "src", "a", "f.c")
    obj = os.path.join(root, "build", "f.o")
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    return ["gcc", *flags, "-fPIC", *defines, "-I" + os.path.join(root, "include"),
            "-c", src, "-o", obj]


def _spawner(calls):
    def spawn(cmd):
        import subprocess
        calls.append(cmd)
        subprocess.check_call(cmd)
    return spawn


def test_a_second_tree_reuses_the_object(tmp_path):
    cache = str(tmp_path / "cache")
    one, two = _tree(str(tmp_path / "one")), _tree(str(tmp_path / "two"))
    calls = []
    assert object_cache.run(_cmd(one), cache, one, _spawner(calls)) is False
    assert object_cache.run(_cmd(two), cache, two, _spawner(calls)) is True
    assert len(calls) == 1, "the second tree compiled again"
    with open(_cmd(one)[-1], "rb") as a, open(_cmd(two)[-1], "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("change", ["header", "define", "flag"])
def test_what_the_compiler_sees_changes_the_key(tmp_path, change):
    cache = str(tmp_path / "cache")
    one = _tree(str(tmp_path / "one"))
    two = _tree(str(tmp_path / "two"),
                header="#define SCALE 3\n" if change == "header" else "#define SCALE 2\n")
    calls = []
    object_cache.run(_cmd(one), cache, one, _spawner(calls))
    cmd = _cmd(two, defines=("-DEXTRA=2",) if change == "define" else ("-DEXTRA=1",),
               flags=("-O1",) if change == "flag" else ("-O2",))
    assert object_cache.run(cmd, cache, two, _spawner(calls)) is False
    assert len(calls) == 2


def test_an_unused_define_or_include_path_does_not(tmp_path):
    """The NCCL library's path (-DGS_NCCL_LIBRARY) and pip's build
    environment (-I) differ between the two builds; files that do not read
    them still hit."""
    cache = str(tmp_path / "cache")
    one, two = _tree(str(tmp_path / "one")), _tree(str(tmp_path / "two"))
    calls = []
    object_cache.run(_cmd(one), cache, one, _spawner(calls))
    cmd = _cmd(two, defines=("-DEXTRA=1", '-DUNUSED="/tmp/pip-build-env-x/lib"'))
    cmd.insert(1, "-I" + str(tmp_path / "elsewhere"))
    assert object_cache.run(cmd, cache, two, _spawner(calls)) is True
    assert len(calls) == 1


def test_without_a_cache_it_just_compiles(tmp_path):
    one = _tree(str(tmp_path / "one"))
    calls = []
    assert object_cache.run(_cmd(one), None, one, _spawner(calls)) is False
    assert object_cache.run(_cmd(one), None, one, _spawner(calls)) is False
    assert len(calls) == 2 and os.path.exists(_cmd(one)[-1])
