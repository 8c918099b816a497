"""horovod.common.util, provided by gradsync: the helpers Horovod's own
tests and scripts import from it."""
import contextlib
import os

__all__ = ["env", "gloo_built", "mpi_built", "nccl_built"]


@contextlib.contextmanager
def env(**kwargs):
    """Sets environment variables (None values are skipped) for the block,
    then restores what was there."""
    values = {k: str(v) for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gloo_built(verbose=False):
    """False: gradsync has no Gloo controller."""
    return False


def mpi_built(verbose=False):
    """True: gradsync always runs on MPI."""
    return True


def nccl_built(verbose=False):
    """NCCL_VERSION_CODE of gradsync's NCCL, or 0."""
    from gradsync.horovod import nccl_built as built

    return built()
