/* GRADSYNC_LOG_LEVEL: error, warning (default), info or debug, to stderr,
 * one line per message with the rank in front, written with one call so
 * ranks' lines do not interleave mid-line. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "base/gs_base.h"

static int level_from_env(void) {
  const char *s = gs_env_log_level();
  if (!s) return GS_LOG_WARNING;
  static const char *const names[] = {"error", "warning", "info", "debug"};
  for (int k = 0; k < 4; k++)
    if (strcasecmp(s, names[k]) == 0) return k;
  return GS_LOG_WARNING;
}

int gs_log_level(void) {
  static int level = -1;
  if (level < 0) level = level_from_env();
  return level;
}

static int named_rank = -1;

void gs_log_set_rank(int rank) { named_rank = rank; }

void gs_log(int level, const char *fmt, ...) {
  if (level > gs_log_level()) return;
  static const char *const tags[] = {"ERROR", "WARNING", "INFO", "DEBUG"};
  int init = 0, fin = 0, rank = named_rank;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (rank < 0 && init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char line[2048];
  int n = snprintf(line, sizeof line, "[gradsync rank %d] %s: ", rank, tags[level]);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof line) n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  if (n >= (int)sizeof line - 1) n = (int)sizeof line - 2;
  line[n] = '\n';
  fwrite(line, 1, (size_t)n + 1, stderr);
  fflush(stderr);
}
