"""Builds libgradsync (the C runtime, compiled with the MPI compiler wrapper)
and the Cython extension gradsync._core that links it.

Which MPI: $MPICC if set, else `mpicc` on PATH, else the mpicc that the
`mpich` wheel installs next to this Python (`python -m pip install mpich`,
which `make` runs for you). The extension and mpi4py must use the same MPI
library; gradsync checks that at import.
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(ROOT, "include")
C_FLAGS = ["-O3", "-g", "-fPIC", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
           "-fvisibility=hidden", "-fno-fast-math", "-ffp-contract=off", "-fopenmp",
           "-DGS_BUILDING_LIBRARY"]


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
    sys.exit("gradsync: no MPI C compiler found. Set MPICC=/path/to/mpicc for your "
             "cluster's MPI, or run `python -m pip install mpich` (what `make` does).")


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
    sys.exit(f"gradsync: cannot ask {mpicc} for its flags (-show / -showme)")


def newer(sources, target):
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(s) > t for s in sources)


class BuildWithRuntime(build_ext):
    """Builds libgradsync.so into the package directory, then the extension."""

    def run(self):
        mpicc = find_mpicc()
        pkg_dir = os.path.dirname(self.get_ext_fullpath("gradsync._core"))
        os.makedirs(pkg_dir, exist_ok=True)
        lib = os.path.join(pkg_dir, "libgradsync.so")
        sources = sorted(glob.glob(os.path.join(ROOT, "src", "*.c")))
        deps = sources + glob.glob(os.path.join(ROOT, "src", "*.h")) + \
            glob.glob(os.path.join(INCLUDE, "*.h"))
        if self.force or newer(deps, lib):
            # Link to a temporary name and rename: a process loading the
            # library meanwhile sees the old file or the new one, never half.
            tmp = lib + ".tmp"
            cmd = shlex.split(mpicc) + C_FLAGS + ["-I" + INCLUDE, "-shared", "-o", tmp] + \
                sources + ["-Wl,-soname,libgradsync.so", "-ldl", "-lpthread", "-lm"]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            os.replace(tmp, lib)
        cflags, lflags = mpi_flags(mpicc)
        for ext in self.extensions:
            ext.library_dirs.append(pkg_dir)
            ext.extra_compile_args += cflags
            ext.extra_link_args += lflags
        super().run()


def extensions():
    import numpy
    from Cython.Build import cythonize

    ext = Extension(
        "gradsync._core",
        ["pyx/gradsync/_core.pyx"],
        include_dirs=[INCLUDE, numpy.get_include()],
        libraries=["gradsync"],
        extra_compile_args=["-O2", "-Wno-unused-function"],
        extra_link_args=["-Wl,-rpath,$ORIGIN"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    return cythonize([ext], include_path=["pyx"], language_level=3, quiet=True)


setup(
    name="gradsync",
    version="0.1.0",
    description="Collective communication for distributed training: fused MPI/NCCL "
                "collectives, Adasum and gradient kernels",
    packages=["gradsync", "gradsync.bench"],
    package_dir={"": "pyx"},
    package_data={"gradsync": ["*.pxd", "*.pxi", "*.pyx", "libgradsync.so"],
                  "gradsync.bench": ["gradient_shapes.json"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildWithRuntime},
    python_requires=">=3.9",
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "ml_dtypes>=0.3"],
    extras_require={"torch": ["torch"], "test": ["pytest", "pytest-mpi"]},
    zip_safe=False,
)
