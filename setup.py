"""Builds libgradsync (the C runtime, compiled with the MPI compiler wrapper)
and the Cython extension gradsync._core that links it.

Which MPI: $MPICC if set, else `mpicc` on PATH, else the mpicc that the
`mpich` wheel installs next to this Python (`python -m pip install mpich`,
which `make` runs for you). The extension and mpi4py must use the same MPI
library; gradsync checks that at import.

CUDA: when nvcc is found ($NVCC, PATH, /usr/local/cuda/bin) the CUDA kernels
(src/*/*.cu) are compiled for GRADSYNC_CUDA_ARCHS (default "80;90": A100 and
H100/H200 code, plus PTX of the newest for later GPUs) and the CUDA runtime is
linked statically, so the library loads on machines without a GPU or driver.
GRADSYNC_CUDA=0 builds for the CPU only, GRADSYNC_CUDA=1 fails without nvcc
or NCCL's header. NCCL's header comes from $NCCL_HOME or the nvidia-nccl-cu13
wheel (pip's build adds that wheel to its build requirements when nvcc is
found); the library itself is opened at run time. Which of these was found
is scripts/gradsync_build.py's job; the build's last lines say what it built.
The version is include/gs_export.h's GS_VERSION_STRING, written nowhere else.
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import object_cache  # noqa: E402  (GRADSYNC_OBJECT_CACHE: scripts/object_cache.py)
from gradsync_build import (  # noqa: E402  (the build's configuration: scripts/gradsync_build.py)
    NCCL_WHEEL,
    cuda_archs,
    cuda_dirs,
    cuda_version,
    find_mpicc,
    find_nvcc,
    jax_include,
    mpi_flags,
    require_nccl,
    summary,
    version,
)

INCLUDE = os.path.join(ROOT, "include")
SRC = os.path.join(ROOT, "src")
OBJ_DIR = os.path.join(ROOT, "build", "objects")
# Objects reused by content (scripts/object_cache.py): make's in-place build
# and make test's wheel build share build/object-cache; unset, no cache.
CACHE = os.environ.get("GRADSYNC_OBJECT_CACHE") or None
C_FLAGS = ["-O3", "-g", "-fPIC", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
           "-fvisibility=hidden", "-fno-fast-math", "-ffp-contract=off", "-fopenmp",
           "-DGS_BUILDING_LIBRARY"]


def newer(sources, target):
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(s) > t for s in sources)


class BuildWithRuntime(build_ext):
    """Builds libgradsync.so into the package directory, copies the public
    headers beside it (gradsync.get_include()), then builds the extension,
    and says on its last lines what it built."""

    def run(self):
        mpicc = find_mpicc()
        pkg_dir = os.path.dirname(self.get_ext_fullpath("gradsync._core"))
        os.makedirs(pkg_dir, exist_ok=True)
        # The extension compiles while the library builds (nvcc's one file
        # keeps one core busy for a minute); build_extension waits for the
        # library before it links against it.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1) as pool:
            self._library = pool.submit(self.build_library, mpicc, pkg_dir)
            copy_headers(os.path.join(pkg_dir, "include"))
            cflags, lflags = mpi_flags(mpicc)
            for ext in self.extensions:
                ext.library_dirs.append(pkg_dir)
                ext.extra_compile_args += cflags
                ext.extra_link_args += lflags
            super().run()
            cuda = self._library.result()
        jax = jax_include()
        if jax[0]:
            self.jax_handlers(jax[0], pkg_dir, cflags)
        print(summary(mpicc, cuda, jax), flush=True)

    def build_extension(self, ext):
        link = self.compiler.link

        def link_after_the_library(*args, **kwargs):
            self._library.result()  # raises the library build's failure
            return link(*args, **kwargs)

        self.compiler.link = link_after_the_library
        compile_one = self.compiler._compile  # distutils' one compile, stable across versions

        def cached(obj, src, ext, cc_args, extra_postargs, pp_opts):
            cmd = list(self.compiler.compiler_so) + cc_args + [src, "-o", obj] + extra_postargs
            object_cache.run(cmd, CACHE, ROOT, lambda _: compile_one(
                obj, src, ext, cc_args, extra_postargs, pp_opts))

        if CACHE:  # the extension's compile through the object cache too
            self.compiler._compile = cached
        try:
            super().build_extension(ext)
        finally:
            self.compiler.link = link
            self.compiler._compile = compile_one

    def build_library(self, mpicc, pkg_dir):
        """Builds libgradsync.so into pkg_dir unless it is up to date;
        returns what was found of CUDA (None without nvcc)."""
        lib = os.path.join(pkg_dir, "libgradsync.so")
        # one folder per layer (docs/ARCHITECTURE.md), a layer's parts in
        # subfolders of it (transport/mpi/); private includes name their
        # folder, found from -Isrc
        sources = sorted(glob.glob(os.path.join(SRC, "*", "*.c")) +
                         glob.glob(os.path.join(SRC, "*", "*", "*.c")))
        cu_sources = sorted(glob.glob(os.path.join(SRC, "*", "*.cu")))
        deps = sources + cu_sources + glob.glob(os.path.join(SRC, "*", "*.h")) + \
            glob.glob(os.path.join(SRC, "*", "*", "*.h")) + \
            glob.glob(os.path.join(SRC, "*", "*.cuh")) + glob.glob(os.path.join(INCLUDE, "*.h")) + \
            [os.path.abspath(__file__), os.path.join(ROOT, "scripts", "gradsync_build.py")]
        nvcc = find_nvcc()
        flags, libs, cuda = list(C_FLAGS), [], None
        if nvcc:
            flags, libs, cuda = self.cuda_flags(nvcc, flags)
        config = os.path.join(pkg_dir, ".gradsync-build")
        config_now = f"nvcc={nvcc} flags={' '.join(flags)}\n"
        config_old = open(config).read() if os.path.exists(config) else ""
        if self.force or newer(deps, lib) or config_now != config_old:
            compiles = [self.cuda_compile(nvcc, src) for src in cu_sources] if nvcc else []
            compiles += [self.c_compile(mpicc, flags, src) for src in sources]
            run_all([cmd for cmd, _ in compiles])
            objects = [obj for _, obj in compiles]
            # Link to a temporary name and rename: a process loading the
            # library meanwhile sees the old file or the new one, never half.
            tmp = lib + ".tmp"
            cmd = shlex.split(mpicc) + flags + ["-shared", "-o", tmp] + objects + libs + \
                ["-Wl,-soname,libgradsync.so", "-Wl,--no-undefined", "-ldl", "-lpthread", "-lm"]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            os.replace(tmp, lib)
            with open(config, "w") as f:
                f.write(config_now)
        return cuda

    def jax_handlers(self, include, pkg_dir, mpi_cflags):
        """gradsync/jax/libgradsync_jax.so: the XLA FFI handlers that
        gradsync.jax lowers to inside jax.jit (pyx/gradsync/jax/_ffi.cc),
        over libgradsync's public API; XLA's headers as system headers."""
        src = os.path.join(ROOT, "pyx", "gradsync", "jax", "_ffi.cc")
        out = os.path.join(pkg_dir, "jax", "libgradsync_jax.so")
        lib = os.path.join(pkg_dir, "libgradsync.so")
        config = os.path.join(pkg_dir, "jax", ".gradsync-build")
        config_now = f"include={include}\n"
        config_old = open(config).read() if os.path.exists(config) else ""
        if not (self.force or newer([src, lib, os.path.abspath(__file__)] +
                                    glob.glob(os.path.join(INCLUDE, "*.h")), out)
                or config_now != config_old):
            return
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O2", "-g", "-fPIC", "-shared",
               "-Wall", "-Wextra", "-fvisibility=hidden", "-I" + INCLUDE, "-isystem", include] + \
            mpi_cflags + [src, "-o", out + ".tmp", "-L" + pkg_dir, "-lgradsync",
                          "-Wl,-rpath,$ORIGIN/..", "-Wl,--no-undefined"]
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)
        os.replace(out + ".tmp", out)
        with open(config, "w") as f:
            f.write(config_now)

    @staticmethod
    def c_compile(mpicc, flags, src):
        """(command, object) compiling one C source of the library."""
        # named by its path under src/: transport/mpi/mpi.c and mpi/*.c stay apart
        where = os.path.relpath(src, SRC).replace(os.sep, "_")
        obj = os.path.join(OBJ_DIR, "c", f"{where}.o")
        return shlex.split(mpicc) + flags + ["-I" + INCLUDE, "-I" + SRC, "-c", src,
                                             "-o", obj], obj

    @staticmethod
    def cuda_compile(nvcc, src):
        """(command, object) compiling one .cu file for the chosen archs."""
        gencode, _ = cuda_archs()
        obj = os.path.join(OBJ_DIR, "cuda", os.path.basename(src) + ".o")
        # --threads 0: one thread per architecture, as many at once as cores
        return [nvcc, "-std=c++17", "-O3", "--fmad=false", "--threads", "0", "-Xcompiler",
                "-fPIC,-fvisibility=hidden", "-I" + INCLUDE, "-I" + SRC,
                "-DGS_BUILDING_LIBRARY"] + gencode + ["-c", src, "-o", obj], obj

    @staticmethod
    def cuda_flags(nvcc, flags):
        """(C flags, link libraries, what was found) of a build with the CUDA
        kernels and, where NCCL's header is found, the NCCL backend."""
        inc, libdir = cuda_dirs(nvcc)
        _, names = cuda_archs()
        flags = flags + ["-DGS_HAVE_CUDA", f'-DGS_CUDA_ARCHS="{names}"', "-I" + inc]
        nccl, why = require_nccl()
        if nccl:
            flags += ["-DGS_HAVE_NCCL", "-I" + nccl[0], f'-DGS_NCCL_LIBRARY="{nccl[1]}"']
        else:
            print(f"gradsync: {why}; building without the NCCL backend", flush=True)
        found = {"version": cuda_version(inc), "archs": names,
                 "nccl": nccl[2] if nccl else None, "nccl_why": why}
        return flags, ["-L" + libdir, "-lcudart_static", "-lrt", "-lstdc++"], found


def copy_headers(dest):
    """The public headers, as gradsync.get_include() and embedders find them
    in the installed package (the checkout's include/ is their only source)."""
    os.makedirs(dest, exist_ok=True)
    for header in glob.glob(os.path.join(INCLUDE, "*.h")):
        target = os.path.join(dest, os.path.basename(header))
        if newer([header], target):
            shutil.copy2(header, target)


def run_all(commands):
    """Runs the compile commands, as many at once as there are cores (nvcc's
    one file takes as long as all the C files: on two cores they overlap)."""
    from concurrent.futures import ThreadPoolExecutor

    for cmd in commands:
        os.makedirs(os.path.dirname(cmd[-1]), exist_ok=True)

    def spawn(cmd):
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)

    def run(cmd):
        if object_cache.run(cmd, CACHE, ROOT, spawn):
            print(f"{cmd[-1]}: from the object cache", flush=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(run, cmd) for cmd in commands]:
            done.result()  # raises the first failure
    if CACHE:
        object_cache.prune(CACHE)


# The mpich wheel gradsync builds and runs with: below 5, since MPICH 5.0.x
# cannot connect singleton processes (a torchrun launch; docs/decisions/launch.md).
MPICH_WHEEL = "mpich>=4.3,<5"


def runtime_mpi():
    """What the built library needs at run time: the mpich wheel when it was
    built against that wheel's MPI (as pip's build environment does, mpich
    being a build requirement), as mpi4py's users install it; nothing when
    MPICC or PATH named another MPI (a cluster's own)."""
    mpicc = os.path.realpath(shutil.which(find_mpicc()) or find_mpicc())
    try:
        from importlib.metadata import distribution
        files = distribution("mpich").files or []
        dist = distribution("mpich")
    except Exception:
        return []
    if any(f.name == "mpicc" and os.path.realpath(dist.locate_file(f)) == mpicc for f in files):
        return [MPICH_WHEEL]
    return []


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


def long_description():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


setup(
    name="gradsync",
    version=version(),
    description="Collective communication for distributed training: fused MPI/NCCL "
                "collectives, Adasum and gradient kernels",
    long_description=long_description(),
    long_description_content_type="text/markdown",
    author="gradsync developers",
    author_email="dev@gradsync.dev",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C",
        "Programming Language :: Cython",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    keywords=["mpi", "nccl", "allreduce", "distributed training", "adasum", "horovod"],
    # every package under pyx/, the Horovod alias's horovod.* tree included
    packages=find_packages(where="pyx"),
    package_dir={"": "pyx"},
    package_data={"gradsync": ["*.pxd", "*.pxi", "*.pyx", "libgradsync.so", "include/*.h"],
                  "gradsync.jax": ["_ffi.cc", "libgradsync_jax.so"],
                  "gradsync.bench": ["gradient_shapes.json"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildWithRuntime},
    entry_points={"console_scripts": [
        "gsbench = gradsync.bench:main",
        "gradsyncrun = gradsync.horovod.run:main",
        "gradsync-doctor = gradsync.doctor:main",
    ]},
    python_requires=">=3.9",
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "ml_dtypes>=0.3"] + runtime_mpi(),
    extras_require={"torch": ["torch"], "jax": ["jax"], "nccl": [NCCL_WHEEL],
                    "test": ["pytest", "pytest-mpi", "hypothesis"]},
    zip_safe=False,
)
