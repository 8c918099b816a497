"""What gradsync is built with, found once for every way of building it, and
pip's build backend.

setup.py (run by `make` as `setup.py build_ext --inplace`, and by pip) asks
this module which MPI compiler wrapper, nvcc, CUDA architectures and NCCL
header to use, and prints `summary()` as the build's last lines. pip builds
in an isolated environment that holds only the build requirements: where
nvcc will be used, the backend below adds the nvidia-nccl-cu13 wheel to them
(its nccl.h is what `make` compiles against through scripts/install_deps.sh),
so `pip install .` builds the same library `make` does (docs/decisions/build.md,
"Packaging").

Knobs, in the order they are consulted (mpi4py's conf/ does the same):
environment variable, then the usual places, then a clear error.
    MPICC                 the MPI compiler wrapper (else mpicc on PATH, else the
                          mpich wheel's beside this Python)
    GRADSYNC_CUDA         0: CPU only; 1: CUDA required (nvcc and NCCL's header,
                          or the build fails naming what is missing); unset: auto
    NVCC, CUDA_HOME       the CUDA toolkit
    GRADSYNC_CUDA_ARCHS   "80;90": sm_80 and sm_90 code plus PTX of the last
    NCCL_HOME             a folder with include/nccl.h (else the wheel)
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NCCL_WHEEL = "nvidia-nccl-cu13"


class BuildError(SystemExit):
    """A build that cannot go on, with the reason and what to do."""

    def __init__(self, message):
        super().__init__("gradsync: " + message)


def version():
    """GS_VERSION_STRING from include/gs_export.h: the one place the version
    is written (the C library reports it, the wheel is named by it)."""
    with open(os.path.join(ROOT, "include", "gs_export.h")) as f:
        found = re.search(r'#define\s+GS_VERSION_STRING\s+"([^"]+)"', f.read())
    if not found:
        raise BuildError("include/gs_export.h defines no GS_VERSION_STRING")
    return found.group(1)


def find_mpicc():
    cc = os.environ.get("MPICC")
    if cc:
        return cc
    found = shutil.which("mpicc")
    if found:
        return found
    wheel = os.path.join(sysconfig.get_path("scripts"), "mpicc")
    if os.path.exists(wheel):
        return wheel
    raise BuildError("no MPI C compiler found. Set MPICC=/path/to/mpicc for your cluster's "
                     "MPI, or run `python -m pip install mpich` (what `make` does).")


def mpi_flags(mpicc):
    """(compile flags, link flags) that the wrapper adds, for the Cython extension."""
    for opt in ("-show", "-showme"):
        try:
            out = subprocess.run(shlex.split(mpicc) + [opt], capture_output=True, text=True,
                                 check=True).stdout.split()
        except (OSError, subprocess.CalledProcessError):
            continue
        words = out[1:]
        cflags = [w for w in words if w.startswith(("-I", "-D", "-pthread"))]
        lflags = [w for w in words if w.startswith(("-L", "-l", "-Wl", "-pthread"))]
        return cflags, lflags
    raise BuildError(f"cannot ask {mpicc} for its flags (-show / -showme)")


def mpi_name(mpicc):
    """The MPI the wrapper compiles against ("MPICH 4.3.2", "Open MPI 5.0.3"),
    read from its mpi.h; the wrapper's path when that cannot be read."""
    probe = "#include <mpi.h>\n"
    try:
        out = subprocess.run(shlex.split(mpicc) + ["-E", "-dM", "-x", "c", "-"], input=probe,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return mpicc
    macros = dict(re.findall(r"#define (\w+) (.*)", out))
    if "MPICH_VERSION" in macros:
        return "MPICH " + macros["MPICH_VERSION"].strip('"')
    if "OMPI_MAJOR_VERSION" in macros:
        return "Open MPI %s.%s.%s" % tuple(macros.get(f"OMPI_{p}_VERSION", "?")
                                           for p in ("MAJOR", "MINOR", "RELEASE"))
    return mpicc


def cuda_mode():
    """"0" (CPU only), "1" (CUDA required) or "" (auto) from GRADSYNC_CUDA."""
    mode = os.environ.get("GRADSYNC_CUDA", "")
    if mode not in ("", "0", "1"):
        raise BuildError(f"GRADSYNC_CUDA={mode!r}: use 0 (CPU only), 1 (CUDA required) or leave "
                         "it unset (CUDA when nvcc is found)")
    return mode


def find_nvcc():
    """nvcc's path, or None for a CPU-only build."""
    mode = cuda_mode()
    if mode == "0":
        return None
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    if mode == "1":
        raise BuildError("GRADSYNC_CUDA=1 but no nvcc found (set NVCC, or put the CUDA "
                         "toolkit's bin/ on PATH)")
    return None


def cuda_dirs(nvcc):
    """(include dir, library dir) of the toolkit nvcc belongs to. nvcc may be
    a wrapper script, so its own report of its toolkit (TOP) comes first."""
    homes = []
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        homes += [line.split("=", 1)[1].strip() for line in out.splitlines()
                  if line.startswith("#$ TOP=")]
    except OSError:
        pass
    homes += [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
              os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in filter(None, homes):
        for inc, lib in (("include", "lib64"), ("targets/x86_64-linux/include",
                                               "targets/x86_64-linux/lib")):
            if os.path.exists(os.path.join(home, inc, "cuda_runtime_api.h")):
                return os.path.join(home, inc), os.path.join(home, lib)
    raise BuildError(f"cannot find cuda_runtime_api.h for {nvcc} (set CUDA_HOME)")


def cuda_version(include_dir):
    """CUDART_VERSION from the toolkit's header as "13.0"."""
    with open(os.path.join(include_dir, "cuda_runtime_api.h")) as f:
        found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
    v = int(found.group(1)) if found else 0
    return "%d.%d" % (v // 1000, v % 1000 // 10) if v else "unknown"


def cuda_archs():
    """(nvcc -gencode flags, "sm_80,sm_90,compute_90")."""
    archs = [a.strip() for a in os.environ.get("GRADSYNC_CUDA_ARCHS", "80;90").split(";")
             if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        raise BuildError(f"GRADSYNC_CUDA_ARCHS={os.environ.get('GRADSYNC_CUDA_ARCHS')!r}: "
                         "give compute capabilities separated by ';', such as \"80;90\"")
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    names = [f"sm_{a}" for a in archs] + [f"compute_{archs[-1]}"]
    return flags, ",".join(names)


def nccl_roots():
    """Where NCCL's include/nccl.h is looked for, in order."""
    if os.environ.get("NCCL_HOME"):
        return [os.environ["NCCL_HOME"]]
    return [os.path.join(site, "nvidia", "nccl") for site in sys.path if site]


def find_nccl():
    """(include dir, library path or "", version "2.32.3"), or None."""
    for root in nccl_roots():
        header = os.path.join(root, "include", "nccl.h")
        if os.path.exists(header):
            lib = os.path.join(root, "lib", "libnccl.so.2")
            return os.path.join(root, "include"), lib if os.path.exists(lib) else "", \
                nccl_header_version(header)
    return None


def nccl_header_version(header):
    with open(header) as f:
        text = f.read()
    parts = [re.search(rf"#define\s+NCCL_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def require_nccl():
    """find_nccl() for a CUDA build; GRADSYNC_CUDA=1 without the header is an
    error naming where it was looked for. Returns (found or None, why not)."""
    found = find_nccl()
    if found:
        return found, ""
    where = "NCCL_HOME=" + os.environ["NCCL_HOME"] if os.environ.get("NCCL_HOME") else \
        f"the {NCCL_WHEEL} wheel (nvidia/nccl/include/nccl.h on sys.path)"
    why = f"NCCL's header nccl.h not found in {where}"
    if cuda_mode() == "1":
        raise BuildError(f"GRADSYNC_CUDA=1 but {why}: `pip install {NCCL_WHEEL}` or set "
                         "NCCL_HOME to a folder with include/nccl.h")
    return None, why


def jax_include():
    """(folder of XLA's FFI headers, None) for gradsync.jax's handlers inside
    jax.jit, or (None, why not): $GRADSYNC_JAX_INCLUDE, else
    jax.ffi.include_dir() of the Python that builds (asked in a subprocess:
    the build itself never imports jax). pip's isolated build has no jax:
    there `pip install --no-build-isolation .` or GRADSYNC_JAX_INCLUDE."""
    given = os.environ.get("GRADSYNC_JAX_INCLUDE")
    if given:
        if os.path.exists(os.path.join(given, "xla", "ffi", "api", "ffi.h")):
            return given, None
        return None, f"GRADSYNC_JAX_INCLUDE={given} has no xla/ffi/api/ffi.h"
    try:
        out = subprocess.run([sys.executable, "-c",
                              "import jax.ffi; print(jax.ffi.include_dir())"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"cannot ask {sys.executable} for jax: {exc}"
    folder = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else ""
    if folder and os.path.exists(os.path.join(folder, "xla", "ffi", "api", "ffi.h")):
        return folder, None
    return None, f"jax (with jax.ffi) is not importable by {sys.executable}"


def summary(mpicc, cuda, jax=(None, "not asked")):
    """The build's last lines: what was built. cuda is None (CPU only, with
    the reason) or a dict with version, archs, nccl (version or None) and
    nccl_why; jax is jax_include()'s answer."""
    lines = [f"gradsync {version()} built with:",
             f"  MPI:  {mpi_name(mpicc)} ({mpicc})"]
    if cuda is None:
        why = "GRADSYNC_CUDA=0" if cuda_mode() == "0" else "no nvcc found (NVCC, PATH, " \
            "/usr/local/cuda/bin)"
        lines += [f"  CUDA: no ({why})", "  NCCL: no (CPU-only build)"]
    else:
        lines.append(f"  CUDA: {cuda['version']}, {cuda['archs']}")
        lines.append(f"  NCCL: {cuda['nccl']} (header; the library is opened at run time)"
                     if cuda["nccl"] else f"  NCCL: no ({cuda['nccl_why']}): device "
                     "collectives will use MPI staged through host memory")
    lines.append(f"  JAX:  collectives inside jax.jit (XLA FFI headers from {jax[0]})" if jax[0]
                 else f"  JAX:  no collectives inside jax.jit ({jax[1]}); gradsync.jax works "
                 "outside it")
    return "\n".join(lines)


# -- pip's build backend: setuptools', plus NCCL's header where it is needed --

from setuptools import build_meta as _setuptools  # noqa: E402
from setuptools.build_meta import *  # noqa: E402,F401,F403  (every other hook is setuptools')


def _extra_requires():
    try:
        wants = find_nvcc() and not os.environ.get("NCCL_HOME")
    except SystemExit:
        wants = False  # setup.py reports the problem with its full message
    return [NCCL_WHEEL] if wants else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra_requires()
