/* The pages a peer copy pins: tensors that persist from call to call are
 * gathered into 2 MiB pages (docs/DESIGN.md section 15, docs/decisions/transport.md).
 *
 * process_vm_readv and process_vm_writev pin every page of the peer's
 * memory they copy, one page table walk, reference count and unpin per
 * page: on 4 KiB pages that is about a quarter of the allreduce's time
 * inside one host (ResNet-50's gradients as separately allocated arrays:
 * 10.8 ms, against 8.2 ms for the same bytes in one array, which NumPy
 * asks the kernel to back with 2 MiB pages; a 2 MiB page is pinned once).
 * Frameworks allocate most gradients below NumPy's 4 MiB hugepage
 * threshold, on the heap, so most of them sit on 4 KiB pages.
 *
 * So each rank asks its own kernel to gather (MADV_COLLAPSE, Linux 6.1)
 * the 2 MiB blocks that lie wholly inside its tensors' memory, once, on a
 * block's second call: a gradient list reused every step pays the copy
 * (about 0.5 ms per MiB) once, memory allocated afresh per call never.
 * Only blocks every page of which holds some tensor's bytes are gathered
 * (tensors with no whole page between them are one span), so no memory
 * the process had not touched becomes resident. The contents and
 * addresses do not change. A block straddling two mappings is marked
 * MADV_HUGEPAGE first, where the program has not said otherwise. A
 * refusal (an old kernel, pinned or file-backed memory, MADV_NOHUGEPAGE,
 * no free 2 MiB page) only leaves the block as it was, and it is not asked
 * again. GRADSYNC_CMA_HUGEPAGES=0 turns it all off. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "transport/mpi/gs_mpi_transport.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux's value; older headers lack the name */
#endif

#define HUGE_BYTES ((uintptr_t)2 << 20)
#define PAGE_BYTES ((uintptr_t)4096)

typedef struct span {
  uintptr_t lo, hi;
} span_t;

static int by_start(const void *a, const void *b) {
  uintptr_t x = ((const span_t *)a)->lo, y = ((const span_t *)b)->lo;
  return x < y ? -1 : x > y;
}

/* The segments' memory as sorted, disjoint spans; two are one unless a
 * whole page lies between them, so every page of a span holds some
 * segment's bytes. (Tensors malloc maps one by one lie a page's length
 * apart: the rest of one's last page and the next mapping's 16-byte
 * header; no whole page between them.) */
static int64_t spans_of(const gs_seg_t *segs, int64_t nseg, size_t es, span_t *v) {
  int64_t n = 0;
  for (int64_t s = 0; s < nseg; s++) {
    if (segs[s].count <= 0) continue;
    uintptr_t lo = (uintptr_t)segs[s].at;
    v[n++] = (span_t){lo, lo + (uintptr_t)segs[s].count * es};
  }
  qsort(v, (size_t)n, sizeof *v, by_start);
  int64_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    if (m > 0 && v[i].lo < ((v[m - 1].hi + PAGE_BYTES - 1) & ~(PAGE_BYTES - 1)) + PAGE_BYTES) {
      if (v[i].hi > v[m - 1].hi) v[m - 1].hi = v[i].hi;
    } else {
      v[m++] = v[i];
    }
  }
  return m;
}

/* The 2 MiB blocks wholly inside the spans, ascending. */
static int64_t blocks_of(const span_t *v, int64_t n, uintptr_t *b, int64_t cap) {
  int64_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    uintptr_t first = (v[i].lo + HUGE_BYTES - 1) & ~(HUGE_BYTES - 1);
    for (uintptr_t at = first; at + HUGE_BYTES <= v[i].hi && m < cap; at += HUGE_BYTES) b[m++] = at;
  }
  return m;
}

/* Whether each of blocks b[0..n) (ascending) lies in memory that may be
 * marked MADV_HUGEPAGE: covered wholly by anonymous private mappings the
 * program did not mark MADV_NOHUGEPAGE ("nh" in /proc/self/smaps'
 * VmFlags). ok[i] = 1 where so; 0 where anything else is seen or nothing
 * is known (smaps unreadable, a hole). */
static void markable(const uintptr_t *b, int64_t n, unsigned char *ok) {
  memset(ok, 0, (size_t)n);
  uintptr_t *covered = calloc((size_t)n, sizeof *covered);
  unsigned char *refused = calloc((size_t)n, 1);
  FILE *f = covered && refused ? fopen("/proc/self/smaps", "r") : NULL;
  char *line = NULL;
  size_t len = 0;
  uintptr_t lo = 0, hi = 0;
  int plain = 0;
  int64_t first = 0;
  while (f && getline(&line, &len, f) > 0 && first < n) {
    unsigned long a, z;
    char perms[8] = "";
    int at = 0;
    if (sscanf(line, "%lx-%lx %7s %*x %*x:%*x %*u %n", &a, &z, perms, &at) == 3 && at > 0) {
      const char *path = line + at;
      lo = a, hi = z;
      plain =
          !strcmp(perms, "rw-p") && (!path[0] || path[0] == '\n' || !strncmp(path, "[heap]", 6));
    } else if (!strncmp(line, "VmFlags:", 8)) {
      int bad = !plain || strstr(line, " nh") != NULL;
      for (int64_t i = first; i < n && b[i] < hi; i++) {
        uintptr_t from = b[i] > lo ? b[i] : lo,
                  to = b[i] + HUGE_BYTES < hi ? b[i] + HUGE_BYTES : hi;
        if (to <= from) continue;
        covered[i] += to - from;
        refused[i] |= (unsigned char)bad;
      }
      while (first < n && b[first] + HUGE_BYTES <= hi) first++;
    }
  }
  for (int64_t i = 0; f && i < n; i++) ok[i] = !refused[i] && covered[i] == HUGE_BYTES;
  free(line);
  if (f) fclose(f);
  free(covered);
  free(refused);
}

/* Asks for blocks b[0..n) (ascending) to be gathered, one call each: a
 * refused block stops a call there, so a run of blocks in one call would
 * lose the rest. A block straddling two mappings is refused (EINVAL): NumPy
 * marks a large array's memory MADV_HUGEPAGE, which splits it from its
 * neighbours' mapping at a page boundary inside a block. Marking the block
 * too makes the mappings one (unless the program marked it
 * MADV_NOHUGEPAGE: markable), and the block is asked again. Returns the
 * bytes gathered or found so. */
static int64_t gather(uintptr_t *b, int64_t n) {
  int64_t done = 0, nagain = 0;
  for (int64_t i = 0; i < n; i++) {
    if (madvise((void *)b[i], HUGE_BYTES, MADV_COLLAPSE) == 0) done += (int64_t)HUGE_BYTES;
    else if (errno == EINVAL) b[nagain++] = b[i]; /* in place: nagain <= i */
  }
  unsigned char *ok = nagain ? malloc((size_t)nagain) : NULL;
  if (!ok) return done;
  markable(b, nagain, ok);
  for (int64_t i = 0; i < nagain; i++)
    if (ok[i] && madvise((void *)b[i], HUGE_BYTES, MADV_HUGEPAGE) == 0 &&
        madvise((void *)b[i], HUGE_BYTES, MADV_COLLAPSE) == 0)
      done += (int64_t)HUGE_BYTES;
  free(ok);
  return done;
}

/* The blocks seen so far (ascending, with whether they were asked for),
 * remembered up to this many (256 GiB): memory allocated afresh at every
 * call would otherwise grow the set without end. */
#define SEEN_MAX ((int64_t)1 << 17)

/* Whether the kernel gathers on request, once per group: Linux 6.1's
 * MADV_COLLAPSE (an older kernel rejects the advice even for no bytes),
 * 4 KiB pages and 2 MiB huge ones (the sizes assumed here), and huge pages
 * not turned off by the administrator ("[never]") or for this process
 * (PR_SET_THP_DISABLE). */
static int collapse_supported(void) {
  static char page[1] __attribute__((aligned(4096)));
  char mode[128] = "", pmd[32] = "";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (f) {
    if (!fgets(mode, sizeof mode, f)) mode[0] = 0;
    fclose(f);
  }
  f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
  if (f) {
    if (!fgets(pmd, sizeof pmd, f)) pmd[0] = 0;
    fclose(f);
  }
  return sysconf(_SC_PAGESIZE) == (long)PAGE_BYTES && strtoull(pmd, NULL, 10) == HUGE_BYTES &&
         !strstr(mode, "[never]") && prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0 &&
         madvise(page, 0, MADV_COLLAPSE) == 0;
}

void gs_cma_settle_pages(gs_comm_t c, gs_cma_group_t *g, const gs_seg_t *segs, int64_t nseg,
                         size_t es) {
  if (!gs_mpi_state(c)->cma_hugepages || nseg <= 0) return;
  if (!g->collapse) g->collapse = collapse_supported() ? 1 : -1;
  if (g->collapse < 0) return;
  span_t *v = malloc((size_t)nseg * sizeof *v);
  if (!v) return; /* only a speed-up: without memory, skip it */
  int64_t nspan = spans_of(segs, nseg, es, v), cap = 0;
  for (int64_t i = 0; i < nspan; i++) cap += (int64_t)((v[i].hi - v[i].lo) / HUGE_BYTES);
  if (!cap) { /* no whole block: nothing to remember or ask */
    free(v);
    return;
  }
  int64_t room = cap + g->nblocks;
  uintptr_t *now = malloc((size_t)(cap + 1) * sizeof *now);
  uintptr_t *seen = malloc((size_t)(room + 1) * sizeof *seen);
  unsigned char *asked = malloc((size_t)room + 1);
  if (!now || !seen || !asked) {
    free(now), free(seen), free(asked), free(v);
    return;
  }
  int64_t n = blocks_of(v, nspan, now, cap), m = 0, ndue = 0;
  /* merge this call's blocks into the seen ones: a block seen before and
   * not asked yet is due now (gathered in place in `now`) */
  for (int64_t i = 0, j = 0; i < n || j < g->nblocks;) {
    if (j < g->nblocks && (i == n || g->blocks[j] < now[i])) {
      seen[m] = g->blocks[j], asked[m++] = g->asked[j++];
    } else if (j < g->nblocks && g->blocks[j] == now[i]) {
      if (!g->asked[j]) now[ndue++] = now[i];
      seen[m] = now[i++], asked[m++] = 1, j++;
    } else {
      seen[m] = now[i++], asked[m++] = 0;
    }
  }
  c->stats.hugepage_bytes += (uint64_t)gather(now, ndue);
  if (m > SEEN_MAX) { /* memory new at every call: remember this call's blocks, never to ask */
    m = blocks_of(v, nspan, seen, cap);
    memset(asked, 1, (size_t)m);
  }
  free(g->blocks);
  free(g->asked);
  g->blocks = seen;
  g->asked = asked;
  g->nblocks = m;
  free(now);
  free(v);
}
