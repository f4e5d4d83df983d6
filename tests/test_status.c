/* Status names, version, dtypes, contexts and the thread-local last error. */
#include "harness.h"
#include "moelink.h"

#include <pthread.h>

static const struct {
  moelink_status_t s;
  const char *name;
} statuses[] = {
    {MOELINK_SUCCESS, "MOELINK_SUCCESS"},
    {MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_ERR_INVALID_ARGUMENT"},
    {MOELINK_ERR_DTYPE_MISMATCH, "MOELINK_ERR_DTYPE_MISMATCH"},
    {MOELINK_ERR_NOT_FOUND, "MOELINK_ERR_NOT_FOUND"},
    {MOELINK_ERR_INVALID_STATE, "MOELINK_ERR_INVALID_STATE"},
    {MOELINK_ERR_UNSUPPORTED, "MOELINK_ERR_UNSUPPORTED"},
    {MOELINK_ERR_OUT_OF_MEMORY, "MOELINK_ERR_OUT_OF_MEMORY"},
    {MOELINK_ERR_CUDA, "MOELINK_ERR_CUDA"},
    {MOELINK_ERR_NCCL, "MOELINK_ERR_NCCL"},
    {MOELINK_ERR_TIMEOUT, "MOELINK_ERR_TIMEOUT"},
    {MOELINK_ERR_INTERNAL, "MOELINK_ERR_INTERNAL"},
};
#define NSTATUS ((int)(sizeof statuses / sizeof statuses[0]))

static void test_status_strings(void) {
  for (int i = 0; i < NSTATUS; ++i) {
    const char *s = moelink_status_string(statuses[i].s);
    CHECK(s && strcmp(s, statuses[i].name) == 0, "status %d is named %s (got %s)",
          (int)statuses[i].s, statuses[i].name, s ? s : "(null)");
    CHECK((int)statuses[i].s == i, "status %s has value %d", statuses[i].name, i);
  }
  const char *u = moelink_status_string((moelink_status_t)97);
  CHECK(u != NULL && u[0] != 0, "unknown status has a non-empty name (%s)", u ? u : "(null)");
  int distinct = 1;
  for (int i = 0; i < NSTATUS; ++i)
    if (u && strcmp(u, statuses[i].name) == 0) distinct = 0;
  CHECK(distinct, "unknown status is not named like a known one");
  const char *neg = moelink_status_string((moelink_status_t)-1);
  CHECK(neg != NULL, "negative status value still gives a name");
}

static void test_version(void) {
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", MOELINK_VERSION_MAJOR, MOELINK_VERSION_MINOR,
           MOELINK_VERSION_PATCH);
  const char *v = moelink_version();
  CHECK(v && strcmp(v, want) == 0, "moelink_version() '%s' matches the header's %s",
        v ? v : "(null)", want);
  CHECK(moelink_version_code() == MOELINK_VERSION_CODE,
        "moelink_version_code() %d == MOELINK_VERSION_CODE %d", moelink_version_code(),
        MOELINK_VERSION_CODE);
  CHECK(MOELINK_VERSION_CODE ==
            MOELINK_VERSION_MAJOR * 10000 + MOELINK_VERSION_MINOR * 100 + MOELINK_VERSION_PATCH,
        "version code is major*10000 + minor*100 + patch");
  CHECK(MOELINK_VERSION_MINOR < 100 && MOELINK_VERSION_PATCH < 100,
        "minor and patch fit their two digits of the code");
}

static void test_dtypes(void) {
  static const struct {
    moelink_dtype_t d;
    size_t size;
    const char *name;
  } dts[] = {{MOELINK_DTYPE_F32, 4, "f32"},
             {MOELINK_DTYPE_BF16, 2, "bf16"},
             {MOELINK_DTYPE_F16, 2, "f16"},
             {MOELINK_DTYPE_FP8_E4M3, 1, "fp8_e4m3"}};
  for (size_t i = 0; i < sizeof dts / sizeof dts[0]; ++i) {
    CHECK(moelink_dtype_size(dts[i].d) == dts[i].size, "dtype %s has %zu bytes (got %zu)",
          dts[i].name, dts[i].size, moelink_dtype_size(dts[i].d));
    const char *n = moelink_dtype_name(dts[i].d);
    CHECK(n && strcmp(n, dts[i].name) == 0, "dtype %d is named %s (got %s)", (int)dts[i].d,
          dts[i].name, n ? n : "(null)");
  }
  CHECK(moelink_dtype_size((moelink_dtype_t)42) == 0, "unknown dtype has size 0");
  const char *n = moelink_dtype_name((moelink_dtype_t)42);
  CHECK(n && strcmp(n, "unknown") == 0, "unknown dtype is named 'unknown' (got %s)",
        n ? n : "(null)");
}

static void test_contexts(void) {
  CHECK(moelink_backend_available(MOELINK_BACKEND_CPU) == 1, "CPU backend is available");
  int cuda = moelink_backend_available(MOELINK_BACKEND_CUDA);
  CHECK(cuda == 0 || cuda == 1, "backend_available(CUDA) answers 0 or 1 (%d)", cuda);
  CHECK(moelink_backend_available((moelink_backend_t)9) == 0, "unknown backend is not available");

  moelink_context_t ctx = NULL;
  CHECK_OK(moelink_context_create(NULL, &ctx), "context_create(NULL cfg) gives a CPU context");
  CHECK(ctx != NULL, "context handle is set");
  CHECK(moelink_context_backend(ctx) == MOELINK_BACKEND_CPU, "default context runs on the CPU");
  CHECK_OK(moelink_context_destroy(ctx), "context_destroy");

  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = 1;
  ctx = NULL;
  CHECK_OK(moelink_context_create(&cc, &ctx), "context_create with 1 thread");
  CHECK(moelink_context_backend(ctx) == MOELINK_BACKEND_CPU, "explicit CPU context");
  CHECK_OK(moelink_context_destroy(ctx), "context_destroy (1 thread)");

  CHECK(moelink_context_backend(NULL) == MOELINK_BACKEND_CPU, "context_backend(NULL) is CPU");
  CHECK(moelink_context_destroy(NULL) == MOELINK_SUCCESS, "context_destroy(NULL) is a no-op");
  CHECK(moelink_moe_destroy(NULL) == MOELINK_SUCCESS, "moe_destroy(NULL) is a no-op");
}

/* ---- thread-locality of the last error ----------------------------------- */

typedef struct {
  char seen_at_start[512];
  char own_error[512];
  moelink_status_t own_status;
} thread_report;

static void *error_thread(void *arg) {
  thread_report *r = (thread_report *)arg;
  snprintf(r->seen_at_start, sizeof r->seen_at_start, "%s", moelink_last_error());
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  cfg.hidden = 16;
  cfg.inter = 8;
  cfg.num_experts = 4;
  cfg.top_k = 9;
  r->own_status = moelink_moe_config_check(&cfg);
  snprintf(r->own_error, sizeof r->own_error, "%s", moelink_last_error());
  return NULL;
}

static void test_last_error_threads(void) {
  moelink_moe_config_t cfg = MOELINK_MOE_CONFIG_INIT;
  moelink_status_t s = moelink_moe_preset("no-such-model-xyz", &cfg);
  CHECK(s == MOELINK_ERR_NOT_FOUND, "unknown preset -> NOT_FOUND on the main thread");
  char mine[512];
  snprintf(mine, sizeof mine, "%s", moelink_last_error());
  CHECK(mine[0] != 0 && strstr(mine, "no-such-model-xyz") != NULL,
        "main thread's message names the preset: '%s'", mine);

  thread_report r;
  memset(&r, 0, sizeof r);
  pthread_t th;
  int rc = pthread_create(&th, NULL, error_thread, &r);
  CHECK(rc == 0, "pthread_create");
  if (rc == 0) pthread_join(th, NULL);
  CHECK(r.seen_at_start[0] == 0, "a new thread sees no last error ('%s')", r.seen_at_start);
  CHECK(r.own_status == MOELINK_ERR_INVALID_ARGUMENT && strstr(r.own_error, "top_k") != NULL,
        "the thread's own failure is reported to it: '%s'", r.own_error);
  CHECK(strcmp(moelink_last_error(), mine) == 0,
        "the thread's failure does not show on the main thread ('%s')", moelink_last_error());

  /* Two threads failing at once each keep their own message. */
  thread_report rs[4];
  pthread_t ths[4];
  memset(rs, 0, sizeof rs);
  int started = 0;
  for (int i = 0; i < 4; ++i)
    if (pthread_create(&ths[i], NULL, error_thread, &rs[i]) == 0) ++started;
    else break;
  for (int i = 0; i < started; ++i) pthread_join(ths[i], NULL);
  int all = started == 4;
  for (int i = 0; i < started; ++i)
    if (rs[i].seen_at_start[0] != 0 || strstr(rs[i].own_error, "top_k") == NULL) all = 0;
  CHECK(all, "4 concurrent threads each see only their own error");
}

int main(void) {
  test_status_strings();
  test_version();
  test_dtypes();
  test_contexts();
  test_last_error_threads();
  return ml_test_done();
}
