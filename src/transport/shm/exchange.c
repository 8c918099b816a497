/* One exchange over the shared region: publish, then wait for every peer's
 * publication in the one wait loop (runtime/progress.c), watching the
 * processes still awaited: a peer that is gone (SIGKILL, a crash, the OOM
 * killer) ends the wait within milliseconds, not at the timeout. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>

#include "transport/shm/shm_region.h"

/* How often a waiting rank looks at the awaited peers' processes. */
#define WATCH_SECONDS 2e-3

typedef struct shm_wait {
  gs_shm_t *s;
  uint64_t k;    /* the exchange */
  int next;      /* ranks below it have published */
  unsigned polls;
  double watched; /* when the peers were last looked at */
  gs_shm_tick_fn tick;
  void *ctx;
  const char *what;
} shm_wait_t;

/* Whether rank r's process has ended (a zombie included: its pidfd is
 * readable from its exit on). */
static int gone(const gs_shm_t *s, int r) {
  if (s->pidfds[r] >= 0) {
    struct pollfd f = {s->pidfds[r], POLLIN, 0};
    return poll(&f, 1, 0) > 0 && (f.revents & (POLLIN | POLLHUP | POLLERR));
  }
  return kill((pid_t)s->pids[r], 0) != 0 && errno == ESRCH;
}

static int published(const gs_shm_t *s, int r, uint64_t k) {
  return __atomic_load_n(gs_shm_published(s, r), __ATOMIC_ACQUIRE) >= k;
}

/* The peers that are gone among those `awaited` (k: the exchange, 0: every
 * peer): GS_ERR_PEER_LOST naming them and the communicator marked unusable,
 * or GS_SUCCESS. */
static gs_status_t lost(const gs_shm_t *s, int from, uint64_t k, const char *what) {
  int ranks[64], n = 0, total = 0;
  for (int r = from; r < s->size; r++)
    if (r != s->rank && !(k && published(s, r, k)) && gone(s, r)) {
      if (n < 64) ranks[n++] = r;
      total++;
    }
  if (total == 0) return GS_SUCCESS;
  char names[256] = "";
  for (int j = 0, at = 0; j < n && at < (int)sizeof names - 16; j++)
    at += snprintf(names + at, sizeof names - (size_t)at, "%s%d (pid %lld)", j ? ", " : "",
                   ranks[j], (long long)s->pids[ranks[j]]);
  gs_runtime_mark_broken(GS_ERR_PEER_LOST);
  return gs_fail_lost(ranks, n,
                      "%s: rank%s %s%s of this host exited while this rank waited; the "
                      "communicator is no longer usable",
                      what, total > 1 ? "s" : "", names, total > n ? ", ..." : "");
}

static shm_identity_t *identity(const gs_shm_t *s) { return (shm_identity_t *)s->base; }

/* A peer gave up on the communicator before completing exchange k: its
 * status, the communicator marked unusable here too; GS_SUCCESS while none
 * has. A peer that completed exchange k before giving up (a device error in
 * the call it validated) took its part in it: the exchange stands, and this
 * rank meets its own fate in that call. */
static gs_status_t deserted(const gs_shm_t *s, uint64_t k, const char *what) {
  uint64_t a = __atomic_load_n(&identity(s)->abandoned, __ATOMIC_ACQUIRE);
  uint32_t after = (uint32_t)(a >> 32);
  if (a == 0 || (int32_t)((uint32_t)k - after) <= 0) return GS_SUCCESS; /* k <= after */
  gs_status_t why = (gs_status_t)((a >> 24) & 0xff);
  int who = (int)(a & 0xffffff) - 1;
  if (why == GS_ERR_PEER_LOST) { /* name the lost ranks, as the peer that saw it first did */
    gs_status_t e = lost(s, 0, 0, what);
    if (e != GS_SUCCESS) return e;
  }
  gs_runtime_mark_broken(why);
  if (who == s->rank) /* this rank's own earlier give-up, seen by another thread's wait */
    return gs_fail(why, "%s: this communicator was given up on this rank (%s)", what,
                   gs_status_string(why));
  return gs_fail(why,
                 "%s: rank %d gave up on this communicator (%s), so this rank stops "
                 "waiting; the communicator is no longer usable",
                 what, who, gs_status_string(why));
}

gs_status_t gs_shm_watch(void *ctx, const char *what) {
  const gs_shm_t *s = ctx;
  gs_status_t e = deserted(s, s->seq, what); /* the call this rank is in */
  return e != GS_SUCCESS ? e : lost(s, 0, 0, what);
}

void gs_shm_give_up(void *ctx, gs_status_t why) {
  gs_shm_t *s = ctx;
  uint64_t none = 0, mine = ((uint64_t)(uint32_t)s->done << 32) | ((uint64_t)(why & 0xff) << 24) |
                            (uint64_t)((s->rank + 1) & 0xffffff);
  __atomic_compare_exchange_n(&identity(s)->abandoned, &none, mine, 0, __ATOMIC_RELEASE,
                              __ATOMIC_RELAXED);
}

static int shm_poll(void *ctx, gs_status_t *err) {
  shm_wait_t *w = ctx;
  const gs_shm_t *s = w->s;
  while (w->next < s->size && published(s, w->next, w->k)) w->next++;
  /* a peer that gave up may have published first: its slot is no answer */
  if (__atomic_load_n(&identity(s)->abandoned, __ATOMIC_ACQUIRE)) {
    *err = deserted(s, w->k, w->what);
    if (*err != GS_SUCCESS) return -1;
  }
  if (w->next == s->size) return 1;
  if ((++w->polls & 63) != 0) return 0;
  double t = gs_now();
  if (t - w->watched < WATCH_SECONDS) return 0;
  w->watched = t;
  *err = lost(s, w->next, w->k, w->what);
  return *err == GS_SUCCESS ? 0 : -1;
}

static void shm_tick(void *ctx, double waited) {
  shm_wait_t *w = ctx;
  gs_shm_t *s = w->s;
  for (int r = 0; r < s->size; r++) s->arrived[r] = (unsigned char)published(s, r, w->k);
  w->tick(w->ctx, s->arrived, s->size, waited);
}

gs_status_t gs_shm_exchange(gs_shm_t *s, const char *what, gs_shm_tick_fn tick, void *ctx,
                            const void *const **slots) {
  uint64_t k = ++s->seq;
  __atomic_store_n(gs_shm_published(s, s->rank), k, __ATOMIC_RELEASE);
  shm_wait_t w = {s, k, 0, 0, gs_now(), tick, ctx, what};
  gs_wait_t wait = {shm_poll, NULL, tick ? shm_tick : NULL, NULL, &w, what};
  GS_CHECK(gs_progress_wait(&wait));
  s->done = k;
  for (int r = 0; r < s->size; r++) s->slots[r] = gs_shm_slot(s, r, k);
  *slots = s->slots;
  return GS_SUCCESS;
}
