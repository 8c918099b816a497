# Mirrors include/gs_flight.h.
from libc.stdint cimport int32_t, int64_t, uint64_t
from gradsync.gs_status cimport gs_status_t

cdef extern from "gs_flight.h" nogil:
    int GS_FLIGHT_FORMAT
    gs_status_t gs_flight_dump(const char *reason)
    const char *gs_flight_dir()
    gs_status_t gs_flight_set_dir(const char *dir)
    const char *gs_flight_file()
    int64_t gs_flight_capacity()
    uint64_t gs_flight_recorded()
    int32_t gs_flight_site(const char *text)
    void gs_flight_set_site(int32_t site)
    gs_status_t gs_flight_on_signal()
