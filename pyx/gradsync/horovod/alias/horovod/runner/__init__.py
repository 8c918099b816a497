"""horovod.runner, provided by gradsync: ``run`` starts a function on N
processes under mpiexec (gradsync.horovod.run)."""
from gradsync.horovod.run import run  # noqa: F401

__all__ = ["run"]
