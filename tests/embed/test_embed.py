"""gradsync embedded in other people's builds (issue 44 item 3; docs/GUIDE.md,
"Embedding gradsync").

- A C program built with ``pkg-config --cflags --libs gradsync`` against a
  `make install` prefix, compiled with the MPI compiler wrapper and with
  plain ``cc`` (the .pc file carries the MPI flags), and a CMake project
  using ``find_package(gradsync)`` and ``gradsync::gradsync``: each runs
  embed_allreduce.c at 2 ranks, which checks its sums against the formula
  it computes in double on every rank.
- A Cython extension outside the project (embed_ext.pyx, built by the
  setup.py the guide shows, with gradsync.get_include() and
  get_library_dir()) cimports gradsync's .pxd files and calls gs_allreduce
  on a Communicator's ``c_handle`` at 2 ranks (run_ext.py compares with
  NumPy and with gradsync's own allreduce).
- ``python -m gradsync`` and the SONAMEs: the package's library keeps
  libgradsync.so, the installed one is libgradsync.so.MAJOR.

gradsync is whatever ``import gradsync`` gives (the in-place build under
`make embed-test`, the venv's package under scripts/test_installed.sh), so
the Cython test runs against an installed package too. The prefix: the one
GS_EMBED_PREFIX names (`make embed-test` installs it), else a `make install`
into a temporary folder from the checkout that GS_EMBED_CHECKOUT or
GS_CHECKOUT names or that holds this file; without any, the C and CMake
tests skip. Everything is built in a folder under pytest's base temporary
directory, removed after each test (also on failure), the temporary prefix
at the end of the module. The 2-rank runs are mpiexec jobs started from
here, so the module runs at one rank (plain pytest, or mpiexec -n 1).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest

import gradsync

HERE = os.path.dirname(os.path.abspath(__file__))
# Launcher variables of this process's own job: a child mpiexec must not see them.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "I_MPI_")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(gradsync.__file__)))
NP = 2


def _launcher_size():
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


pytestmark = pytest.mark.skipif(_launcher_size() > 1,
                                reason="builds, then starts its own mpiexec jobs: at one rank only")


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    # the children import the gradsync this process imported
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # no __pycache__ beside the sources; make test's run caches bytecode in its folder
    if not env.get("PYTHONPYCACHEPREFIX"):
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    # oversubscribed ranks yield, as in make test (MPICH; other MPIs ignore these)
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "10")
    env.update(extra)
    return env


def _run(cmd, timeout=300, env=None, **kw):
    cmd = [str(c) for c in cmd]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=env or _child_env(), **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{shlex.join(cmd)}` hung ({timeout} s)\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"`{shlex.join(cmd)}` exited {p.returncode}:\n" \
        f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


def _mpiexec():
    near = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return os.environ.get("MPIEXEC") or (near if os.path.exists(near)
                                         else shutil.which("mpiexec"))


def _mpicc():
    """The MPI compiler wrapper: $MPICC (the Makefile's MPICC_RESOLVED), else
    mpicc on PATH, else the mpich wheel's beside this Python."""
    if os.environ.get("MPICC"):
        return shlex.split(os.environ["MPICC"])
    return [shutil.which("mpicc") or os.path.join(sysconfig.get_path("scripts"), "mpicc")]


def _soname(lib):
    dyn = _run(["readelf", "-d", lib])
    found = re.search(r"\(SONAME\)\s+Library soname: \[([^]]+)\]", dyn)
    return found.group(1) if found else None


def _header_version(include_dir):
    """(major, minor, patch) from an installed gs_export.h."""
    text = open(os.path.join(include_dir, "gs_export.h")).read()
    return tuple(int(re.search(rf"#define\s+GS_VERSION_{p}\s+(\d+)", text).group(1))
                 for p in ("MAJOR", "MINOR", "PATCH"))


def _checkout():
    """The gradsync checkout to `make install` from, or None."""
    for cand in (os.environ.get("GS_EMBED_CHECKOUT"), os.environ.get("GS_CHECKOUT"),
                 os.path.dirname(os.path.dirname(HERE))):
        needs = (("Makefile",), ("include", "gs_export.h"), ("scripts", "install", "gs_install.py"))
        if cand and all(os.path.isfile(os.path.join(cand, *p)) for p in needs):
            return os.path.abspath(cand)
    return None


@pytest.fixture
def work(tmp_path):
    """A build folder of this test's own, removed after it, also on failure."""
    folder = tmp_path / "embed"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    given = os.environ.get("GS_EMBED_PREFIX")
    if given:
        assert os.path.isfile(os.path.join(given, "lib", "pkgconfig", "gradsync.pc")), \
            f"GS_EMBED_PREFIX={given} holds no lib/pkgconfig/gradsync.pc (make install PREFIX=...)"
        yield given
        return
    checkout = _checkout()
    if checkout is None:
        pytest.skip("no gradsync checkout to `make install` from: set GS_EMBED_CHECKOUT to one "
                    "(or GS_EMBED_PREFIX to a prefix `make install` filled)")
    where = tmp_path_factory.mktemp("prefix")
    try:
        # `install` builds first when the in-place build is out of date
        _run(["make", "-C", checkout, "--no-print-directory", "install", f"PREFIX={where}",
              "DESTDIR="], timeout=1800, env=_child_env(PYTHONPATH=""))
        yield str(where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _pkg_config(prefix, *args):
    env = _child_env(PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig"))
    return _run(["pkg-config", *args, "gradsync"], env=env).strip()


# ---- what make install puts in the prefix -------------------------------------

def test_the_prefix_holds_headers_versioned_library_and_packages(prefix):
    major, minor, patch = _header_version(os.path.join(prefix, "include"))
    lib = os.path.join(prefix, "lib")
    real = f"libgradsync.so.{major}.{minor}.{patch}"
    assert os.path.isfile(os.path.join(lib, real)) and not os.path.islink(os.path.join(lib, real))
    assert os.readlink(os.path.join(lib, f"libgradsync.so.{major}")) == real
    assert os.readlink(os.path.join(lib, "libgradsync.so")) == f"libgradsync.so.{major}"
    assert _soname(os.path.join(lib, real)) == f"libgradsync.so.{major}"
    assert os.path.isfile(os.path.join(prefix, "include", "gradsync.h"))
    for name in ("gradsyncConfig.cmake", "gradsyncConfigVersion.cmake"):
        assert os.path.isfile(os.path.join(lib, "cmake", "gradsync", name))
    assert _pkg_config(prefix, "--modversion") == f"{major}.{minor}.{patch}"
    assert _pkg_config(prefix, "--variable=prefix") == os.path.abspath(prefix)


def test_destdir_stages_relocates_and_uninstalls(work):
    """DESTDIR puts the files under it while they name PREFIX; the CMake
    package is found where it lies; `make uninstall` removes every file."""
    checkout = _checkout()
    if checkout is None:
        pytest.skip("no gradsync checkout (GS_EMBED_CHECKOUT) to run `make install` in")
    stage, where = work / "stage", "/opt/gradsync-embed-test"
    make = ["make", "-C", checkout, "--no-print-directory", f"DESTDIR={stage}", f"PREFIX={where}"]
    _run(make + ["install"], timeout=1800, env=_child_env(PYTHONPATH=""))
    root = stage / where.lstrip("/")
    assert (root / "include" / "gradsync.h").is_file() and not os.path.exists(where)
    pc = (root / "lib" / "pkgconfig" / "gradsync.pc").read_text()
    assert f"\nprefix={where}\n" in pc, pc
    if shutil.which("cmake"):
        out = _run(["cmake", "-S", os.path.join(HERE, "cmake"), "-B", work / "build",
                    f"-DCMAKE_PREFIX_PATH={root}"])
        assert f"from {root}/lib/cmake/gradsync" in out, out
    _run(make + ["uninstall"], env=_child_env(PYTHONPATH=""))
    left = sorted(str(p) for p in stage.rglob("*") if not p.is_dir())
    assert not left, left


def test_the_package_library_keeps_its_unversioned_soname():
    """The wheel's and the in-place library: _core and extensions built with
    get_library_dir() find it as libgradsync.so (docs/decisions/build.md)."""
    lib = os.path.join(gradsync.get_library_dir(), "libgradsync.so")
    assert _soname(lib) == "libgradsync.so"


# ---- C through pkg-config, C through CMake --------------------------------------

@pytest.mark.parametrize("compiler", ["mpicc", "cc"])
def test_c_program_built_with_pkg_config(prefix, work, compiler):
    """With the MPI wrapper (the usual way), and with plain cc, which gets
    the MPI flags gradsync was built with from the .pc file."""
    flags = shlex.split(_pkg_config(prefix, "--cflags", "--libs"))
    libdir = _pkg_config(prefix, "--variable=libdir")
    cc = _mpicc() if compiler == "mpicc" else ["cc"]
    exe = work / "embed_allreduce"
    _run(cc + ["-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror",
               os.path.join(HERE, "embed_allreduce.c"), "-o", exe] + flags
         + ["-Wl,-rpath," + libdir])
    major = _header_version(os.path.join(prefix, "include"))[0]
    # the installed library, by its versioned name, from the prefix
    resolved = re.search(r"libgradsync\.so\.(\d+) => (\S+)", _run(["ldd", exe]))
    assert resolved, _run(["ldd", exe])
    assert resolved.group(1) == str(major)
    assert os.path.realpath(resolved.group(2)).startswith(os.path.realpath(libdir) + os.sep)
    out = _run([_mpiexec(), "-n", NP, exe], timeout=120)
    assert f"embed_allreduce: OK, 5165 elements on {NP} ranks" in out, out


def test_cmake_project_with_find_package(prefix, work):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    major, minor, _ = _header_version(os.path.join(prefix, "include"))
    build = work / "build"
    configure = ["cmake", "-S", os.path.join(HERE, "cmake"), "-B", build,
                 f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"]
    out = _run(configure + [f"-DGS_WANT_VERSION={major}.{minor}"])
    assert re.search(r"gradsync \d+\.\d+\.\d+ from " + re.escape(prefix), out), out
    _run(["cmake", "--build", build])
    out = _run([_mpiexec(), "-n", NP, build / "embed_allreduce"], timeout=120)
    assert f"embed_allreduce: OK, 5165 elements on {NP} ranks" in out, out
    # the next major version is another ABI: not found
    shutil.rmtree(build)
    p = subprocess.run([str(c) for c in configure] + [f"-DGS_WANT_VERSION={major + 1}.0"],
                       capture_output=True, text=True, timeout=300, env=_child_env())
    assert p.returncode != 0 and "gradsync" in p.stderr, p.stdout + p.stderr


# ---- Python: python -m gradsync, and a Cython extension ---------------------------

def test_python_m_gradsync_prints_the_flags():
    out = _run([sys.executable, "-m", "gradsync", "--version", "--include", "--libdir",
                "--cflags", "--libs"], timeout=120).split()
    inc, lib = gradsync.get_include(), gradsync.get_library_dir()
    assert out == [gradsync.__version__, inc, lib, "-I" + inc, "-L" + lib, "-lgradsync",
                   "-Wl,-rpath," + lib]
    assert os.path.isfile(os.path.join(inc, "gradsync.h"))
    assert os.path.isfile(os.path.join(lib, "libgradsync.so"))
    p = subprocess.run([sys.executable, "-m", "gradsync"], capture_output=True, text=True,
                       timeout=120, env=_child_env())
    assert p.returncode == 2 and "--cflags" in p.stderr, p.stderr


# The setup.py of docs/GUIDE.md's Cython example.
SETUP_PY = """\
from Cython.Build import cythonize
from setuptools import Extension, setup

import gradsync

ext = Extension("embed_ext", ["embed_ext.pyx"],
                include_dirs=[gradsync.get_include()],
                library_dirs=[gradsync.get_library_dir()],
                runtime_library_dirs=[gradsync.get_library_dir()],
                libraries=["gradsync"])
setup(name="embed_ext", ext_modules=cythonize([ext]))
"""


def test_cython_extension_cimports_the_pxd_files(work):
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    for name in ("embed_ext.pyx", "run_ext.py"):
        shutil.copy(os.path.join(HERE, name), work / name)
    (work / "setup.py").write_text(SETUP_PY)
    # gradsync.h includes mpi.h: CC names the MPI wrapper (setuptools then
    # links with it too), as the guide says
    _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=work,
         env=_child_env(CC=shlex.join(_mpicc())))
    built = [f for f in os.listdir(work) if f.startswith("embed_ext.") and f.endswith(".so")]
    assert built, os.listdir(work)
    # it needs the package's library, which gradsync._core has loaded: one runtime
    assert "libgradsync.so" in re.findall(r"NEEDED.*\[(.*)\]", _run(["readelf", "-d",
                                                                      work / built[0]]))
    out = _run([_mpiexec(), "-n", NP, sys.executable, work / "run_ext.py", work], timeout=180)
    assert out.count("run_ext: OK") == NP, out
