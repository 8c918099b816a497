"""horovod.torch, provided by gradsync: gradsync.horovod.torch."""
from horovod.torch import elastic  # noqa: F401,E402

from gradsync.horovod.torch import *  # noqa: F401,F403
