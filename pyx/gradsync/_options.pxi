# gradsync.call_options (included by _core.pyx): the calling thread's call
# tag and per-call timeout (gs_set_call_options), as a context manager.

import hashlib


cdef uint64_t _tag_value(object tag) except? 0:
    """A call tag as the C API takes it: an int in [1, 2**64), or a str
    (or bytes) hashed to 64 bits (BLAKE2b), the same on every rank."""
    if isinstance(tag, str):
        tag = tag.encode()
    if isinstance(tag, (bytes, bytearray)):
        value = int.from_bytes(hashlib.blake2b(bytes(tag), digest_size=8).digest(), "little")
        return value or 1  # 0 means "no tag"
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int or a str, got {type(tag).__name__}")
    if not 0 < tag < 2 ** 64:
        raise ValueError(f"tag must be in [1, 2**64) (None: no tag), got {tag}")
    return tag


cdef class call_options:
    """``with gs.call_options(tag=..., timeout=...):`` the collectives this
    thread starts inside the block, on any communicator (asynchronous ones
    when queued), carry them; other threads' calls do not see them. None
    keeps the enclosing block's value (outside any block: no tag, the
    communicator's timeout).

    - ``tag``: an int in [1, 2**64) or a str (hashed to 64 bits). Validation
      compares it across ranks with the call's other arguments: ranks whose
      tags differ raise MismatchError naming the call tag, on every rank, and
      nothing is written (not compared with GRADSYNC_CHECK=0).
    - ``timeout``: seconds (> 0) each of those calls may wait, in place of
      the communicator's ``timeout``; TimeoutError names it as the call's.
      Device work the calls queue keeps the communicator's limit."""
    cdef gs_call_options_t new, saved
    cdef bint entered

    def __cinit__(self, tag=None, timeout=None):
        gs_get_call_options(&self.new)
        if tag is not None:
            self.new.tag = _tag_value(tag)
        if timeout is not None:
            seconds = float(timeout)
            if not seconds > 0:
                raise ValueError(f"timeout must be > 0 seconds (None: the communicator's), "
                                 f"got {timeout!r}")
            self.new.timeout = seconds

    def __enter__(self):
        if self.entered:
            raise RuntimeError("call_options: this block is already entered")
        gs_get_call_options(&self.saved)
        CHKERR(gs_set_call_options(&self.new))
        self.entered = True
        return self

    def __exit__(self, *exc):
        self.entered = False
        CHKERR(gs_set_call_options(&self.saved))
        return False

    @property
    def tag(self):
        """The 64-bit tag the block's calls carry (None: none)."""
        return self.new.tag or None

    @property
    def timeout(self):
        """The block's per-call timeout in seconds (None: the communicator's)."""
        return self.new.timeout or None
