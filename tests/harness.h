/* A small TAP test harness: each CHECK prints "ok N" or "not ok N - what";
 * ml_test_done() prints the plan and the "N passed, N failed" line and returns
 * the exit code. Header-only so every test is one file. */
#ifndef ML_TEST_HARNESS_H
#define ML_TEST_HARNESS_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int ml_t_count, ml_t_failed;

static void ml_t_report(int ok, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5), unused));
static void ml_t_report(int ok, const char *file, int line, const char *fmt, ...) {
  ++ml_t_count;
  if (!ok) ++ml_t_failed;
  printf("%sok %d - ", ok ? "" : "not ", ml_t_count);
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  if (!ok) printf(" (%s:%d)", file, line);
  printf("\n");
  fflush(stdout);
}

/* xorshift64*: a small deterministic generator for test data (state != 0);
 * ml_t_unit is uniform in [0, 1) with 24 bits. */
static uint32_t ml_t_rand(uint64_t *state) __attribute__((unused));
static uint32_t ml_t_rand(uint64_t *state) {
  *state ^= *state >> 12;
  *state ^= *state << 25;
  *state ^= *state >> 27;
  return (uint32_t)((*state * 0x2545f4914f6cdd1dull) >> 32);
}
static double ml_t_unit(uint64_t *state) __attribute__((unused));
static double ml_t_unit(uint64_t *state) { return (ml_t_rand(state) >> 8) * (1.0 / 16777216.0); }

/* CHECK(cond, "printf-style description", ...) */
#define CHECK(cond, ...) ml_t_report(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

/* A moelink call that must succeed; on failure the message names the reason. */
#define CHECK_OK(call, what)                                                   \
  do {                                                                         \
    moelink_status_t ml_s_ = (call);                                           \
    CHECK(ml_s_ == MOELINK_SUCCESS, "%s%s%s", (what),                           \
          ml_s_ ? ": " : "", ml_s_ ? moelink_last_error() : "");              \
  } while (0)

/* A moelink call that must fail with `want` and leave a non-empty message. */
#define CHECK_STATUS(call, want, what)                                         \
  do {                                                                         \
    moelink_status_t ml_s_ = (call);                                           \
    CHECK(ml_s_ == (want) && moelink_last_error()[0] != 0,                     \
          "%s -> %s (%s)", (what), moelink_status_string(ml_s_),               \
          moelink_last_error());                                               \
  } while (0)

static void ml_t_diag(const char *fmt, ...) __attribute__((format(printf, 1, 2), unused));
static void ml_t_diag(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("# ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
}

static int ml_test_done(void) __attribute__((unused));
static int ml_test_done(void) {
  printf("1..%d\n", ml_t_count);
  printf("%d passed, %d failed\n", ml_t_count - ml_t_failed, ml_t_failed);
  return ml_t_failed ? 1 : (ml_t_count ? 0 : 1);
}

#endif
