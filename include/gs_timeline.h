/* gradsync: a Chrome-trace timeline of every collective's phases.
 *
 * While recording, rank 0 of MPI_COMM_WORLD notes each collective's phases
 * (validate, pack, communicate, unpack, Adasum levels) with one row per fused
 * message, and writes them as Chrome trace JSON (chrome://tracing, Perfetto)
 * when recording stops or the process exits. Other ranks record nothing.
 * GRADSYNC_TIMELINE=path starts recording when the first communicator is
 * created. Off, it costs one predictable branch per phase. */
#ifndef GRADSYNC_TIMELINE_H
#define GRADSYNC_TIMELINE_H

#include "gs_export.h"
#include "gs_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Starts recording into `path` (replacing a recording in progress, which is
 * written first). MPI must be initialized. */
GS_API gs_status_t gs_timeline_start(const char *path);
/* Writes the file and stops; no-op when not recording. */
GS_API gs_status_t gs_timeline_stop(void);
/* 1 while this process records. */
GS_API int gs_timeline_active(void);

#ifdef __cplusplus
}
#endif
#endif
