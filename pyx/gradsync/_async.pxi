# Requests of asynchronous collectives (included by _core.pyx). A Request
# keeps the arrays it was given alive until its collective has finished: the
# C runtime reads and writes their memory from its background thread.

cdef class Request:
    """A collective running in the background: ``wait()`` returns what the
    call was given (raising its error, if any), ``test()`` says whether it has
    finished, ``done`` is the same as a property."""
    cdef gs_request_t req
    cdef TensorList keep   # the arrays' descriptors and owners
    cdef object keep_also  # a second call argument's (outputs), or None
    cdef object result     # what wait() returns
    cdef bint finished

    def __cinit__(self):
        self.req = NULL
        self.finished = False

    def __dealloc__(self):
        # waits if still running: its memory must outlive the collective
        if self.req != NULL:
            with nogil:
                gs_request_free(&self.req)

    def wait(self):
        """Blocks until the collective has finished; returns its tensors."""
        cdef gs_status_t s
        if not self.finished:
            with nogil:
                s = gs_request_wait(self.req)
            self.finished = True
            self.keep = None
            self.keep_also = None
            CHKERR(s)
        return self.result

    def test(self):
        """True once the collective has finished (raises its error then)."""
        cdef int done = 0
        if self.finished:
            return True
        CHKERR(gs_request_test(self.req, &done))
        if done:
            self.finished = True
            self.keep = None
            self.keep_also = None
        return bool(done)

    @property
    def done(self):
        return self.test()

    def __repr__(self):
        return f"<gradsync.Request {'done' if self.finished else 'pending'}>"


def requests_pending():
    """Asynchronous collectives queued or running in this process."""
    return gs_requests_pending()


cdef Request new_request(TensorList tl, object result):
    cdef Request r = Request.__new__(Request)
    r.keep = tl
    r.result = result
    return r
