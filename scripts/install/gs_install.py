"""The two steps of `make install` that need the build's configuration
(the Makefile copies the files and makes the links).

link       The library `make install` installs: the objects setup.py compiled
           for the in-place library (build/objects), linked with setup.py's
           flags (pyx/gradsync/.gradsync-build holds them, and nvcc when the
           build had CUDA), but with the SONAME libgradsync.so.MAJOR. It must
           export the same symbols and need the same libraries as the in-place
           library: a difference (setup.py's link line changed and this one
           did not) fails the install.
configure  gradsync.pc and the CMake package from the templates beside this
           file, with the prefix, the version (which the Makefile reads from
           include/gs_export.h) and the MPI gradsync was built against: its
           compiler wrapper and the flags the wrapper adds, as `mpicc -show`
           reports them now (docs/decisions/build.md, "Installing for C and C++").

The MPI compiler wrapper, nvcc and CUDA's library folder are found by
scripts/gradsync_build.py, as setup.py finds them.
"""
import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from gradsync_build import cuda_dirs, find_mpicc, mpi_flags, mpi_name, version  # noqa: E402

PACKAGE = os.path.join(ROOT, "pyx", "gradsync")
IN_PLACE = os.path.join(PACKAGE, "libgradsync.so")
CONFIG = os.path.join(PACKAGE, ".gradsync-build")
OBJ_DIR = os.path.join(ROOT, "build", "objects")
# the templates and where each goes under PREFIX
TEMPLATES = {
    "gradsync.pc.in": os.path.join("lib", "pkgconfig", "gradsync.pc"),
    "gradsyncConfig.cmake.in": os.path.join("lib", "cmake", "gradsync", "gradsyncConfig.cmake"),
    "gradsyncConfigVersion.cmake.in": os.path.join("lib", "cmake", "gradsync",
                                                   "gradsyncConfigVersion.cmake"),
}


def fail(message):
    sys.exit("make install: " + message)


def build_config():
    """(nvcc or None, compile flags) of the in-place build, as setup.py
    recorded them."""
    try:
        text = open(CONFIG).read()
    except OSError:
        fail(f"{os.path.relpath(CONFIG, ROOT)} is missing: build first (`make build`)")
    found = re.match(r"nvcc=(\S+) flags=(.*)$", text.strip())
    if not found:
        fail(f"cannot read {os.path.relpath(CONFIG, ROOT)}: {text!r}")
    nvcc = None if found.group(1) == "None" else found.group(1)
    return nvcc, shlex.split(found.group(2))


def objects(nvcc):
    """setup.py's objects, in its order: the CUDA kernels, then the C files
    (src/LAYER/NAME.c -> build/objects/c/LAYER_NAME.c.o, src/LAYER/PART/NAME.c ->
    LAYER_PART_NAME.c.o)."""
    src = os.path.join(ROOT, "src")
    cu = sorted(glob.glob(os.path.join(src, "*", "*.cu"))) if nvcc else []
    c = sorted(glob.glob(os.path.join(src, "*", "*.c")) +
               glob.glob(os.path.join(src, "*", "*", "*.c")))
    pairs = [(s, os.path.join(OBJ_DIR, "cuda", os.path.basename(s) + ".o")) for s in cu]
    pairs += [(s, os.path.join(OBJ_DIR, "c", os.path.relpath(s, src).replace(os.sep, "_")
                               + ".o")) for s in c]
    missing = [os.path.relpath(o, ROOT) for _, o in pairs if not os.path.exists(o)]
    if missing:
        fail(f"the in-place build's objects are missing ({', '.join(missing[:3])}...): "
             "build/ was removed after the library was built; `rm pyx/gradsync/libgradsync.so "
             "&& make build` compiles them again")
    return [o for _, o in pairs]


def exported(lib):
    """(sorted exported symbols, sorted needed libraries) of a shared library."""
    nm = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                        check=True).stdout
    symbols = sorted(line.split()[-1] for line in nm.splitlines()
                     if len(line.split()) == 3 and line.split()[1] in "TDBRVWiu")
    dyn = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True,
                         check=True).stdout
    return symbols, sorted(re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", dyn))


def link(out, soname):
    if not os.path.exists(IN_PLACE):
        fail("pyx/gradsync/libgradsync.so is missing: build first (`make build`)")
    nvcc, flags = build_config()
    # setup.py links with its compile flags; the preprocessor's have no effect there
    flags = [f for f in flags if not f.startswith(("-D", "-I"))]
    libs = []
    if nvcc:
        libs = ["-L" + cuda_dirs(nvcc)[1], "-lcudart_static", "-lrt", "-lstdc++"]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    cmd = shlex.split(find_mpicc()) + flags + ["-shared", "-o", tmp] + objects(nvcc) + libs + \
        ["-Wl,-soname," + soname, "-Wl,--no-undefined", "-ldl", "-lpthread", "-lm"]
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)
    got, want = exported(tmp), exported(IN_PLACE)
    if got != want:
        os.unlink(tmp)
        fail("the library linked for installing differs from pyx/gradsync/libgradsync.so "
             f"(exported symbols only there: {sorted(set(want[0]) - set(got[0]))[:5]}, "
             f"only here: {sorted(set(got[0]) - set(want[0]))[:5]}; needed libraries "
             f"{want[1]} against {got[1]}): did setup.py's link line change? "
             "scripts/install/gs_install.py must link as it does")
    os.replace(tmp, out)


def mpi_words():
    """(wrapper's path, its compile flags, its link flags): -Wl,-rpath
    -Wl,DIR as one -Wl,-rpath,DIR, which pkg-config keeps together."""
    mpicc = find_mpicc()
    words = shlex.split(mpicc)
    words[0] = shutil.which(words[0]) or words[0]
    cflags, lflags = mpi_flags(mpicc)
    merged = []
    for w in lflags:
        if merged and merged[-1] in ("-Wl,-rpath", "-Wl,-rpath-link") and w.startswith("-Wl,"):
            merged[-1] += "," + w[len("-Wl,"):]
        else:
            merged.append(w)
    return " ".join(map(shlex.quote, words)), cflags, merged


def configure(prefix, ver, destroot):
    if ver != version():
        fail(f"include/gs_export.h says {version()} in GS_VERSION_STRING but {ver} in "
             "GS_VERSION_MAJOR/MINOR/PATCH")
    if not os.path.isabs(prefix):
        fail(f"PREFIX must be an absolute path, got {prefix}")
    mpicc, cflags, lflags = mpi_words()
    values = {
        "PREFIX": prefix, "VERSION": ver, "VERSION_MAJOR": ver.split(".")[0],
        "MPICC": mpicc, "MPI_NAME": mpi_name(find_mpicc()),
        "MPI_CFLAGS": " ".join(cflags), "MPI_LIBS": " ".join(lflags),
    }
    for template, target in TEMPLATES.items():
        text = open(os.path.join(HERE, template)).read()
        text = re.sub(r"@([A-Z_]+)@", lambda m: values[m.group(1)], text)
        path = os.path.join(destroot, target)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("link", help="link the versioned library")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--soname", required=True)
    p = sub.add_parser("configure", help="write gradsync.pc and the CMake package")
    p.add_argument("--prefix", required=True, help="PREFIX, as the files will name it")
    p.add_argument("--version", required=True, help="MAJOR.MINOR.PATCH")
    p.add_argument("--destroot", required=True, help="DESTDIR + PREFIX: where they go")
    args = parser.parse_args()
    if args.step == "link":
        link(args.output, args.soname)
    else:
        configure(args.prefix, args.version, args.destroot)


if __name__ == "__main__":
    main()
