"""horovod.torch.optimizer, provided by gradsync."""
from gradsync.horovod.torch.optimizer import *  # noqa: F401,F403
