"""horovod.torch.functions, provided by gradsync."""
from gradsync.horovod.torch.functions import *  # noqa: F401,F403
