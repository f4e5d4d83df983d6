/* Symmetric memory and the CPU primitives (comm/cpu/comm_cpu.h): a peer's
 * buffer is reachable at ml_cpu_peer_ptr and shows what the peer wrote;
 * puts into peers' buffers followed by a release signal are visible after the
 * acquire wait; allocations of different sizes on different ranks fail on
 * every rank without breaking the communicator; symm_free checks its pointer;
 * nothing is left in /dev/shm. Links the static library: these primitives
 * are hidden in the shared one. */
#include "comm/cpu/comm_cpu.h"
#include "comm_test.h"

#include <dirent.h>
#include <unistd.h>

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks;

static int leftover_segments(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "moelink-%d-", (int)getppid());
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
      ml_t_diag("left over: /dev/shm/%s", e->d_name);
      ++n;
    }
  closedir(d);
  return n;
}

static uint32_t pattern(int r, size_t i) { return (uint32_t)ct_mix((uint64_t)r, i); }

/* Each rank fills its buffer; after a barrier every rank reads every peer's. */
static void test_peer_visibility(size_t bytes) {
  void *buf = NULL;
  moelink_status_t s = moelink_symm_alloc(comm, bytes, &buf);
  CHECK(s == MOELINK_SUCCESS && buf != NULL, "symm_alloc %zu bytes%s%s", bytes,
        s ? ": " : "", s ? moelink_last_error() : "");
  if (s != MOELINK_SUCCESS) return;
  unsigned char *mine = (unsigned char *)buf;
  for (size_t i = 0; i < bytes; ++i) mine[i] = (unsigned char)pattern(rank, i);
  CHECK_OK(ml_cpu_barrier(comm), "barrier after filling");
  int ok = 1, ptr_ok = 1;
  for (int p = 0; p < nranks; ++p) {
    const unsigned char *peer = (const unsigned char *)ml_cpu_peer_ptr(comm, buf, p);
    if (!peer || (p == rank && peer != mine)) {
      ptr_ok = 0;
      continue;
    }
    for (size_t i = 0; i < bytes; ++i)
      if (peer[i] != (unsigned char)pattern(p, i)) {
        if (ok) ml_t_diag("peer %d byte %zu: %u, want %u", p, i, peer[i],
                          (unsigned)(unsigned char)pattern(p, i));
        ok = 0;
        break;
      }
    /* An address inside the buffer maps to the same offset in the peer's. */
    if (bytes > 1 && (unsigned char *)ml_cpu_peer_ptr(comm, mine + bytes - 1, p) !=
                         peer + bytes - 1)
      ptr_ok = 0;
  }
  CHECK(ptr_ok, "peer_ptr gives every peer's copy (own rank: the pointer itself), interior "
                "addresses included (%zu bytes)", bytes);
  CHECK(ok, "every rank sees what each peer wrote (%zu bytes, %d ranks)", bytes, nranks);
  /* Nobody may free (unmap) before all finished reading: not needed for
   * safety here (each rank maps the segment itself), but it keeps the next
   * allocation's barrier counts aligned with what this test expects. */
  CHECK_OK(ml_cpu_barrier(comm), "barrier after reading");
  CHECK_OK(moelink_symm_free(comm, buf), "symm_free");
}

/* Puts with signals: in iteration k every rank writes k into its slot k of
 * every peer's data and sets its flag in that peer to k (release); it then
 * waits for every peer's flag >= k (acquire) and reads the slots. */
static void test_put_signal(void) {
  enum { ITERS = 64 };
  uint64_t *data = NULL, *flags = NULL;
  size_t data_bytes = (size_t)ITERS * (size_t)nranks * sizeof(uint64_t);
  CHECK_OK(moelink_symm_alloc(comm, data_bytes, (void **)&data), "symm_alloc data");
  CHECK_OK(moelink_symm_alloc(comm, (size_t)nranks * sizeof(uint64_t), (void **)&flags),
           "symm_alloc flags");
  if (!data || !flags) return;
  memset(data, 0, data_bytes);
  memset(flags, 0, (size_t)nranks * sizeof(uint64_t));
  CHECK_OK(ml_cpu_barrier(comm), "barrier after zeroing");
  int bad = 0;
  moelink_status_t s = MOELINK_SUCCESS;
  for (uint64_t k = 1; k <= ITERS && s == MOELINK_SUCCESS; ++k) {
    for (int p = 0; p < nranks; ++p) {
      uint64_t *pd = (uint64_t *)ml_cpu_peer_ptr(comm, data, p);
      uint64_t *pf = (uint64_t *)ml_cpu_peer_ptr(comm, flags, p);
      pd[(k - 1) * (size_t)nranks + (size_t)rank] = k * 1000 + (uint64_t)rank;
      if (k % 2)
        ml_cpu_signal_set(&pf[rank], k);
      else
        ml_cpu_signal_add(&pf[rank], 1);
    }
    for (int p = 0; p < nranks && s == MOELINK_SUCCESS; ++p) {
      s = ml_cpu_wait(comm, &flags[p], k, p, "put flag");
      if (s == MOELINK_SUCCESS && data[(k - 1) * (size_t)nranks + (size_t)p] != k * 1000 + (uint64_t)p)
        ++bad;
    }
  }
  CHECK(s == MOELINK_SUCCESS, "%d rounds of put + signal between all ranks%s%s", ITERS,
        s ? ": " : "", s ? moelink_last_error() : "");
  CHECK(bad == 0, "data put before a signal is there once the signal is seen (%d stale)", bad);
  CHECK_OK(ml_cpu_barrier(comm), "barrier before freeing");
  CHECK_OK(moelink_symm_free(comm, flags), "symm_free flags");
  CHECK_OK(moelink_symm_free(comm, data), "symm_free data");
}

static void test_errors(void) {
  int x = 0;
  CHECK(ml_cpu_peer_ptr(comm, &x, 0) == NULL, "peer_ptr of a non-symmetric address is NULL");
  void *buf = NULL;
  CHECK_OK(moelink_symm_alloc(comm, 100, &buf), "symm_alloc 100 bytes");
  CHECK(ml_cpu_peer_ptr(comm, buf, nranks) == NULL && ml_cpu_peer_ptr(comm, buf, -1) == NULL,
        "peer_ptr of a rank out of range is NULL");
  CHECK(ml_cpu_peer_ptr(comm, (char *)buf + 100, 0) == NULL,
        "peer_ptr just past the buffer is NULL");
  CHECK_STATUS(moelink_symm_free(comm, &x), MOELINK_ERR_INVALID_ARGUMENT,
               "symm_free of a pointer symm_alloc did not return");
  CHECK_STATUS(moelink_symm_free(comm, (char *)buf + 4), MOELINK_ERR_INVALID_ARGUMENT,
               "symm_free of an interior pointer");
  CHECK_OK(moelink_symm_free(comm, buf), "symm_free");
  CHECK_STATUS(moelink_symm_free(comm, buf), MOELINK_ERR_INVALID_ARGUMENT, "double symm_free");
  CHECK_OK(moelink_symm_free(comm, NULL), "symm_free(NULL) is a no-op");

  /* Sizes that differ between ranks: every rank learns it, none hangs. */
  buf = (void *)1;
  moelink_status_t s = moelink_symm_alloc(comm, 64 + (size_t)(rank == nranks - 1), &buf);
  if (nranks > 1)
    CHECK(s == MOELINK_ERR_INVALID_ARGUMENT && buf == NULL &&
              strstr(moelink_last_error(), "same sizes"),
          "symm_alloc of different sizes on different ranks -> %s: %s",
          moelink_status_string(s), moelink_last_error());
  else
    CHECK(s == MOELINK_SUCCESS && buf != NULL, "one rank: any size agrees with itself");
  if (s == MOELINK_SUCCESS) moelink_symm_free(comm, buf);
  float v = (float)rank, sum = -1.0f;
  CHECK_OK(moelink_allreduce(comm, &v, &sum, 1, MOELINK_DTYPE_F32, NULL),
           "the communicator still works after that");
  CHECK(sum == (float)(nranks * (nranks - 1) / 2), "and sums right (%g)", (double)sum);
}

int main(void) {
  ct_start(&ctx, &comm);
  rank = moelink_comm_rank(comm);
  nranks = moelink_comm_size(comm);
  test_peer_visibility(1);
  test_peer_visibility(4096 + 7);
  test_peer_visibility((size_t)3 << 20);
  test_put_signal();
  test_errors();
  /* Held buffers at destroy are released by it. */
  void *held = NULL;
  CHECK_OK(moelink_symm_alloc(comm, 12345, &held), "symm_alloc a buffer left to destroy");
  CHECK_OK(ml_cpu_barrier(comm), "barrier");
  if (rank == 0) CHECK(leftover_segments() == 0, "no segment of this launch is left in /dev/shm");
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy (frees the held buffer)");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
