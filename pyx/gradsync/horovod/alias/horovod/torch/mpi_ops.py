"""horovod.torch.mpi_ops, provided by gradsync."""
from gradsync.horovod.torch.mpi_ops import *  # noqa: F401,F403
