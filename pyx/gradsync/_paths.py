"""Where this gradsync keeps what C, C++ and Cython code builds against.

``gradsync.get_include()`` is the folder of the public headers (gradsync.h
and the gs_*.h it includes), ``gradsync.get_library_dir()`` the folder of
libgradsync.so, as numpy.get_include() and mpi4py.get_include() do for
theirs. ``python -m gradsync --cflags --libs`` prints the same as compiler
flags (gradsync/__main__.py). Only os is imported here.

Both name the package's own files, whether pip installed it or `make` built
it in place: an extension linked against them loads the very library that
gradsync's own extension loaded, so a communicator made in Python can be
used from C (``Communicator.c_handle``; docs/GUIDE.md, "Embedding gradsync").
"""
import os

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def get_include():
    """The folder holding gradsync.h and the other public headers: the
    package's ``include/`` (the wheel's, or the copy `make` puts beside the
    in-place build), else, for an in-place build made before the headers
    were copied there, the checkout's ``include/``."""
    for folder in (os.path.join(_PACKAGE, "include"),
                   os.path.join(os.path.dirname(os.path.dirname(_PACKAGE)), "include")):
        if os.path.isfile(os.path.join(folder, "gradsync.h")):
            return folder
    raise FileNotFoundError(
        f"gradsync's headers are not in {os.path.join(_PACKAGE, 'include')}: this build did "
        "not copy them there (build it again: `make`, or `pip install .`)")


def get_library_dir():
    """The folder holding libgradsync.so (the package's own folder): link
    with ``-L<it> -lgradsync -Wl,-rpath,<it>``."""
    return _PACKAGE
