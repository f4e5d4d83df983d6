/* Waiting without hanging: every wait of the CPU communicator goes through
 * ml_cpu_wait_word, which gives up on the timeout, on a dead peer, or when
 * another rank announced a failure, and says which of these happened. */
#include "comm/cpu/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int64_t ml_cpu_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline void ml_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

void ml_cpu_backoff_init(ml_cpu_backoff *b) {
  b->start_ms = b->last_live_ms = ml_cpu_now_ms();
  b->iter = 0;
}

/* Spinning pays off when the peer runs on another core and is about to
 * signal; with more ranks than cores (CI runs 8 on 2) the peer needs this
 * core, so the loop soon yields and then naps, longer once the wait is long
 * (a peer busy computing should not lose cycles to many wake-ups). */
int64_t ml_cpu_backoff_pause(ml_cpu_backoff *b) {
  ++b->iter;
  int64_t waited = ml_cpu_now_ms() - b->start_ms;
  if (b->iter < 64) {
    ml_cpu_relax();
  } else if (b->iter < 256) {
    sched_yield();
  } else {
    struct timespec nap = {0, waited < 10 ? 50000 : 500000};
    nanosleep(&nap, NULL);
  }
  return ml_cpu_now_ms() - b->start_ms;
}

int ml_cpu_pid_dead(int pid) {
  if (pid <= 0) return 0;
  if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
  /* An exited child its parent has not reaped yet still answers kill(). */
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char *p = strrchr(buf, ')');
  return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

moelink_status_t ml_cpu_fail(ml_cpu_comm *c, moelink_status_t status, const char *fmt, ...) {
  char msg[ML_CPU_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (c->err == MOELINK_SUCCESS) {
    c->err = status;
    snprintf(c->err_msg, sizeof c->err_msg, "%s", msg);
  }
  if (c->hdr) {
    int expect = 0;
    if (atomic_compare_exchange_strong_explicit(&c->hdr->abort_claim, &expect, c->rank + 1,
                                                memory_order_acq_rel, memory_order_acquire)) {
      c->hdr->abort_status = (int32_t)status;
      snprintf(c->hdr->abort_msg, sizeof c->hdr->abort_msg, "%s", msg);
      atomic_store_explicit(&c->hdr->abort_rank, c->rank + 1, memory_order_release);
    }
  }
  return ml_fail(status, "%s", msg);
}

/* Another rank's announced failure, or -1. */
static int ml_cpu_aborted_by(ml_cpu_comm *c) {
  if (!c->hdr) return -1;
  int a = atomic_load_explicit(&c->hdr->abort_rank, memory_order_acquire);
  return a > 0 && a - 1 != c->rank ? a - 1 : -1;
}

moelink_status_t ml_cpu_failed(ml_cpu_comm *c) {
  if (c->err != MOELINK_SUCCESS) return ml_fail(c->err, "%s", c->err_msg);
  int by = ml_cpu_aborted_by(c);
  if (by >= 0) {
    c->err = (moelink_status_t)c->hdr->abort_status;
    snprintf(c->err_msg, sizeof c->err_msg, "rank %d: the communicator failed on rank %d: %.320s",
             c->rank, by, c->hdr->abort_msg);
    return ml_fail(c->err, "%s", c->err_msg);
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_wait_word(ml_cpu_comm *c, _Atomic uint64_t *w, uint64_t value, int from,
                                  const char *what) {
  if (atomic_load_explicit(w, memory_order_acquire) >= value) return MOELINK_SUCCESS;
  ml_cpu_backoff b;
  ml_cpu_backoff_init(&b);
  for (;;) {
    int64_t waited = ml_cpu_backoff_pause(&b);
    uint64_t now_at = atomic_load_explicit(w, memory_order_acquire);
    if (now_at >= value) return MOELINK_SUCCESS;
    int by = ml_cpu_aborted_by(c);
    if (by >= 0)
      return ml_cpu_fail(c, (moelink_status_t)c->hdr->abort_status,
                         "rank %d: stopped waiting for %s (value %llu) from rank %d after %lld ms "
                         "because rank %d failed: %s",
                         c->rank, what, (unsigned long long)value, from, (long long)waited, by,
                         c->hdr->abort_msg);
    if (waited >= c->timeout_ms)
      return ml_cpu_fail(c, MOELINK_ERR_TIMEOUT,
                         "rank %d: waited %lld ms for %s (value %llu) from rank %d; it is at %llu "
                         "(MOELINK_COMM_TIMEOUT_MS=%lld)",
                         c->rank, (long long)waited, what, (unsigned long long)value, from,
                         (unsigned long long)now_at, (long long)c->timeout_ms);
    if (from >= 0 && from < c->nranks && b.start_ms + waited - b.last_live_ms >= 20) {
      b.last_live_ms = b.start_ms + waited;
      int pid = atomic_load_explicit(&c->slots[from].pid, memory_order_relaxed);
      if (ml_cpu_pid_dead(pid)) {
        /* It may have signalled just before it exited. */
        now_at = atomic_load_explicit(w, memory_order_acquire);
        if (now_at >= value) return MOELINK_SUCCESS;
        return ml_cpu_fail(c, MOELINK_ERR_TIMEOUT,
                           "rank %d: waited %lld ms for %s (value %llu) from rank %d; it is at "
                           "%llu and rank %d (pid %d) has exited",
                           c->rank, (long long)waited, what, (unsigned long long)value, from,
                           (unsigned long long)now_at, from, pid);
      }
    }
  }
}

moelink_status_t ml_cpu_barrier_impl(ml_cpu_comm *c, const char *what) {
  uint64_t epoch = ++c->barriers;
  atomic_store_explicit(&c->slots[c->rank].barrier, epoch, memory_order_release);
  for (int p = 0; p < c->nranks; ++p)
    if (p != c->rank) ML_TRY(ml_cpu_wait_word(c, &c->slots[p].barrier, epoch, p, what));
  return MOELINK_SUCCESS;
}

/* ---- the primitives of comm_cpu.h --------------------------------------- */

void ml_cpu_signal_set(uint64_t *signal, uint64_t value) {
  atomic_store_explicit((_Atomic uint64_t *)signal, value, memory_order_release);
}

void ml_cpu_signal_add(uint64_t *signal, uint64_t value) {
  atomic_fetch_add_explicit((_Atomic uint64_t *)signal, value, memory_order_release);
}

moelink_status_t ml_cpu_wait(moelink_comm_t comm, const uint64_t *signal, uint64_t value,
                             int from, const char *primitive) {
  ml_cpu_comm *c = ml_cpu_of(comm);
  ML_TRY(ml_cpu_failed(c));
  return ml_cpu_wait_word(c, (_Atomic uint64_t *)(uintptr_t)signal, value, from,
                          primitive ? primitive : "signal");
}

moelink_status_t ml_cpu_barrier(moelink_comm_t comm) {
  ml_cpu_comm *c = ml_cpu_of(comm);
  ML_TRY(ml_cpu_failed(c));
  return ml_cpu_barrier_impl(c, "barrier");
}
