/* Emulated CUDA: races judged by happens-before (see emu.h). Each
 * allocation keeps records of the accesses made to it by stream work: the
 * range, the operation (stream and sequence number) and whether it wrote.
 * An access conflicts with a record that overlaps it when either writes; it
 * must be ordered after every record it conflicts with, by its vector clock
 * (emu_streams.c). A stream-ordered free must be ordered after every record.
 * Records that a later access covers and is ordered after are dropped when
 * the later one writes, or when both read, so a buffer's records stay few. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"

#define MAX_RECORDS 4096 /* past this the oldest go: a missed race, never a false one */

typedef struct access {
  const char *lo, *hi;
  emu_point_t at;
  int write;
} access_t;

struct emu_accesses {
  access_t *v;
  int n, cap;
};

static int ordered(const emu_clock_t *c, emu_point_t p) {
  return p.stream < c->n && c->vc[p.stream] >= p.seq;
}

static const char *kind(int write) { return write ? "write" : "read"; }

static int report(const char *what, const char *lo, const char *hi, int write,
                  const emu_clock_t *c, const access_t *r) {
  fprintf(stderr,
          "emulated CUDA: %s: race on [%p, +%zu): this %s (stream %d, operation %llu) is not "
          "ordered after the %s of [%p, +%zu) by stream %d, operation %llu (no event wait, "
          "no stream order between them)\n",
          what, (const void *)lo, (size_t)(hi - lo), kind(write), c->self.stream,
          (unsigned long long)c->self.seq, kind(r->write), (const void *)r->lo,
          (size_t)(r->hi - r->lo), r->at.stream, (unsigned long long)r->at.seq);
  return -1;
}

static int add(emu_accesses_t **a, const char *lo, const char *hi, emu_point_t at, int write) {
  emu_accesses_t *x = *a;
  if (!x && !(x = *a = calloc(1, sizeof *x))) return 0;
  for (int k = 0; k < x->n; k++) { /* the same operation's adjacent ranges: one record */
    access_t *r = &x->v[k];
    if (r->at.stream == at.stream && r->at.seq == at.seq && r->write == write && lo <= r->hi &&
        hi >= r->lo) {
      r->lo = lo < r->lo ? lo : r->lo;
      r->hi = hi > r->hi ? hi : r->hi;
      return 0;
    }
  }
  if (x->n == MAX_RECORDS) memmove(x->v, x->v + 1, (size_t)--x->n * sizeof *x->v);
  if (x->n == x->cap) {
    int cap = x->cap ? 2 * x->cap : 8;
    access_t *v = realloc(x->v, (size_t)cap * sizeof *v);
    if (!v) return 0;
    x->v = v;
    x->cap = cap;
  }
  x->v[x->n++] = (access_t){lo, hi, at, write};
  return 0;
}

int emu_races_access(emu_accesses_t **a, const char *lo, const char *hi, int write,
                     const char *what) {
  emu_clock_t c;
  if (hi <= lo || !emu_running_clock(&c)) return 0;
  emu_accesses_t *x = *a;
  for (int i = 0; x && i < x->n; i++) {
    const access_t *r = &x->v[i];
    if (r->lo < hi && lo < r->hi && (write || r->write) && !ordered(&c, r->at))
      return report(what, lo, hi, write, &c, r);
  }
  int k = 0;
  for (int i = 0; x && i < x->n; i++) {
    access_t r = x->v[i];
    int covered = lo <= r.lo && r.hi <= hi && ordered(&c, r.at);
    if (!(covered && (write || !r.write))) x->v[k++] = r;
  }
  if (x) x->n = k;
  return add(a, lo, hi, c.self, write);
}

void emu_races_born(emu_accesses_t **a, const char *lo, const char *hi, emu_point_t at) {
  add(a, lo, hi, at, 1);
}

int emu_races_free(emu_accesses_t **a, const void *base, const char *what) {
  emu_clock_t c;
  emu_accesses_t *x = *a;
  if (!x || !emu_running_clock(&c)) return 0;
  for (int i = 0; i < x->n; i++)
    if (!ordered(&c, x->v[i].at)) {
      fprintf(stderr,
              "emulated CUDA: %s of %p (stream %d, operation %llu) is not ordered after the "
              "%s of [%p, +%zu) by stream %d, operation %llu: a use after free\n",
              what, base, c.self.stream, (unsigned long long)c.self.seq, kind(x->v[i].write),
              (const void *)x->v[i].lo, (size_t)(x->v[i].hi - x->v[i].lo), x->v[i].at.stream,
              (unsigned long long)x->v[i].at.seq);
      return -1;
    }
  return 0;
}

void emu_races_drop(emu_accesses_t **a) {
  if (*a) free((*a)->v);
  free(*a);
  *a = NULL;
}
