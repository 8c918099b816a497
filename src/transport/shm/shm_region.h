/* gradsync private, transport/shm/: the region's layout, shared by the
 * files that make it (region.c) and exchange over it (exchange.c).
 *
 *   [0, header)   one cache line of identity (magic, token, ranks, sizes),
 *                 then one cache line per rank holding its published counter
 *   rank r's two slots, slot_bytes each (rounded to pages), at
 *                 header + r * 2 * slot_bytes
 */
#ifndef GRADSYNC_SHM_REGION_H
#define GRADSYNC_SHM_REGION_H

#include "transport/shm/gs_shm.h"

#define GS_SHM_MAGIC 0x6773686d72656731ull /* "gshmreg1" */
#define GS_SHM_LINE 64

typedef struct shm_identity {
  uint64_t magic, token;
  int64_t ranks, slot_bytes, total_bytes;
  /* 0 while every rank is in; then, in one word so that it is written at
   * once, of the first rank whose wait on this communicator gave up
   * (gs_shm_give_up): the last exchange it completed (the ones up to it
   * stand; low 32 bits) << 32 | its status << 24 | its rank + 1 */
  uint64_t abandoned;
} shm_identity_t;

struct gs_shm {
  char *base;               /* the mapping */
  size_t total, header, slot_bytes;
  int rank, size;
  uint64_t seq;             /* exchanges begun */
  uint64_t done;            /* exchanges completed */
  int64_t *pids;            /* every rank's process */
  int *pidfds;              /* a handle on each peer's process (-1: none, kill(pid, 0) asks) */
  const void **slots;       /* the last exchange's slots, by rank */
  unsigned char *arrived;   /* per rank, during a wait */
};

/* Rank r's published counter. */
static inline uint64_t *gs_shm_published(const gs_shm_t *s, int r) {
  return (uint64_t *)(s->base + (size_t)(r + 1) * GS_SHM_LINE);
}

/* Rank r's slot for exchange k. */
static inline char *gs_shm_slot(const gs_shm_t *s, int r, uint64_t k) {
  return s->base + s->header + ((size_t)r * 2 + (size_t)(k & 1)) * s->slot_bytes;
}

#endif
