/* The Chrome-trace timeline: events kept in memory while recording (rank 0
 * of MPI_COMM_WORLD only) and written as one JSON array at stop or exit. */
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/gs_base.h"

typedef struct tl_event {
  const char *name;  /* static strings only: phase and call names */
  const char *call;
  double start, end; /* seconds, gs_now() */
  int64_t row;
  int64_t bytes;
} tl_event_t;

int gs_tl_on;
static pthread_mutex_t tl_lock = PTHREAD_MUTEX_INITIALIZER;
static tl_event_t *events;
static size_t nevents, capacity;
static char *tl_path;
static double tl_origin;
static int64_t max_row;
static int exit_hook;

int gs_timeline_active(void) { return gs_tl_on; }

void gs_tl_event(const char *name, const char *call, int64_t row, double start, int64_t bytes) {
  double end = gs_now();
  pthread_mutex_lock(&tl_lock);
  if (gs_tl_on && nevents == capacity) {
    size_t want = capacity ? 2 * capacity : 4096;
    tl_event_t *p = realloc(events, want * sizeof *p);
    if (p) {
      events = p;
      capacity = want;
    }
  }
  if (gs_tl_on && nevents < capacity) {
    events[nevents++] = (tl_event_t){name, call, start, end, row, bytes};
    if (row > max_row) max_row = row;
  }
  pthread_mutex_unlock(&tl_lock);
}

static gs_status_t write_locked(void) {
  FILE *f = fopen(tl_path, "w");
  if (!f) return gs_fail(GS_ERR_INVALID_ARGUMENT, "timeline: cannot write %s", tl_path);
  fprintf(f, "[\n");
  fprintf(f,
          "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,"
          "\"args\":{\"name\":\"gradsync rank 0\"}}");
  for (int64_t r = 0; r <= max_row; r++)
    fprintf(f,
            ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%lld,"
            "\"args\":{\"name\":\"%s %lld\"}}",
            (long long)r, r ? "message" : "calls", (long long)r);
  for (size_t k = 0; k < nevents; k++) {
    const tl_event_t *e = &events[k];
    fprintf(f,
            ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":0,\"tid\":%lld,"
            "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"bytes\":%lld}}",
            e->name, e->call, (long long)e->row, (e->start - tl_origin) * 1e6,
            (e->end - e->start) * 1e6, (long long)e->bytes);
  }
  fprintf(f, "\n]\n");
  int bad = ferror(f);
  if (fclose(f) != 0 || bad)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "timeline: writing %s failed", tl_path);
  return GS_SUCCESS;
}

gs_status_t gs_timeline_stop(void) {
  pthread_mutex_lock(&tl_lock);
  gs_status_t s = GS_SUCCESS;
  if (tl_path) s = write_locked();
  gs_tl_on = 0;
  free(tl_path);
  free(events);
  tl_path = NULL;
  events = NULL;
  nevents = capacity = 0;
  max_row = 0;
  pthread_mutex_unlock(&tl_lock);
  return s;
}

static void stop_at_exit(void) { gs_timeline_stop(); }

gs_status_t gs_timeline_start(const char *path) {
  gs_clear_error();
  if (!path || !*path) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_timeline_start: path is empty");
  int init = 0, rank = 0;
  MPI_Initialized(&init);
  if (!init) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_timeline_start: MPI is not initialized");
  GS_CHECK(gs_timeline_stop());
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) return GS_SUCCESS; /* rank 0 speaks for the job */
  pthread_mutex_lock(&tl_lock);
  tl_path = strdup(path);
  tl_origin = gs_now();
  gs_tl_on = tl_path != NULL;
  if (!exit_hook) exit_hook = atexit(stop_at_exit) == 0;
  pthread_mutex_unlock(&tl_lock);
  return tl_path ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "gs_timeline_start: out of memory");
}

void gs_timeline_from_env(void) {
  static int done;
  if (done) return;
  done = 1;
  const char *p = gs_env_timeline();
  if (p) gs_timeline_start(p);
}
