"""The opt-in ``horovod`` alias: a folder holding a package named
``horovod`` whose modules are gradsync.horovod's, so that an unchanged
Horovod script (``import horovod.torch as hvd``) runs on gradsync.

Nothing is aliased unless asked for: the folder is not on ``sys.path``, so
a real Horovod installed beside gradsync keeps its name. Opt in with one of

- ``PYTHONPATH="$(python -m gradsync.horovod.alias)${PYTHONPATH:+:$PYTHONPATH}"``
  (this module, run, prints the folder), for scripts and test suites left
  unchanged;
- ``gradsync.horovod.install()`` in a program (or a conftest, a
  sitecustomize) before it imports horovod.
"""
import os

FOLDER = os.path.dirname(os.path.abspath(__file__))


def folder():
    """The folder to put on ``sys.path`` (PYTHONPATH) for the alias."""
    return FOLDER
