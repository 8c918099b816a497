"""horovod.torch.sync_batch_norm, provided by gradsync."""
from gradsync.horovod.torch.sync_batch_norm import *  # noqa: F401,F403
