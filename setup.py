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
GRADSYNC_CUDA=0 builds for the CPU only. NCCL's header comes from $NCCL_HOME or
the nvidia-nccl-cu13 wheel; the library itself is opened at run time.
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
SRC = os.path.join(ROOT, "src")
OBJ_DIR = os.path.join(ROOT, "build", "objects")
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


def find_nvcc():
    if os.environ.get("GRADSYNC_CUDA", "") == "0":
        return None
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    if os.environ.get("GRADSYNC_CUDA", "") == "1":
        sys.exit("gradsync: GRADSYNC_CUDA=1 but no nvcc found (set NVCC or PATH)")
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
    sys.exit(f"gradsync: cannot find cuda_runtime_api.h for {nvcc} (set CUDA_HOME)")


def cuda_archs():
    archs = [a.strip() for a in os.environ.get("GRADSYNC_CUDA_ARCHS", "80;90").split(";")
             if a.strip()]
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    names = [f"sm_{a}" for a in archs] + [f"compute_{archs[-1]}"]
    return flags, ",".join(names)


def find_nccl():
    """(include dir, library path) of NCCL, or None."""
    roots = []
    if os.environ.get("NCCL_HOME"):
        roots.append(os.environ["NCCL_HOME"])
    for site in sys.path:
        roots.append(os.path.join(site, "nvidia", "nccl"))
    for root in roots:
        if os.path.exists(os.path.join(root, "include", "nccl.h")):
            lib = os.path.join(root, "lib", "libnccl.so.2")
            return os.path.join(root, "include"), lib if os.path.exists(lib) else ""
    return None


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
        # one folder per layer (docs/ARCHITECTURE.md); private includes name
        # their folder, found from -Isrc
        sources = sorted(glob.glob(os.path.join(SRC, "*", "*.c")))
        cu_sources = sorted(glob.glob(os.path.join(SRC, "*", "*.cu")))
        deps = sources + cu_sources + glob.glob(os.path.join(SRC, "*", "*.h")) + \
            glob.glob(os.path.join(SRC, "*", "*.cuh")) + glob.glob(os.path.join(INCLUDE, "*.h")) + \
            [os.path.abspath(__file__)]
        nvcc = find_nvcc()
        config = os.path.join(pkg_dir, ".gradsync-build")
        config_now = f"nvcc={nvcc} archs={os.environ.get('GRADSYNC_CUDA_ARCHS', '')}\n"
        config_old = open(config).read() if os.path.exists(config) else ""
        if self.force or newer(deps, lib) or config_now != config_old:
            flags, libs = list(C_FLAGS), []
            if nvcc:
                flags, libs = self.cuda_flags(nvcc, flags)
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
        cflags, lflags = mpi_flags(mpicc)
        for ext in self.extensions:
            ext.library_dirs.append(pkg_dir)
            ext.extra_compile_args += cflags
            ext.extra_link_args += lflags
        super().run()

    @staticmethod
    def c_compile(mpicc, flags, src):
        """(command, object) compiling one C source of the library."""
        layer = os.path.basename(os.path.dirname(src))
        obj = os.path.join(OBJ_DIR, "c", f"{layer}_{os.path.basename(src)}.o")
        return shlex.split(mpicc) + flags + ["-I" + INCLUDE, "-I" + SRC, "-c", src,
                                             "-o", obj], obj

    @staticmethod
    def cuda_compile(nvcc, src):
        """(command, object) compiling one .cu file for the chosen archs."""
        gencode, _ = cuda_archs()
        obj = os.path.join(OBJ_DIR, "cuda", os.path.basename(src) + ".o")
        return [nvcc, "-std=c++17", "-O3", "--fmad=false", "-Xcompiler",
                "-fPIC,-fvisibility=hidden", "-I" + INCLUDE, "-I" + SRC,
                "-DGS_BUILDING_LIBRARY"] + gencode + ["-c", src, "-o", obj], obj

    @staticmethod
    def cuda_flags(nvcc, flags):
        """(C flags, link libraries) of a build with the CUDA kernels."""
        inc, libdir = cuda_dirs(nvcc)
        _, names = cuda_archs()
        flags = flags + ["-DGS_HAVE_CUDA", f'-DGS_CUDA_ARCHS="{names}"', "-I" + inc]
        nccl = find_nccl()
        if nccl:
            flags += ["-DGS_HAVE_NCCL", "-I" + nccl[0], f'-DGS_NCCL_LIBRARY="{nccl[1]}"']
        else:
            print("gradsync: NCCL header not found (NCCL_HOME or the nvidia-nccl-cu13 wheel); "
                  "building without the NCCL backend")
        return flags, ["-L" + libdir, "-lcudart_static", "-lrt", "-lstdc++"]


def run_all(commands):
    """Runs the compile commands, as many at once as there are cores (nvcc's
    one file takes as long as all the C files: on two cores they overlap)."""
    from concurrent.futures import ThreadPoolExecutor

    for cmd in commands:
        os.makedirs(os.path.dirname(cmd[-1]), exist_ok=True)

    def run(cmd):
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(run, cmd) for cmd in commands]:
            done.result()  # raises the first failure


# The mpich wheel gradsync builds and runs with: below 5, since MPICH 5.0.x
# cannot connect singleton processes (a torchrun launch; docs/DECISIONS.md).
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


setup(
    name="gradsync",
    version="0.1.0",
    description="Collective communication for distributed training: fused MPI/NCCL "
                "collectives, Adasum and gradient kernels",
    packages=["gradsync", "gradsync.bench", "gradsync.torch", "gradsync.torch.distributed",
              "gradsync.horovod", "gradsync.horovod.torch"],
    package_dir={"": "pyx"},
    package_data={"gradsync": ["*.pxd", "*.pxi", "*.pyx", "libgradsync.so"],
                  "gradsync.bench": ["gradient_shapes.json"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildWithRuntime},
    python_requires=">=3.9",
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "ml_dtypes>=0.3"] + runtime_mpi(),
    extras_require={"torch": ["torch"], "test": ["pytest", "pytest-mpi"]},
    zip_safe=False,
)
