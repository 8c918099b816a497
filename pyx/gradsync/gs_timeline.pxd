# Mirrors include/gs_timeline.h.
from gradsync.gs_status cimport gs_status_t

cdef extern from "gs_timeline.h" nogil:
    gs_status_t gs_timeline_start(const char *path)
    gs_status_t gs_timeline_stop()
    int gs_timeline_active()
