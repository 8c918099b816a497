"""MPI start-up: the thread level gradsync asks for, and the check that the
extension and mpi4py use one and the same MPI library."""
import os
import sys

_LEVELS = ("single", "funneled", "serialized", "multiple")


def import_mpi():
    """Imports mpi4py.MPI. When gradsync is the first to import it, MPI is
    initialized at the lowest thread level gradsync needs: SERIALIZED (MPICH's
    THREAD_MULTIPLE makes every small call several times slower).
    GRADSYNC_THREAD_LEVEL overrides it. UCX's registration cache is off
    unless the environment says otherwise (no_ucx_rcache)."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        no_ucx_rcache(os.environ)

        level = os.environ.get("GRADSYNC_THREAD_LEVEL", "serialized").lower()
        if level not in _LEVELS:
            raise ValueError(f"GRADSYNC_THREAD_LEVEL must be one of {', '.join(_LEVELS)}, "
                             f"got {level!r}")
        mpi4py.rc.thread_level = level
    from mpi4py import MPI

    return MPI


def no_ucx_rcache(env):
    """UCX_RCACHE_ENABLE=n in ``env`` unless it is set already (issue 34).

    With UCX's registration cache on, every heap shrink or unmapping in the
    process (glibc trimming after NumPy or torch frees a large temporary,
    a new output array freed) is a memory event the cache keeps about 60 to
    150 bytes for, whether or not MPI ever saw that memory: a training loop
    grows by that much per call, for ever (MPICH 5.0.2's ch4:ucx; the same
    loop with no MPI call at all grows too). Off, UCX registers per
    transfer, which costs nothing on one host's shared memory and some
    bandwidth over InfiniBand; a user who wants the cache sets
    UCX_RCACHE_ENABLE=try (UCX's default) and gets it, with gradsync still
    handing MPI only memory it keeps (docs/RELIABILITY.md, Memory)."""
    env.setdefault("UCX_RCACHE_ENABLE", "n")


def _loaded_mpi_libraries():
    """Real paths of the MPI libraries mapped into this process (Linux)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                base = os.path.basename(path)
                if base.startswith(("libmpi.so", "libmpich.so", "libmpi_abi.so")):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return found


def check_same_mpi(MPI, core):
    """Raises ImportError when the extension and mpi4py load different MPIs."""
    info = core.build_info_c()
    ours = info["mpi_library_version"].splitlines()[0:1]
    theirs = MPI.Get_library_version().strip().splitlines()[0:1]
    ours_path = os.path.realpath(info["mpi_library_path"]) if info["mpi_library_path"] else ""
    loaded = _loaded_mpi_libraries()
    if ours != theirs or (ours_path and len(loaded) > 1):
        raise ImportError(
            "gradsync and mpi4py use different MPI libraries in this process:\n"
            f"  gradsync: {ours[0] if ours else '?'} ({ours_path or 'unknown path'})\n"
            f"  mpi4py:   {theirs[0] if theirs else '?'} ({mpi4py_file(MPI)})\n"
            f"  loaded:   {', '.join(sorted(loaded)) or 'unknown'}\n"
            "Build both against one MPI: either use the mpich wheel for both "
            "(unset MPICC; `make clean all`), or rebuild mpi4py for your MPI with "
            "`MPICC=/path/to/mpicc python -m pip install --no-binary=mpi4py "
            "--force-reinstall mpi4py` and gradsync with `MPICC=/path/to/mpicc make clean all`.")


def mpi4py_file(MPI):
    return getattr(MPI, "__file__", "?")
