/* The host's shared region: made by rank 0 as a memfd, opened by the others
 * through /proc/<rank 0>/fd/<fd> (no name anywhere, so nothing can be left
 * behind), checked against a random token rank 0 sends over MPI (a /proc
 * path read in another PID namespace or on another host names some other
 * file, or none), agreed on by every rank or dropped by every rank. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "transport/shm/shm_region.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every Linux architecture */
#endif

/* What rank 0 tells the others about the region it made. */
typedef struct shm_offer {
  int64_t ok, pid, fd, total, slot_bytes;
  uint64_t token;
} shm_offer_t;

static size_t round_page(size_t n) { return (n + 4095) & ~(size_t)4095; }

static uint64_t fresh_token(void) {
  uint64_t t = 0;
  if (syscall(SYS_getrandom, &t, sizeof t, 0) != (long)sizeof t) t = 0;
  return t ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(gs_now() * 1e9);
}

/* Rank 0: the memfd, sized and mapped, its identity written; returns the fd
 * (-1 and *why on failure). */
static int make_region(int p, shm_offer_t *o, char **base, char *why, size_t nwhy) {
  size_t header = round_page((size_t)(p + 1) * GS_SHM_LINE);
  o->total = (int64_t)(header + (size_t)p * 2 * (size_t)o->slot_bytes);
  int fd = memfd_create("gradsync", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)o->total) != 0) {
    snprintf(why, nwhy, "memfd_create/ftruncate: %s", strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
  }
  void *m = mmap(NULL, (size_t)o->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    snprintf(why, nwhy, "mmap: %s", strerror(errno));
    close(fd);
    return -1;
  }
  *base = m;
  o->token = fresh_token();
  *(shm_identity_t *)m = (shm_identity_t){GS_SHM_MAGIC, o->token, p, o->slot_bytes, o->total, 0};
  o->ok = 1;
  o->pid = getpid();
  o->fd = fd;
  return fd;
}

/* The other ranks: rank 0's region through /proc, checked; NULL and *why
 * when it cannot be opened or is not the one offered. */
static char *open_region(int p, const shm_offer_t *o, char *why, size_t nwhy) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)o->pid, (long long)o->fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || st.st_size != (off_t)o->total) {
    snprintf(why, nwhy, "opening %s: %s", path, fd < 0 ? strerror(errno) : "not rank 0's region");
    if (fd >= 0) close(fd);
    return NULL;
  }
  void *m = mmap(NULL, (size_t)o->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd); /* the mapping keeps the memory */
  if (m == MAP_FAILED) {
    snprintf(why, nwhy, "mmap of %s: %s", path, strerror(errno));
    return NULL;
  }
  const shm_identity_t *id = m;
  if (id->magic != GS_SHM_MAGIC || id->token != o->token || id->ranks != p) {
    snprintf(why, nwhy, "%s is not rank 0's region (another PID namespace?)", path);
    munmap(m, (size_t)o->total);
    return NULL;
  }
  return m;
}

/* The handles on the peers' processes the waits watch (pidfd_open, Linux
 * 5.3; without it the waits ask kill(pid, 0)). */
static gs_status_t watch_peers(gs_comm_t c, gs_shm_t *s) {
  s->pids = calloc((size_t)s->size, sizeof *s->pids);
  s->pidfds = malloc((size_t)s->size * sizeof *s->pidfds);
  s->slots = calloc((size_t)s->size, sizeof *s->slots);
  s->arrived = calloc((size_t)s->size, 1);
  if (!s->pids || !s->pidfds || !s->slots || !s->arrived) {
    free(s->pidfds);
    s->pidfds = NULL;
    return gs_fail(GS_ERR_NO_MEMORY, "gs_comm_create: out of memory");
  }
  for (int r = 0; r < s->size; r++) s->pidfds[r] = -1;
  s->pids[s->rank] = getpid();
  GS_MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, s->pids, 1, MPI_INT64_T, c->mpi),
               "gs_comm_create: exchanging process ids");
  for (int r = 0; r < s->size; r++)
    s->pidfds[r] = r == s->rank ? -1 : (int)syscall(SYS_pidfd_open, (pid_t)s->pids[r], 0);
  return GS_SUCCESS;
}

/* Offered by rank 0, opened by the rest; *ok: whether this rank has it. */
static gs_status_t offer(gs_comm_t c, int64_t slot_bytes, gs_shm_t *s, int *ok, char *why,
                         size_t nwhy) {
  shm_offer_t o = {0, 0, -1, 0, (int64_t)round_page((size_t)slot_bytes), 0};
  int fd = -1;
  if (c->rank == 0) fd = make_region(c->size, &o, &s->base, why, nwhy);
  int e = MPI_Bcast(&o, (int)(sizeof o / sizeof(int64_t)), MPI_INT64_T, 0, c->mpi);
  if (e == MPI_SUCCESS && c->rank != 0 && o.ok) s->base = open_region(c->size, &o, why, nwhy);
  if (e == MPI_SUCCESS && c->rank != 0 && !o.ok) snprintf(why, nwhy, "rank 0 could not make it");
  int mine = s->base != NULL, all = 0;
  if (e == MPI_SUCCESS) e = MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, c->mpi);
  if (fd >= 0) close(fd); /* every rank has opened it, or given up */
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, "gs_comm_create: agreeing on the shared region");
  s->total = (size_t)o.total;
  s->slot_bytes = (size_t)o.slot_bytes;
  s->header = round_page((size_t)(c->size + 1) * GS_SHM_LINE);
  if (all == 0 && mine && !why[0]) snprintf(why, nwhy, "another rank could not open it");
  *ok = all != 0;
  return GS_SUCCESS;
}

gs_status_t gs_shm_open(gs_comm_t c, int64_t slot_bytes, gs_shm_t **out) {
  *out = NULL;
  if (c->size < 2 || c->host_max != c->size || slot_bytes <= 0) return GS_SUCCESS;
  gs_shm_t *s = calloc(1, sizeof *s);
  if (!s) return gs_fail(GS_ERR_NO_MEMORY, "gs_comm_create: out of memory");
  s->rank = c->rank;
  s->size = c->size;
  char why[256] = "";
  int ok = 0;
  gs_status_t st = offer(c, slot_bytes, s, &ok, why, sizeof why);
  if (st == GS_SUCCESS && ok) st = watch_peers(c, s);
  if (st != GS_SUCCESS || !ok) {
    if (st == GS_SUCCESS)
      gs_log(GS_LOG_DEBUG,
             "shared region: %s; validation and small allreduces go through MPI "
             "on this communicator",
             why);
    gs_shm_close(s);
    return st;
  }
  *out = s;
  return GS_SUCCESS;
}

void gs_shm_close(gs_shm_t *s) {
  if (!s) return;
  if (s->base) munmap(s->base, s->total);
  for (int r = 0; s->pidfds && r < s->size; r++)
    if (s->pidfds[r] >= 0) close(s->pidfds[r]);
  free(s->pids);
  free(s->pidfds);
  free(s->slots);
  free(s->arrived);
  free(s);
}

size_t gs_shm_slot_bytes(const gs_shm_t *s) { return s->slot_bytes; }

void *gs_shm_mine(gs_shm_t *s) { return gs_shm_slot(s, s->rank, s->seq + 1); }
