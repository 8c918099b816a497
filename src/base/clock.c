/* The clock every timeout, stall warning and timeline event reads. */
#include <time.h>

#include "base/gs_base.h"

double gs_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
