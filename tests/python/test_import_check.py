"""The import-time check that gradsync's extension and mpi4py use one MPI
library: it passes for this build, and a difference is reported with what to
do about it."""
import pytest

import gradsync as gs
from gradsync import _mpi

pytestmark = pytest.mark.mpi


class FakeMPI:
    def __init__(self, version):
        self.version = version
        self.__file__ = "/somewhere/mpi4py/MPI.so"

    def Get_library_version(self):
        return self.version


class FakeCore:
    def __init__(self, version, path):
        self.info = {"mpi_library_version": version, "mpi_library_path": path}

    def build_info_c(self):
        return self.info


def test_this_build_uses_one_mpi():
    _mpi.check_same_mpi(gs.MPI, gs._core)  # raises if not
    assert gs.build_info()["mpi_library"] == gs.MPI.Get_library_version().splitlines()[0].strip()


def test_different_libraries_raise_with_instructions(monkeypatch):
    monkeypatch.setattr(_mpi, "_loaded_mpi_libraries", lambda: {"/opt/openmpi/lib/libmpi.so.40"})
    with pytest.raises(ImportError) as err:
        _mpi.check_same_mpi(FakeMPI("Open MPI v5.0.3\n"),
                            FakeCore("MPICH Version: 5.0.2\n", "/usr/lib/libmpi.so.12"))
    text = str(err.value)
    assert "MPICH Version: 5.0.2" in text and "Open MPI v5.0.3" in text
    assert "MPICC=" in text and "--no-binary=mpi4py" in text


def test_two_copies_of_one_version_raise(monkeypatch):
    monkeypatch.setattr(_mpi, "_loaded_mpi_libraries",
                        lambda: {"/a/lib/libmpi.so.12", "/b/lib/libmpi.so.12"})
    with pytest.raises(ImportError):
        _mpi.check_same_mpi(FakeMPI("MPICH 5\n"), FakeCore("MPICH 5\n", "/a/lib/libmpi.so.12"))


@pytest.mark.skipif("GRADSYNC_THREAD_LEVEL" in __import__("os").environ,
                    reason="thread level chosen by the environment")
def test_thread_level_is_the_lowest_needed():
    # conftest imports gradsync before anything imports mpi4py.MPI, so gradsync
    # initialized MPI, at SERIALIZED (mpi4py's own default is MULTIPLE).
    assert gs.build_info()["mpi_thread_level"] == "serialized"
    assert gs.MPI.Query_thread() == gs.MPI.THREAD_SERIALIZED
