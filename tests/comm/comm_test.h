/* Helpers of the CPU-rank tests. Each test is one program that every rank
 * runs under `moelink launch -n N`; every rank checks its own results (TAP
 * lines come out prefixed with the rank) and the launcher fails the test if
 * any rank exits non-zero. Inputs come from the counter-based generator, so
 * every rank can compute what every other rank sent. */
#ifndef ML_COMM_TEST_H
#define ML_COMM_TEST_H

#include "harness.h"
#include "moelink.h"
#include "ref.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double ct_now_ms(void) __attribute__((unused));
static double ct_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* A CPU context and the communicator `moelink launch` describes; a test that
 * cannot even start says why and stops. */
static void ct_start(moelink_context_t *ctx, moelink_comm_t *comm) __attribute__((unused));
static void ct_start(moelink_context_t *ctx, moelink_comm_t *comm) {
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = 1;
  moelink_status_t s = moelink_context_create(&cc, ctx);
  if (s == MOELINK_SUCCESS) s = moelink_comm_init_from_env(*ctx, comm);
  if (s != MOELINK_SUCCESS) {
    printf("Bail out! cannot start: %s: %s\n", moelink_status_string(s), moelink_last_error());
    exit(1);
  }
}

static uint64_t ct_mix(uint64_t a, uint64_t b) __attribute__((unused));
static uint64_t ct_mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The seed of what rank `rank` sends in call `call`. */
static uint64_t ct_seed(uint64_t call, int rank) __attribute__((unused));
static uint64_t ct_seed(uint64_t call, int rank) { return ct_mix(call, (uint64_t)rank + 1000); }

/* Element i of a send buffer filled by moelink_fill_random(seed, scale 1,
 * offset 0), as the value it holds in dtype, computed with the reference's
 * own conversions. */
static float ct_value(moelink_dtype_t dt, uint64_t seed, size_t i) __attribute__((unused));
static float ct_value(moelink_dtype_t dt, uint64_t seed, size_t i) {
  unsigned char tmp[4];
  ref_store(dt, tmp, 0, (double)moelink_random_value(seed, i, 1.0f, 0.0f));
  return (float)ref_load(dt, tmp, 0);
}

static uint64_t ct_hash(const void *p, size_t n) __attribute__((unused));
static uint64_t ct_hash(const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* Index of the first element where a and b differ bitwise, or -1. */
static long ct_first_diff(const void *a, const void *b, size_t n, size_t es)
    __attribute__((unused));
static long ct_first_diff(const void *a, const void *b, size_t n, size_t es) {
  if (memcmp(a, b, n * es) == 0) return -1;
  for (size_t i = 0; i < n; ++i)
    if (memcmp((const char *)a + i * es, (const char *)b + i * es, es) != 0) return (long)i;
  return -1;
}

static void *ct_alloc(size_t bytes) __attribute__((unused));
static void *ct_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    printf("Bail out! out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

#endif
