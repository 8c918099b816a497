"""horovod.common.exceptions, provided by gradsync."""
from gradsync.horovod.elastic import HostsUpdatedInterrupt  # noqa: F401
from gradsync.horovod.errors import HorovodInternalError  # noqa: F401

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
