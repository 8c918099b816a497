#define _GNU_SOURCE /* pipe2 */
/* The flight recorder's dump (gs_flight.h): JSON lines, one file per rank,
 * written to a temporary name and renamed, so a reader never sees half a
 * dump; and the SIGUSR1 watcher, whose handler only writes a byte to a pipe
 * (async-signal-safe) for a thread of its own to dump from, so a rank hung
 * in C or in user code is still dumped and the job goes on. */
#include <errno.h>
#include <fcntl.h>
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/gs_flight_ring.h"

static char flight_dir[1024], flight_file[1100];

/* The directory every rank of the job names alike (GRADSYNC_FLIGHT_DIR, or
 * one under TMPDIR named for the job), made on the first dump. */
static void name_dir(void) {
  if (flight_dir[0]) return;
  const char *d = gs_env_flight_dir();
  char key[64];
  if (d) snprintf(flight_dir, sizeof flight_dir, "%s", d);
  else
    snprintf(flight_dir, sizeof flight_dir, "%s/gradsync-flight-%s", gs_env_tmpdir(),
             gs_env_job_key(key, sizeof key));
}

static int world_rank(void) {
  if (atomic_load(&gs_flight.ncomms) > 0) return gs_flight.world_rank;
  int init = 0, fin = 0, rank = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

gs_status_t gs_flight_set_dir(const char *dir) {
  if (!dir || !*dir) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_flight_set_dir: dir is empty");
  if (strlen(dir) >= sizeof flight_dir - 32)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_flight_set_dir: dir is too long");
  pthread_mutex_lock(&gs_flight.lock);
  snprintf(flight_dir, sizeof flight_dir, "%s", dir);
  pthread_mutex_unlock(&gs_flight.lock);
  return GS_SUCCESS;
}

const char *gs_flight_dir(void) {
  if (!gs_flight_capacity()) return "";
  pthread_mutex_lock(&gs_flight.lock);
  name_dir();
  pthread_mutex_unlock(&gs_flight.lock);
  return flight_dir;
}

const char *gs_flight_file(void) {
  if (!*gs_flight_dir()) return ""; /* off; else the directory is named */
  pthread_mutex_lock(&gs_flight.lock);
  snprintf(flight_file, sizeof flight_file, "%s/rank-%d.jsonl", flight_dir, world_rank());
  pthread_mutex_unlock(&gs_flight.lock);
  return flight_file;
}

/* mkdir -p, each level once; an existing directory is fine. */
static int make_dirs(const char *path) {
  char p[1024];
  snprintf(p, sizeof p, "%s", path);
  for (char *s = p + 1;; s++) {
    char c = *s;
    if (c != '/' && c != '\0') continue;
    *s = '\0';
    if (mkdir(p, 0777) != 0 && errno != EEXIST) return -1;
    if (c == '\0') return 0;
    *s = c;
  }
}

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; s && *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
    else if (ch == '\n') fputs("\\n", f);
    else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
    else fputc(ch, f);
  }
  fputc('"', f);
}

static const char *status_name(int32_t s) {
  static const char *const names[] = {
      "ok",       "invalid_argument", "type", "mismatch", "mpi",     "no_memory",   "unsupported",
      "internal", "closed",           "cuda", "nccl",     "timeout", "interrupted", "peer_lost"};
  if (s < 0) return "in_flight";
  return (size_t)s < sizeof names / sizeof names[0] ? names[s] : "unknown";
}

static void write_header(FILE *f, const char *reason, int rank) {
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  int size = gs_flight.world_size;
  struct timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  fprintf(f, "{\"v\":%d,\"type\":\"header\",\"format\":\"gradsync-flight\",\"rank\":%d,",
          GS_FLIGHT_FORMAT, rank);
  fprintf(f, "\"world_size\":%d,\"pid\":%ld,\"host\":", size, (long)getpid());
  json_string(f, host);
  fputs(",\"reason\":", f);
  json_string(f, reason);
  fprintf(f, ",\"clock\":%.6f,\"wall\":%.6f,\"capacity\":%lld,\"recorded\":%llu,\"stacks\":%d}\n",
          gs_now(), (double)wall.tv_sec + 1e-9 * (double)wall.tv_nsec, (long long)gs_flight.cap,
          (unsigned long long)gs_flight_recorded(), gs_flight.stacks);
}

static void write_tables(FILE *f) {
  int32_t nc = atomic_load(&gs_flight.ncomms), ns = atomic_load(&gs_flight.nsites);
  for (int32_t k = 0; k < nc; k++) {
    const gs_flight_comm_t *c = &gs_flight.comms[k];
    fprintf(f, "{\"v\":%d,\"type\":\"comm\",\"comm\":%d,\"uid\":\"%016llx.%d\",\"size\":%d,",
            GS_FLIGHT_FORMAT, k, (unsigned long long)c->hash, c->ordinal, c->size);
    fprintf(f, "\"rank\":%d,\"last_seq\":%llu,\"freed\":%s,\"ranks\":[", c->rank,
            (unsigned long long)c->last_seq, c->freed ? "true" : "false");
    int m = c->size < GS_FLIGHT_MEMBERS ? c->size : GS_FLIGHT_MEMBERS;
    for (int r = 0; r < m; r++) fprintf(f, "%s%d", r ? "," : "", c->members[r]);
    fprintf(f, "]}\n");
  }
  for (int32_t k = 0; k < ns; k++) {
    fprintf(f, "{\"v\":%d,\"type\":\"site\",\"site\":%d,\"stack\":", GS_FLIGHT_FORMAT, k);
    json_string(f, gs_flight.sites[k]);
    fputs("}\n", f);
  }
}

static void write_entry(FILE *f, const gs_flight_entry_t *e) {
  fprintf(f, "{\"v\":%d,\"type\":\"call\",\"id\":%llu,\"comm\":%d,\"seq\":%llu,\"op\":\"%s\",",
          GS_FLIGHT_FORMAT, (unsigned long long)e->id, e->comm, (unsigned long long)e->seq, e->op);
  fprintf(f, "\"p2p\":%s,\"dtype\":\"%s\",\"count\":%lld,\"n\":%lld,\"bytes\":%lld,",
          e->p2p ? "true" : "false", e->dtype < 0 ? "" : gs_dtype_name((gs_dtype_t)e->dtype),
          (long long)e->count, (long long)e->n, (long long)e->bytes);
  fprintf(f, "\"redop\":\"%s\",\"root\":%d,\"path\":\"%s\",\"status\":\"%s\",",
          gs_op_name((gs_op_t)e->redop), e->root, e->path ? e->path : "", status_name(e->status));
  fprintf(f, "\"t_enter\":%.6f,\"t_valid\":%.6f,\"t_sent\":%.6f,\"t_done\":%.6f,", e->t_enter,
          e->t_valid, e->t_sent, e->t_done);
  fprintf(f, "\"thread\":%llu,\"site\":%d,\"tag\":%d}\n", (unsigned long long)e->thread, e->site,
          e->tag);
}

/* Writes the whole dump under the lock (one dump at a time). */
static gs_status_t dump_locked(const char *reason) {
  int rank = world_rank();
  name_dir();
  snprintf(flight_file, sizeof flight_file, "%s/rank-%d.jsonl", flight_dir, rank);
  if (make_dirs(flight_dir) != 0)
    return gs_fail(GS_ERR_INTERNAL, "gs_flight_dump: cannot make %s: %s", flight_dir,
                   strerror(errno));
  char tmp[1200];
  snprintf(tmp, sizeof tmp, "%s.%ld.tmp", flight_file, (long)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f)
    return gs_fail(GS_ERR_INTERNAL, "gs_flight_dump: cannot write %s: %s", tmp, strerror(errno));
  write_header(f, reason, rank);
  write_tables(f);
  gs_flight_entry_t e;
  uint64_t end = atomic_load(&gs_flight.next), n = (uint64_t)gs_flight.cap;
  for (uint64_t k = end > n ? end - n : 0; k < end; k++) {
    gs_flight_slot_t *s = &gs_flight.ring[k % n];
    if (atomic_load_explicit(&s->id, memory_order_acquire) != k + 1) continue;
    e = s->e;
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&s->id, memory_order_relaxed) == k + 1) write_entry(f, &e);
  }
  int bad = ferror(f);
  if (fclose(f) != 0 || bad || rename(tmp, flight_file) != 0) {
    unlink(tmp);
    return gs_fail(GS_ERR_INTERNAL, "gs_flight_dump: cannot write %s", flight_file);
  }
  return GS_SUCCESS;
}

gs_status_t gs_flight_dump(const char *reason) {
  if (!gs_flight_capacity())
    return gs_fail(GS_ERR_UNSUPPORTED,
                   "gs_flight_dump: the recorder is off (GRADSYNC_FLIGHT_ENTRIES=0)");
  pthread_mutex_lock(&gs_flight.lock);
  gs_status_t s = dump_locked(reason ? reason : "on demand");
  pthread_mutex_unlock(&gs_flight.lock);
  return s;
}

void gs_flight_dump_failure(gs_status_t status) {
  if (!gs_flight.cap) return;
  char why[GS_ERROR_MAX], reason[GS_ERROR_MAX + 32];
  snprintf(why, sizeof why, "%s", gs_last_error());
  if (strstr(why, "flight record:")) return; /* an inner call dumped already */
  snprintf(reason, sizeof reason, "%s: %s", status_name(status), why);
  if (gs_flight_dump(reason) != GS_SUCCESS) {
    gs_log(GS_LOG_WARNING, "%s", gs_last_error());
    gs_fail(status, "%s", why);
    return;
  }
  gs_fail(status, "%s; flight record: %s (python -m gradsync.doctor %s)", why, flight_file,
          flight_dir);
}

void gs_flight_end(uint64_t id, gs_status_t status) {
  if (!id) return; /* not recorded: the recorder is off, or the call never began */
  gs_flight_entry_t *e = gs_flight_live(id);
  if (e) {
    e->t_done = gs_now();
    if (e->path == gs_flight_shortcut) e->t_valid = e->t_sent = e->t_done;
    e->status = (int32_t)status;
  }
  /* the failures that leave other ranks waiting or say the ranks diverged */
  if (status == GS_ERR_TIMEOUT || status == GS_ERR_MISMATCH || status == GS_ERR_INTERRUPTED ||
      status == GS_ERR_MPI || status == GS_ERR_NCCL || status == GS_ERR_PEER_LOST)
    gs_flight_dump_failure(status);
}

/* ---- SIGUSR1 ------------------------------------------------------------ */

static int wake_fd[2] = {-1, -1};
/* The handler SIGUSR1 had before ours: called after ours, so a program's or
 * framework's own use of the signal (Lightning's Slurm requeue) goes on. */
static struct sigaction previous;

static void on_usr1(int sig, siginfo_t *info, void *context) {
  int saved = errno;
  char b = 1;
  if (write(wake_fd[1], &b, 1) < 0) { /* a full pipe already has a dump coming */
  }
  if (previous.sa_flags & SA_SIGINFO) {
    if (previous.sa_sigaction) previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig); /* SIG_DFL would end the process: ours replaces that */
  }
  errno = saved;
}

static void *watcher(void *arg) {
  (void)arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL); /* the job's signals go to its own threads */
  char b;
  for (;;) {
    ssize_t got = read(wake_fd[0], &b, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return NULL;
    if (gs_flight_dump("SIGUSR1") == GS_SUCCESS)
      gs_log(GS_LOG_WARNING, "flight record written to %s (SIGUSR1)", flight_file);
  }
}

gs_status_t gs_flight_on_signal(void) {
  static pthread_mutex_t once = PTHREAD_MUTEX_INITIALIZER;
  static int installed;
  gs_status_t s = GS_SUCCESS;
  pthread_mutex_lock(&once);
  if (!installed && gs_flight_capacity()) {
    pthread_t t;
    if (pipe2(wake_fd, O_CLOEXEC | O_NONBLOCK) != 0) {
      s = gs_fail(GS_ERR_INTERNAL, "gs_flight_on_signal: pipe: %s", strerror(errno));
    } else {
      fcntl(wake_fd[0], F_SETFL, 0); /* the watcher blocks; the handler never does */
      if (pthread_create(&t, NULL, watcher, NULL) != 0) {
        s = gs_fail(GS_ERR_INTERNAL, "gs_flight_on_signal: no watcher thread");
      } else {
        pthread_detach(t);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_usr1;
        sa.sa_flags = SA_RESTART | SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGUSR1, &sa, &previous);
        installed = 1;
      }
    }
  }
  pthread_mutex_unlock(&once);
  return s;
}
