"""horovod.torch.elastic, provided by gradsync (gradsync.horovod.torch.elastic)."""
from gradsync.horovod.torch.elastic import *  # noqa: F401,F403
