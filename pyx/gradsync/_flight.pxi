# The flight recorder's Python side (included by _core.pyx): dumps on
# demand and on an uncaught gradsync error, SIGUSR1, and the callers'
# stacks (GRADSYNC_FLIGHT_STACKS=1): each gradsync call from Python names
# the first frames outside gradsync, interned once per distinct stack in C's
# site table, so the C ring stores one integer per call.

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STACK_DEPTH = 6  # frames kept per site: the user's line and its callers

cdef bint _flight_stacks = os.environ.get("GRADSYNC_FLIGHT_STACKS", "") not in ("", "0")
cdef dict _flight_sites = {}


def flight_stacks(on=None):
    """Whether gradsync calls record their caller's stack; ``on`` sets it."""
    global _flight_stacks
    if on is not None:
        _flight_stacks = bool(on)
    return bool(_flight_stacks)


cdef tuple _site_key(object f):
    """(id of the code, instruction offset) of up to _STACK_DEPTH frames from
    f outward. Ids, not the code objects, because hashing a code object hashes
    its contents; _intern_site keeps every code object it names alive, so an
    id in the table is never reused. The offset, not f_lineno, which Python
    computes by scanning the code's line table at every read; the line is
    looked up once per distinct site."""
    key = []
    while f is not None and len(key) < 2 * _STACK_DEPTH:
        key.append(id(f.f_code))
        key.append(f.f_lasti)
        f = f.f_back
    return tuple(key)


cdef object _line_at(object code, int offset):
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line
    return code.co_firstlineno


cdef list _flight_codes = []  # the code objects the site table names, kept alive


cdef int32_t _intern_site(tuple key, object f):
    lines = []
    while f is not None and len(lines) < _STACK_DEPTH:
        code = f.f_code
        _flight_codes.append(code)
        lines.append("%s:%s in %s" % (code.co_filename, _line_at(code, f.f_lasti),
                                      code.co_name))
        f = f.f_back
    cdef int32_t site = gs_flight_site("\n".join(lines).encode("utf-8", "replace"))
    _flight_sites[key] = site
    return site


_LIBRARY_MARKS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen")
_REENTRY_DEPTH = 4  # library frames between two gradsync frames, at most


cdef bint _in_gradsync(object f):
    return f.f_code.co_filename.startswith(_PKG_DIR)


cdef bint _in_library(object f):
    cdef str name = f.f_code.co_filename
    for m in _LIBRARY_MARKS:
        if m in name:
            return True
    return False


cdef object _user_frame(object f):
    """The first frame outside gradsync, passing over library frames that
    gradsync called and that call back into it (torch.autograd.Function's
    apply between a Horovod op and its autograd function)."""
    cdef int k
    while True:
        while f is not None and _in_gradsync(f):
            f = f.f_back
        g, k = f, 0
        while g is not None and k < _REENTRY_DEPTH and _in_library(g):
            g, k = g.f_back, k + 1
        if g is None or k == 0 or not _in_gradsync(g):
            return f
        f = g


cdef int32_t _caller_site() except -3:
    """The site of this thread's first frame outside gradsync (_user_frame);
    -2 when there is none (a gradsync thread)."""
    f = _user_frame(sys._getframe(0))
    if f is None:
        return -2
    key = _site_key(f)
    site = _flight_sites.get(key)
    return _intern_site(key, f) if site is None else site


_flight_pinned = threading.local()  # .site: this thread runs others' work (flight_use_site)


cdef void flight_mark() except *:
    """Sets this thread's call site to its first frame outside gradsync, or
    to the site a thread running others' work was given (flight_use_site)."""
    pinned = getattr(_flight_pinned, "site", None)
    cdef int32_t site = _caller_site() if pinned is None else pinned
    if site != -2:
        gs_flight_set_site(site)


def flight_site_here():
    """The caller's site in the flight record (an integer) while stacks are
    recorded, else -1: for work queued now and run later on another thread
    (flight_use_site there), so the record names the line that queued it."""
    if not _flight_stacks:
        return -1
    cdef int32_t site = _caller_site()
    return -1 if site == -2 else site


def flight_use_site(site):
    """This thread's next gradsync calls are recorded at ``site`` (from
    flight_site_here; -1 none), not at their own caller; None undoes it."""
    _flight_pinned.site = site
    gs_flight_set_site(-1 if site is None else site)


def dump_flight_record(reason="on demand"):
    """Writes this rank's flight record now (JSON lines, replacing its earlier
    dump) and returns the file's path; read the directory's files with
    ``python -m gradsync.doctor DIR``."""
    r = str(reason).encode("utf-8", "replace")
    CHKERR(gs_flight_dump(r))
    return gs_flight_file().decode()


def flight_record_dir(path=None):
    """The directory every rank dumps into ('' while the recorder is off);
    ``path`` sets it (GRADSYNC_FLIGHT_DIR does at start)."""
    if path is not None:
        p = os.fsencode(path)
        CHKERR(gs_flight_set_dir(p))
    return gs_flight_dir().decode()


def flight_record_capacity():
    """Entries the flight recorder's ring holds (GRADSYNC_FLIGHT_ENTRIES; 0:
    the recorder is off)."""
    return gs_flight_capacity()


def _gradsync_in(exc):
    """An error of a gradsync call, itself or as the cause of the exception."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, Error):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _flight_excepthook(exc_type, exc, tb, _previous=sys.excepthook):
    if gs_flight_capacity() > 0 and _gradsync_in(exc):
        try:
            path = dump_flight_record("uncaught %s: %s" % (exc_type.__name__, exc))
            sys.stderr.write("gradsync: flight record written to %s "
                             "(python -m gradsync.doctor %s)\n" % (path, flight_record_dir()))
        except Exception:  # a failed dump must not hide the exception itself
            pass
    _previous(exc_type, exc, tb)


def flight_on_signal():
    """Dumps this rank's flight record whenever the process gets SIGUSR1
    (``kill -USR1 <pid>`` on a hung rank), from a thread of gradsync's own,
    without stopping the job; a handler the program or a framework installed
    before is still called after the dump. Off unless asked for, by this
    call or GRADSYNC_FLIGHT_SIGNAL=1: a library takes no signal by itself."""
    CHKERR(gs_flight_on_signal())


# Importing gradsync changes no process-wide state it was not asked to: the
# signal handler is opt-in, and the hook on uncaught exceptions (a dump when
# a gradsync error ends the program) is installed only while the recorder is
# on, calling the hook it found.
if os.environ.get("GRADSYNC_FLIGHT_SIGNAL", "") not in ("", "0"):
    flight_on_signal()
if gs_flight_capacity() > 0:
    sys.excepthook = _flight_excepthook
