/* gradsync: status codes and error reporting.
 *
 * Every public function returns a gs_status_t. The detailed message of the
 * most recent failure on the calling thread is kept by gs_last_error(). */
#ifndef GRADSYNC_STATUS_H
#define GRADSYNC_STATUS_H

#include "gs_export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Explicit values, append-only: bindings and saved logs rely on them. */
typedef enum gs_status {
  GS_SUCCESS = 0,
  GS_ERR_INVALID_ARGUMENT = 1, /* a bad value, pointer, count or layout   */
  GS_ERR_TYPE = 2,             /* unsupported dtype, or op for that dtype */
  GS_ERR_MISMATCH = 3,         /* ranks disagree on the call              */
  GS_ERR_MPI = 4,              /* the MPI library reported an error       */
  GS_ERR_NO_MEMORY = 5,
  GS_ERR_UNSUPPORTED = 6,      /* valid, but not available in this build  */
  GS_ERR_INTERNAL = 7,         /* a bug in gradsync: please report it     */
  GS_ERR_CLOSED = 8,           /* the communicator was freed              */
  GS_ERR_CUDA = 9,
  GS_ERR_NCCL = 10,
  GS_ERR_TIMEOUT = 11,         /* waited past GRADSYNC_TIMEOUT_SECONDS     */
  GS_ERR_INTERRUPTED = 12,     /* the interrupt check (Ctrl-C) fired      */
  GS_ERR_PEER_LOST = 13        /* a peer's process is gone (killed, died) */
} gs_status_t;

/* A short sentence for a status, saying what to do next. Never NULL. */
GS_API const char *gs_status_string(gs_status_t status);

/* The detailed message of the last failing call on this thread ("" if none). */
GS_API const char *gs_last_error(void);

/* After GS_ERR_PEER_LOST: the lost ranks (in the failing communicator's
 * numbering), up to `max` of them into `ranks`; returns how many there are
 * (0 when the last failure on this thread named none). */
GS_API int gs_last_lost_ranks(int *ranks, int max);

#ifdef __cplusplus
}
#endif
#endif
