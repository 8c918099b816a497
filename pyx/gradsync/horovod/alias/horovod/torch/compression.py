"""horovod.torch.compression, provided by gradsync."""
from gradsync.horovod.torch.compression import *  # noqa: F401,F403
