/* A build without CUDA: the internal device entry points exist so the
 * library links whole (--no-undefined), and say so if ever reached. No
 * tensor gets to them: gs_check_tensors refuses CUDA memory first. */
#include "device/gs_cuda.h"

#ifndef GS_HAVE_CUDA
static gs_status_t absent(const char *what) {
  return gs_fail(GS_ERR_UNSUPPORTED,
                 "%s: this gradsync was built without CUDA (rebuild with "
                 "nvcc on PATH and GRADSYNC_CUDA unset)",
                 what);
}

gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device) {
  (void)ptr;
  gs_clear_error();
  if (!device) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_pointer_device: device is NULL");
  device->kind = GS_DEVICE_CPU;
  device->id = 0;
  return GS_SUCCESS;
}
gs_status_t gs_cu_fail(int code, const char *what) {
  (void)code;
  return absent(what);
}
gs_status_t gs_cu_enter(int device, gs_cu_scope_t *scope) {
  scope->device = device;
  scope->pushed = 0;
  return absent("gradsync");
}
void gs_cu_leave(gs_cu_scope_t *scope) { (void)scope; }
gs_status_t gs_cu_enter_existing(gs_cu_scope_t *scope, int *none) {
  scope->device = -1;
  scope->pushed = 0;
  *none = 1;
  return absent("gradsync");
}
gs_status_t gs_cu_memory_stream(int device, void **stream) {
  (void)device;
  *stream = NULL;
  return absent("gradsync: CUDA stream");
}
gs_status_t gs_cu_stream_key(void *stream, unsigned long long *key) {
  (void)stream;
  *key = 0;
  return absent("gradsync: CUDA stream");
}
gs_status_t gs_cu_stream_create(void **stream, const char *what) {
  *stream = NULL;
  return absent(what);
}
void gs_cu_stream_destroy(void *stream) { (void)stream; }
gs_status_t gs_cu_follow_entry(int device, void *stream) {
  (void)device;
  (void)stream;
  return absent("gradsync: CUDA stream");
}
void *gs_cu_work_stream(void) { return NULL; }
void *gs_cu_as_stream(uintptr_t stream) {
  (void)stream;
  return NULL;
}
gs_status_t gs_cu_order(void *w, void *p, const char *what) {
  (void)w;
  (void)p;
  return absent(what);
}
gs_status_t gs_cu_record(void *s, void **e, const char *what) {
  (void)s;
  *e = NULL;
  return absent(what);
}
void gs_cu_event_free(void *event) { (void)event; }
int gs_cu_event_poll(void *event, const char *what) {
  (void)event;
  absent(what);
  return -1;
}
gs_status_t gs_cu_event_wait(void *event, const char *what) {
  (void)event;
  return absent(what);
}
gs_status_t gs_cu_stream_wait(void *stream, const char *what) {
  (void)stream;
  return absent(what);
}
gs_status_t gs_cu_stream_wait_event(void *stream, void *event, const char *what) {
  (void)stream;
  (void)event;
  return absent(what);
}
gs_status_t gs_cu_malloc_async(void **p, size_t b, void *s, const char *what) {
  (void)b;
  (void)s;
  *p = NULL;
  return absent(what);
}
void gs_cu_free_async(void *p, void *s) {
  (void)p;
  (void)s;
}
gs_status_t gs_cu_grow(void **b, size_t *h, size_t n, void *s) {
  (void)b;
  (void)h;
  (void)n;
  (void)s;
  return absent("gradsync: device buffer");
}
gs_status_t gs_cu_grow_pinned(void **b, size_t *h, size_t n, void *s) {
  (void)b;
  (void)h;
  (void)n;
  (void)s;
  return absent("gradsync: pinned buffer");
}
void gs_cu_release(void *buf) { (void)buf; }
gs_status_t gs_cu_copy(void *d, const void *s, size_t b, void *st) {
  (void)d;
  (void)s;
  (void)b;
  (void)st;
  return absent("gradsync: device copy");
}
gs_status_t gs_cu_elementwise(gs_cu_mode_t m, const gs_cu_run_t *r, int64_t n, double sc, void *s) {
  (void)m;
  (void)r;
  (void)n;
  (void)sc;
  (void)s;
  return absent("gradsync: CUDA kernel");
}
gs_status_t gs_cu_wire_pass(gs_cu_wire_pass_t p, gs_cu_wire_job_t j, const void *src, void *dst,
                            void *s) {
  (void)p;
  (void)j;
  (void)src;
  (void)dst;
  (void)s;
  return absent("gradsync: CUDA kernel");
}
gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad, void *s) {
  (void)t;
  (void)n;
  (void)s;
  *bad = 0;
  return absent("gradsync: CUDA kernel");
}
gs_status_t gs_cu_adasum_dots(gs_dtype_t dt, const void *a, const void *b, const int64_t *st,
                              const int64_t *c, int64_t n, double *d, void *s) {
  (void)dt;
  (void)a;
  (void)b;
  (void)st;
  (void)c;
  (void)n;
  (void)d;
  (void)s;
  return absent("gradsync: CUDA kernel");
}
gs_status_t gs_cu_adasum_combine(gs_dtype_t dt, const void *a, const void *b, void *o,
                                 const int64_t *st, const int64_t *c, const double *co, int64_t n,
                                 void *s) {
  (void)dt;
  (void)a;
  (void)b;
  (void)o;
  (void)st;
  (void)c;
  (void)co;
  (void)n;
  (void)s;
  return absent("gradsync: CUDA kernel");
}
int gs_cu_launch_order_keys(int dt, int mx, int inv, const void *src, void *dst, int64_t n,
                            void *s) {
  (void)dt;
  (void)mx;
  (void)inv;
  (void)src;
  (void)dst;
  (void)n;
  (void)s;
  return 35; /* cudaErrorInsufficientDriver: there is no CUDA here */
}
#endif
