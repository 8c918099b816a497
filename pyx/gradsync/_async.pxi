# Requests of asynchronous collectives (included by _core.pyx). A Request
# keeps the arrays it was given alive until its collective has finished: the
# C runtime reads and writes their memory from its background thread.

import weakref

cdef class Request:
    """A collective running in the background: ``wait()`` returns what the
    call was given (raising its error, if any), ``test()`` says whether it has
    finished, ``done`` is the same as a property.

    On CUDA memory ``wait()`` behaves like a framework's stream-ordered op: it
    returns once the collective is queued on the GPU and makes the caller's
    work stream (the producer's current stream, e.g. torch's) wait for it, so
    the host is not blocked; ``synchronize()`` waits on the host. gradsync's
    background thread watches the GPU work (GRADSYNC_TIMEOUT_SECONDS)."""
    cdef gs_request_t req
    cdef TensorList keep   # the arrays' descriptors and owners
    cdef object keep_also  # a second call argument's (outputs), or None
    cdef object comm       # the Comm it runs on: freed after its requests, never before
    cdef object result     # what wait() returns
    cdef bint finished
    cdef bint on_cuda
    cdef uintptr_t work_stream
    cdef int source        # a receive from any source: its sender, once matched
    cdef object __weakref__

    def __cinit__(self):
        self.req = NULL
        self.finished = False
        self.source = -1

    def __dealloc__(self):
        # waits if still running: its memory must outlive the collective
        if self.req != NULL:
            with nogil:
                gs_request_free(&self.req)

    def wait(self, stream=None):
        """Host memory: blocks until the collective has finished. CUDA memory:
        makes ``stream`` (a cudaStream_t as an int, 1 the legacy default
        stream; None: the work stream the call was made on) wait for it,
        without blocking the host. Returns the call's tensors."""
        cdef gs_status_t s
        cdef uintptr_t on = self.work_stream if stream is None else <uintptr_t>stream
        if self.finished:
            return self.result
        if not self.on_cuda:
            return self.synchronize()
        with nogil:
            s = gs_request_wait_stream(self.req, on)
        CHKERR(s)
        return self.result

    def synchronize(self):
        """Blocks the host until the collective (its GPU work included) has
        finished; returns its tensors."""
        cdef gs_status_t s
        if not self.finished:
            with nogil:
                s = gs_request_wait(self.req)
            self.finished = True
            self.keep = None
            self.keep_also = None
            CHKERR(s)
        return self.result

    def stream(self):
        """While the collective's GPU work is pending: the cudaStream_t (an
        int) it runs on, once queued; else None."""
        cdef void *s = NULL
        if self.finished or not self.on_cuda:
            return None
        with nogil:
            CHKERR(gs_request_stream(self.req, &s))
        return <uintptr_t>s if s != NULL else None

    def test(self):
        """True once the collective has finished (raises its error then)."""
        cdef int done = 0
        cdef gs_status_t s
        if self.finished:
            return True
        with nogil:
            s = gs_request_test(self.req, &done)
        CHKERR(s)
        if done:
            self.finished = True
            self.keep = None
            self.keep_also = None
        return bool(done)

    @property
    def done(self):
        return self.test()

    @property
    def source(self):
        """A receive from any source (recv_any_async_): the rank its message
        came from, once matched (-1 before, and for every other request)."""
        return self.source

    def __repr__(self):
        return f"<gradsync.Request {'done' if self.finished else 'pending'}>"


def requests_pending():
    """Asynchronous collectives queued or running in this process."""
    return gs_requests_pending()


cdef Request new_request(TensorList tl, object result):
    cdef Request r = Request.__new__(Request)
    r.keep = tl
    r.result = result
    r.on_cuda = tl.n > 0 and tl.t[0].device.kind == GS_DEVICE_CUDA
    r.work_stream = tl.work_stream
    if r.on_cuda:  # its arrays export the pending work (DLPack, CAI)
        for a in tl.arrays:
            if isinstance(a, DeviceArray):
                (<DeviceArray>a).pending = weakref.ref(r)
    return r
