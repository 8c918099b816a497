/* Status strings and the per-thread last-error message. */
#include <stdio.h>
#include <string.h>

#include "base/gs_base.h"

static _Thread_local char last_error[GS_ERROR_MAX];
/* the ranks the last GS_ERR_PEER_LOST named (gs_fail_lost) */
#define LOST_MAX 64
static _Thread_local int lost[LOST_MAX], nlost;

const char *gs_status_string(gs_status_t status) {
  switch (status) {
    case GS_SUCCESS: return "success";
    case GS_ERR_INVALID_ARGUMENT:
      return "invalid argument: check the value named in gs_last_error()";
    case GS_ERR_TYPE: return "unsupported dtype or op for this dtype";
    case GS_ERR_MISMATCH:
      return "ranks made different calls: gs_last_error() says what differs and where";
    case GS_ERR_MPI: return "the MPI library reported an error";
    case GS_ERR_NO_MEMORY: return "out of host memory";
    case GS_ERR_UNSUPPORTED: return "not available in this build of gradsync";
    case GS_ERR_INTERNAL:
      return "internal error in gradsync: please report it with gs_last_error()";
    case GS_ERR_CLOSED: return "the communicator was freed";
    case GS_ERR_CUDA: return "the CUDA runtime reported an error";
    case GS_ERR_NCCL: return "NCCL reported an error";
    case GS_ERR_TIMEOUT: return "a collective took longer than its timeout";
    case GS_ERR_INTERRUPTED: return "a wait was interrupted (the interrupt check fired)";
    case GS_ERR_PEER_LOST:
      return "a peer's process is gone: gs_last_error() and gs_last_lost_ranks() name it";
  }
  return "unknown status";
}

const char *gs_last_error(void) { return last_error; }

void gs_clear_error(void) {
  last_error[0] = '\0';
  nlost = 0;
}

gs_status_t gs_fail(gs_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  if (status != GS_ERR_PEER_LOST) nlost = 0; /* a rewording keeps the ranks */
  return status;
}

gs_status_t gs_fail_lost(const int *ranks, int n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  nlost = n;
  for (int k = 0; k < n && k < LOST_MAX; k++) lost[k] = ranks[k];
  return GS_ERR_PEER_LOST;
}

int gs_last_lost_ranks(int *ranks, int max) {
  int n = nlost < LOST_MAX ? nlost : LOST_MAX;
  for (int k = 0; ranks && k < n && k < max; k++) ranks[k] = lost[k];
  return n;
}
