/* The device primitives of moelink_device.cuh in a user kernel: a ring where
 * every block pushes a pattern into the next rank's symmetric buffer
 * (moelink_peer_ptr + plain stores), signals it (moelink_signal_set), waits
 * for its own (moelink_signal_wait), checks what the previous rank pushed,
 * counts with moelink_signal_add and meets the peers in a moelink_barrier,
 * 200 rounds over the same memory. Then a wait nobody answers: it gives up
 * after MOELINK_COMM_TIMEOUT_MS (2000 ms under ctest) and moelink_comm_check
 * names it. Host code in C style (nvcc compiles this file as C++). */
#include "mgpu.h"

#include "moelink_device.cuh"

#define TD_BLOCKS 4
#define TD_THREADS 256
#define TD_WORDS 8192 /* 32 KiB per block and round */
#define TD_ROUNDS 200
#define TD_DATA_BYTES ((size_t)TD_BLOCKS * TD_WORDS * 4)
#define TD_SIG_OFF TD_DATA_BYTES                           /* [block] */
#define TD_CNT_OFF (TD_SIG_OFF + 8 * TD_BLOCKS)            /* one counter */
#define TD_BAR_OFF (TD_CNT_OFF + 64)                       /* [block][MAX_RANKS] */
#define TD_NEVER_OFF (TD_BAR_OFF + 8 * TD_BLOCKS * MOELINK_DEVICE_MAX_RANKS)
#define TD_BYTES (TD_NEVER_OFF + 64)

static __device__ __forceinline__ uint32_t td_pattern(int rank, int block, int round, int i) {
  return (uint32_t)rank * 0x9e3779b9u ^ (uint32_t)block * 0x85ebca6bu ^
         (uint32_t)round * 0xc2b2ae35u ^ (uint32_t)i * 0x27d4eb2fu;
}

static __global__ void td_ring(const __grid_constant__ moelink_device_comm_t c,
                               const __grid_constant__ moelink_symm_view_t v, int rounds,
                               unsigned long long *errors, int *failed) {
  const int b = (int)blockIdx.x, t = (int)threadIdx.x;
  const int r = c.rank, n = c.nranks;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  char *buf = v.local;
  uint32_t *mine = (uint32_t *)(buf + (size_t)b * TD_WORDS * 4);
  uint32_t *dst = (uint32_t *)moelink_peer_ptr(&v, mine, next);
  uint64_t *sig = (uint64_t *)(buf + TD_SIG_OFF) + b;
  uint64_t *cnt = (uint64_t *)(buf + TD_CNT_OFF);
  uint64_t *slots = (uint64_t *)(buf + TD_BAR_OFF) + (size_t)b * MOELINK_DEVICE_MAX_RANKS;
  unsigned long long bad = 0;
  for (int round = 1; round <= rounds; ++round) {
    for (int i = t; i < TD_WORDS; i += blockDim.x) dst[i] = td_pattern(r, b, round, i);
    __syncthreads();
    int ok = 1;
    if (t == 0) {
      moelink_signal_set((uint64_t *)moelink_peer_ptr(&v, sig, next), (uint64_t)round);
      if (b == 0)
        for (int p = 0; p < n; ++p)
          if (p != r) moelink_signal_add((uint64_t *)moelink_peer_ptr(&v, cnt, p), 1);
      ok = moelink_signal_wait(&c, sig, (uint64_t)round, prev, MOELINK_PRIM_SIGNAL_WAIT);
    }
    if (!__syncthreads_and(ok)) {
      if (t == 0) atomicExch(failed, 1);
      return;
    }
    for (int i = t; i < TD_WORDS; i += blockDim.x) bad += mine[i] != td_pattern(prev, b, round, i);
    /* Nobody overwrites `mine` for the next round before this block read it. */
    if (!moelink_barrier(&c, &v, slots, (uint64_t)round)) {
      if (t == 0) atomicExch(failed, 1);
      return;
    }
  }
  if (t == 0 && b == 0 &&
      !moelink_signal_wait(&c, cnt, (uint64_t)(n - 1) * (uint64_t)rounds, -1,
                           MOELINK_PRIM_USER + 1))
    atomicExch(failed, 1);
  if (bad) atomicAdd(errors, bad);
}

static __global__ void td_never(const __grid_constant__ moelink_device_comm_t c, uint64_t *word,
                                int *result, int *failed_seen) {
  *result = moelink_signal_wait(&c, word, (uint64_t)1 << 40, -1, MOELINK_PRIM_USER + 7);
  *failed_seen = moelink_device_failed(&c);
}

int main(void) {
  mg_world w;
  mg_init(&w);
  const int n = w.size;

  moelink_device_comm_t dc;
  CHECK_OK(moelink_comm_device(w.comm, &dc), "moelink_comm_device");
  CHECK(dc.rank == w.rank && dc.nranks == n && dc.timeout_ns > 0,
        "device comm: rank %d of %d, limit %.0f ms", dc.rank, dc.nranks, dc.timeout_ns / 1e6);

  char *buf = NULL;
  CHECK_OK(moelink_symm_alloc(w.comm, TD_BYTES, (void **)&buf), "moelink_symm_alloc");
  if (!buf) mg_bail("no symmetric buffer");
  char *zero = (char *)mg_host(TD_BYTES);
  MG_CUDA(cudaMemcpy(zero, buf, TD_BYTES, cudaMemcpyDeviceToHost));
  size_t nonzero = 0;
  for (size_t i = 0; i < TD_BYTES; ++i) nonzero += zero[i] != 0;
  CHECK(nonzero == 0, "symm_alloc returns zeroed memory (%zu bytes not)", nonzero);
  free(zero);

  moelink_symm_view_t v;
  CHECK_OK(moelink_symm_view(w.comm, buf + 100, &v), "moelink_symm_view of an inner address");
  int peers_ok = v.local == buf && v.bytes >= TD_BYTES && v.base[w.rank] == buf;
  for (int p = 0; p < MOELINK_DEVICE_MAX_RANKS; ++p)
    peers_ok &= p < n ? v.base[p] != NULL : v.base[p] == NULL;
  for (int p = 0; p < n; ++p)
    if (p != w.rank) peers_ok &= v.base[p] != buf;
  CHECK(peers_ok, "view: own copy is the allocation, %d peer copies elsewhere", n - 1);
  CHECK_STATUS(moelink_symm_view(w.comm, buf + v.bytes, &v), MOELINK_ERR_INVALID_ARGUMENT,
               "symm_view past the end");
  CHECK_OK(moelink_symm_view(w.comm, buf, &v), "moelink_symm_view");
  CHECK_STATUS(moelink_symm_free(w.comm, buf + 8), MOELINK_ERR_INVALID_ARGUMENT,
               "symm_free of an inner address");

  unsigned long long *errors = (unsigned long long *)mg_dev(sizeof *errors);
  int *flags = (int *)mg_dev(4 * sizeof(int));
  MG_CUDA(cudaMemset(errors, 0, sizeof *errors));
  MG_CUDA(cudaMemset(flags, 0, 4 * sizeof(int)));
  const double t0 = mg_now();
  td_ring<<<TD_BLOCKS, TD_THREADS, 0, w.stream>>>(dc, v, TD_ROUNDS, errors, flags);
  MG_CUDA(cudaGetLastError());
  CHECK_OK(moelink_comm_check(w.comm, w.stream), "ring kernel: moelink_comm_check");
  unsigned long long h_errors = 0;
  int h_flags[4] = {0, 0, 0, 0};
  MG_CUDA(cudaMemcpy(&h_errors, errors, sizeof h_errors, cudaMemcpyDeviceToHost));
  MG_CUDA(cudaMemcpy(h_flags, flags, sizeof h_flags, cudaMemcpyDeviceToHost));
  CHECK(h_flags[0] == 0 && h_errors == 0,
        "ring: %d rounds of %d blocks x %d KiB pushed, signalled, checked, barriered "
        "(%llu wrong words, %s, %.3f s)",
        TD_ROUNDS, TD_BLOCKS, TD_WORDS * 4 / 1024, h_errors,
        h_flags[0] ? "a wait gave up" : "no wait gave up", mg_now() - t0);

  /* Every rank waits for a value nobody sends. */
  uint64_t *never = (uint64_t *)(buf + TD_NEVER_OFF);
  const double limit_s = dc.timeout_ns / 1e9;
  const double t1 = mg_now();
  td_never<<<1, 1, 0, w.stream>>>(dc, never, flags + 1, flags + 2);
  MG_CUDA(cudaGetLastError());
  moelink_status_t s = moelink_comm_check(w.comm, w.stream);
  const double waited = mg_now() - t1;
  const char *msg = moelink_last_error();
  CHECK(s == MOELINK_ERR_TIMEOUT, "unanswered wait: check reports %s after %.2f s: %s",
        moelink_status_string(s), waited, msg);
  CHECK(waited < limit_s + 15.0, "unanswered wait gave up in time (%.2f s, limit %.1f s)",
        waited, limit_s);
  char rank_text[32];
  snprintf(rank_text, sizeof rank_text, "rank %d:", w.rank);
  CHECK(strstr(msg, rank_text) && strstr(msg, "user primitive 263"),
        "the message names this rank and MOELINK_PRIM_USER + 7: %s", msg);
  MG_CUDA(cudaMemcpy(h_flags, flags, sizeof h_flags, cudaMemcpyDeviceToHost));
  CHECK(h_flags[1] == 0 && h_flags[2] == 1,
        "the wait returned 0 and moelink_device_failed says so (%d, %d)", h_flags[1], h_flags[2]);

  CHECK_OK(moelink_symm_free(w.comm, buf), "moelink_symm_free");
  CHECK_OK(moelink_comm_destroy(w.comm), "destroy after the timeout");
  cudaFree(errors);
  cudaFree(flags);
  cudaStreamDestroy(w.stream);
  CHECK_OK(moelink_context_destroy(w.ctx), "context destroy");
  return ml_test_done();
}
