"""``python -m gradsync --cflags --libs``: how to build C or C++ against this
gradsync, for a package installed by pip (a `make install` prefix has
pkg-config's gradsync.pc and a CMake package instead; docs/GUIDE.md,
"Embedding gradsync")::

    mpicc prog.c $(python -m gradsync --cflags --libs) -o prog

The flags name gradsync only: compile with the MPI compiler wrapper of the
MPI gradsync runs with (gradsync.h includes mpi.h).
"""
import argparse
import sys

from gradsync._paths import get_include, get_library_dir

# (option, what it prints), in the order the words come out
OPTIONS = (
    ("--version", "gradsync's version"),
    ("--include", "the folder of gradsync.h (gradsync.get_include())"),
    ("--libdir", "the folder of libgradsync.so (gradsync.get_library_dir())"),
    ("--cflags", "compiler flags: -I<include>"),
    ("--libs", "linker flags: -L<libdir> -lgradsync -Wl,-rpath,<libdir>"),
)


def words(option):
    if option == "--version":
        import gradsync
        return [gradsync.__version__]
    if option == "--include":
        return [get_include()]
    if option == "--libdir":
        return [get_library_dir()]
    if option == "--cflags":
        return ["-I" + get_include()]
    libdir = get_library_dir()
    return ["-L" + libdir, "-lgradsync", "-Wl,-rpath," + libdir]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m gradsync",
        description="Print what C, C++ and Cython code needs to build against this gradsync, "
                    "on one line (as pkg-config does).")
    for option, text in OPTIONS:
        parser.add_argument(option, action="store_true", help=text)
    args = parser.parse_args(argv)
    chosen = [o for o, _ in OPTIONS if getattr(args, o[2:])]
    if not chosen:
        parser.error("name at least one of " + ", ".join(o for o, _ in OPTIONS))
    print(" ".join(w for o in chosen for w in words(o)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
