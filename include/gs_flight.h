/* gradsync: the flight recorder (docs/GUIDE.md, "When a job hangs").
 *
 * Every rank keeps a fixed ring of its last collective and point-to-point
 * calls (GRADSYNC_FLIGHT_ENTRIES, default 4096; 0 turns it off): per
 * communicator sequence number, operation, signature, bytes, path, phase
 * times, thread and status. The ring is written as JSON lines, one file per
 * rank (rank-<world rank>.jsonl in GRADSYNC_FLIGHT_DIR, default
 * $TMPDIR/gradsync-flight-<job>), on a timeout, a mismatch, an MPI error, a
 * stall warning, SIGUSR1, and gs_flight_dump. `python -m gradsync.doctor
 * DIR` reads the files and names the rank and call that diverged. */
#ifndef GRADSYNC_FLIGHT_H
#define GRADSYNC_FLIGHT_H

#include <stdint.h>

#include "gs_export.h"
#include "gs_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The dump format's version (the "v" of every line). */
#define GS_FLIGHT_FORMAT 1

/* One recorded call, as gs_flight_snapshot copies it. */
typedef struct gs_flight_entry {
  uint64_t id;       /* 1 + the process-wide index of the record */
  uint64_t seq;      /* the communicator's collective number (point to point: its own count) */
  int32_t comm;      /* index into the communicator table of the dump */
  int32_t p2p;       /* 1: a send or receive (root is the peer) */
  const char *op;    /* "allreduce", "broadcast", "send", ... (static) */
  const char *path;  /* "host", "shortcut", a device transport's name (static) */
  int32_t dtype;     /* first tensor's gs_dtype_t, -1 with no tensors */
  int32_t redop;     /* gs_op_t */
  int32_t root;      /* root, or the peer of point to point; -1 none */
  int32_t status;    /* gs_status_t once completed; -1 while in flight */
  int64_t n;         /* tensors */
  int64_t count;     /* elements of the first tensor */
  int64_t bytes;     /* bytes of all tensors */
  double t_enter, t_valid, t_sent, t_done; /* gs_now() seconds; 0: not reached */
  uint64_t thread;   /* the calling thread's kernel id */
  int32_t site;      /* the caller's site (gs_flight_site), -1 none */
  int32_t tag;       /* point to point: the tag */
} gs_flight_entry_t;

/* Writes this rank's ring now (replacing its earlier dump); `reason` goes
 * into the file's header. */
GS_API gs_status_t gs_flight_dump(const char *reason);
/* Dumps go to `dir` from now on (made at the first dump; the ranks of a
 * job should name the same one). */
GS_API gs_status_t gs_flight_set_dir(const char *dir);
/* The dump directory and this rank's file in it (empty while off). */
GS_API const char *gs_flight_dir(void);
GS_API const char *gs_flight_file(void);
/* The ring's capacity (0: off). */
GS_API int64_t gs_flight_capacity(void);
/* Calls recorded since the start (the ring keeps the last capacity). */
GS_API uint64_t gs_flight_recorded(void);
/* Copies up to `cap` of the most recent entries, oldest first, into `out`;
 * returns how many. Entries being written meanwhile are skipped. */
GS_API int64_t gs_flight_snapshot(gs_flight_entry_t *out, int64_t cap);
/* Interns a call site's text (a Python stack) and returns its id, or -1
 * when the table is full or the recorder is off. */
GS_API int32_t gs_flight_site(const char *text);
/* The site the calling thread's next calls are recorded with (-1: none). */
GS_API void gs_flight_set_site(int32_t site);
/* Dumps on SIGUSR1 from a thread of its own, without stopping the job (the
 * handler only writes to a pipe, then calls the handler it replaced, if
 * any). Never installed unless asked for: this call, or GRADSYNC_FLIGHT_SIGNAL=1
 * in Python. Idempotent; GS_ERR_INTERNAL if no thread. */
GS_API gs_status_t gs_flight_on_signal(void);

#ifdef __cplusplus
}
#endif
#endif
