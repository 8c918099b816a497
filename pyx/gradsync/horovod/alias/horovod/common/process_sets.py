"""horovod.common.process_sets, provided by gradsync."""
from gradsync.horovod.process_sets import *  # noqa: F401,F403
