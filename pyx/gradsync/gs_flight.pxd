# Mirrors include/gs_flight.h.
from libc.stdint cimport int32_t, int64_t, uint64_t
from gradsync.gs_status cimport gs_status_t

cdef extern from "gs_flight.h" nogil:
    int GS_FLIGHT_FORMAT
    ctypedef struct gs_flight_entry_t:
        uint64_t id
        uint64_t seq
        int32_t comm
        int32_t p2p
        const char *op
        const char *path
        int32_t dtype
        int32_t redop
        int32_t root
        int32_t status
        int64_t n
        int64_t count
        int64_t bytes
        double t_enter
        double t_valid
        double t_sent
        double t_done
        uint64_t thread
        int32_t site
        int32_t tag
    gs_status_t gs_flight_dump(const char *reason)
    const char *gs_flight_dir()
    gs_status_t gs_flight_set_dir(const char *dir)
    const char *gs_flight_file()
    int64_t gs_flight_capacity()
    uint64_t gs_flight_recorded()
    int64_t gs_flight_snapshot(gs_flight_entry_t *out, int64_t cap)
    int32_t gs_flight_site(const char *text)
    void gs_flight_set_site(int32_t site)
    gs_status_t gs_flight_on_signal()
