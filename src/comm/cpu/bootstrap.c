/* CPU communicator: bootstrap over POSIX shared memory, symmetric buffers,
 * check and destroy.
 *
 * Bootstrap: the unique id carries a random shm name and a nonce. Rank 0
 * creates the control segment (O_EXCL), sizes and reserves it, fills the
 * header and publishes the nonce last; the other ranks open the name with
 * retries until the timeout, check the nonce and nranks, claim their slot
 * with their pid and count themselves in. Rank 0 unlinks the name as soon as
 * all ranks are in, so a crash later leaks nothing in /dev/shm.
 *
 * Symmetric buffers: one segment per allocation holding nranks slices of the
 * same size; rank r's buffer is slice r, so a peer's copy of an address is at
 * the same offset in the peer's slice. Rank 0 creates the segment, the others
 * map it, rank 0 unlinks it; the steps are separated by barriers over the
 * control segment, with each rank's outcome posted in its slot so all ranks
 * agree on success or failure. */
#include "comm/cpu/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static size_t ml_round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t ml_cpu_slots_bytes(int nranks) {
  return ml_round_up((size_t)nranks * sizeof(ml_cpu_slot), ML_CPU_PAGE);
}

static size_t ml_cpu_total_bytes(int nranks) {
  return ML_CPU_HEADER_BYTES + ml_cpu_slots_bytes(nranks) +
         (size_t)nranks * 2 * ML_CPU_STAGE_BYTES;
}

/* ---- unique id ---------------------------------------------------------- */

static uint64_t ml_cpu_random64(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v) return v;
  /* No entropy yet (early boot): time, pid and a counter still make two
   * ids of this machine differ, which is all a shm name needs. */
  static _Atomic uint64_t counter;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t z = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  z ^= (uint64_t)getpid() << 32;
  z += atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static moelink_status_t ml_cpu_unique_id(moelink_context_t ctx, moelink_unique_id_t *id) {
  ml_cpu_id cid;
  memset(&cid, 0, sizeof cid);
  cid.magic = ML_CPU_ID_MAGIC;
  cid.nonce = ml_cpu_random64() | 1; /* never 0: 0 means "segment not ready" */
  snprintf(cid.name, sizeof cid.name, "/moelink-%d-%016llx", (int)getpid(),
           (unsigned long long)ml_cpu_random64());
  memcpy(id->bytes, &cid, sizeof cid);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cpu_parse_id(const moelink_unique_id_t *id, ml_cpu_id *cid) {
  memcpy(cid, id->bytes, sizeof *cid);
  if (cid->magic != ML_CPU_ID_MAGIC)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "comm_init: the unique id was not made by moelink_get_unique_id on a cpu "
                   "context");
  if (memchr(cid->name, 0, sizeof cid->name) == NULL || cid->name[0] != '/' ||
      strchr(cid->name + 1, '/') != NULL || cid->nonce == 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: the cpu unique id is corrupt");
  return MOELINK_SUCCESS;
}

/* ---- init --------------------------------------------------------------- */

static void ml_cpu_unmap_all(ml_cpu_comm *c) {
  while (c->symm) {
    ml_cpu_symm *s = c->symm;
    c->symm = s->next;
    munmap(s->base, s->map_bytes);
    free(s);
  }
  if (c->map) munmap(c->map, c->map_bytes);
  c->map = NULL;
  c->hdr = NULL;
}

static void ml_cpu_set_layout(ml_cpu_comm *c) {
  c->hdr = (ml_cpu_header *)c->map;
  c->slots = (ml_cpu_slot *)(c->map + ML_CPU_HEADER_BYTES);
  c->stage = c->map + ML_CPU_HEADER_BYTES + ml_cpu_slots_bytes(c->nranks);
  c->stage_bytes = ML_CPU_STAGE_BYTES;
}

/* A list of the ranks that have not joined, for messages ("2, 5"). */
static int ml_cpu_missing(ml_cpu_comm *c, char *buf, size_t n) {
  size_t len = 0;
  int shown = 0, more = 0;
  buf[0] = '\0';
  for (int r = 0; r < c->nranks; ++r) {
    if (atomic_load_explicit(&c->slots[r].pid, memory_order_relaxed) != 0) continue;
    if (shown == 8) {
      ++more;
      continue;
    }
    int w = snprintf(buf + len, n - len, "%s%d", shown ? ", " : "", r);
    if (w < 0 || (size_t)w >= n - len) break;
    len += (size_t)w;
    ++shown;
  }
  if (more && len + 24 < n) snprintf(buf + len, n - len, " and %d more", more);
  return shown + more;
}

/* Maps fd (size bytes) shared, read-write. */
static unsigned char *ml_cpu_map(int fd, size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? NULL : (unsigned char *)p;
}

/* Creates a segment of `bytes`, with its pages reserved up front so that
 * running out of shared memory is an error here, not a SIGBUS later. */
static int ml_cpu_create_segment(const char *name, size_t bytes, unsigned char **out) {
  *out = NULL;
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  int err = 0;
  if (ftruncate(fd, (off_t)bytes) != 0) err = errno;
  if (!err) err = posix_fallocate(fd, 0, (off_t)bytes);
  if (!err && !(*out = ml_cpu_map(fd, bytes))) err = errno;
  close(fd);
  if (err) shm_unlink(name);
  return err;
}

static moelink_status_t ml_cpu_init_rank0(ml_cpu_comm *c, const ml_cpu_id *cid) {
  size_t total = ml_cpu_total_bytes(c->nranks);
  int err = ml_cpu_create_segment(cid->name, total, &c->map);
  if (err == EEXIST)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "rank 0: shared memory %s already exists: the unique id is in use by another "
                   "communicator (make a new id per communicator)",
                   cid->name);
  if (err)
    return ml_fail(err == ENOSPC || err == ENOMEM ? MOELINK_ERR_OUT_OF_MEMORY
                                                  : MOELINK_ERR_INVALID_STATE,
                   "rank 0: cannot create %zu bytes of shared memory %s: %s (is /dev/shm full or "
                   "missing?)",
                   total, cid->name, strerror(err));
  c->map_bytes = total;
  ml_cpu_set_layout(c);
  ml_cpu_header *h = c->hdr;
  h->magic = ML_CPU_ID_MAGIC;
  h->nranks = c->nranks;
  h->stage_bytes = c->stage_bytes;
  h->total_bytes = total;
  atomic_store_explicit(&c->slots[0].pid, (int)getpid(), memory_order_relaxed);
  atomic_store_explicit(&h->joined, 1, memory_order_relaxed);
  atomic_store_explicit(&h->state, cid->nonce, memory_order_release);

  ml_cpu_backoff b;
  ml_cpu_backoff_init(&b);
  while (atomic_load_explicit(&h->joined, memory_order_acquire) < c->nranks) {
    int64_t waited = ml_cpu_backoff_pause(&b);
    if (waited >= c->init_timeout_ms) {
      char missing[96];
      int nmissing = ml_cpu_missing(c, missing, sizeof missing);
      shm_unlink(cid->name);
      return ml_cpu_fail(c, MOELINK_ERR_TIMEOUT,
                         "rank 0: waited %lld ms for init (value %d ranks) from rank%s %s: %d of "
                         "%d ranks joined (are all ranks started with the same id and nranks?)",
                         (long long)waited, c->nranks, nmissing == 1 ? "" : "s", missing,
                         atomic_load(&h->joined), c->nranks);
    }
    /* A joiner that died after joining cannot leave again; keep waiting
     * for the others, the message names who is missing. */
  }
  shm_unlink(cid->name);
  atomic_store_explicit(&h->all_joined, 1, memory_order_release);
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cpu_init_joiner(ml_cpu_comm *c, const ml_cpu_id *cid) {
  ml_cpu_backoff b;
  ml_cpu_backoff_init(&b);
  int fd = -1;
  int64_t waited = 0;
  struct stat st;
  /* Rank 0 may not have created the segment yet, or not sized it. */
  for (;;) {
    if (fd < 0) {
      fd = shm_open(cid->name, O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0 && errno != ENOENT)
        return ml_fail(MOELINK_ERR_INVALID_STATE, "rank %d: cannot open shared memory %s: %s",
                       c->rank, cid->name, strerror(errno));
    }
    if (fd >= 0) {
      if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return ml_fail(MOELINK_ERR_INVALID_STATE, "rank %d: cannot stat shared memory %s: %s",
                       c->rank, cid->name, strerror(e));
      }
      if ((size_t)st.st_size >= ML_CPU_HEADER_BYTES) break;
    }
    if (waited >= c->init_timeout_ms) {
      if (fd >= 0) close(fd);
      return ml_fail(MOELINK_ERR_TIMEOUT,
                     "rank %d: waited %lld ms for init (value %d ranks) from rank 0: its shared "
                     "memory %s never appeared (is rank 0 running, with the same unique id?)",
                     c->rank, (long long)waited, c->nranks, cid->name);
    }
    struct timespec nap = {0, 1000000};
    nanosleep(&nap, NULL);
    waited = ml_cpu_now_ms() - b.start_ms;
  }
  /* The header first: its nranks says how large the whole segment is. */
  ml_cpu_header *h = (ml_cpu_header *)ml_cpu_map(fd, ML_CPU_HEADER_BYTES);
  if (!h) {
    int e = errno;
    close(fd);
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "rank %d: cannot map shared memory %s: %s",
                   c->rank, cid->name, strerror(e));
  }
  uint64_t state;
  while ((state = atomic_load_explicit(&h->state, memory_order_acquire)) == 0) {
    waited = ml_cpu_backoff_pause(&b);
    if (waited >= c->init_timeout_ms) {
      munmap(h, ML_CPU_HEADER_BYTES);
      close(fd);
      return ml_fail(MOELINK_ERR_TIMEOUT,
                     "rank %d: waited %lld ms for init (value %d ranks) from rank 0: its shared "
                     "memory %s was never made ready",
                     c->rank, (long long)waited, c->nranks, cid->name);
    }
  }
  moelink_status_t s = MOELINK_SUCCESS;
  if (state != cid->nonce || h->magic != ML_CPU_ID_MAGIC)
    s = ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                "rank %d: shared memory %s belongs to another communicator (nonce mismatch)",
                c->rank, cid->name);
  else if (h->nranks != c->nranks)
    s = ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                "rank %d: nranks %d does not match rank 0's nranks %d", c->rank, c->nranks,
                h->nranks);
  else if (h->total_bytes != ml_cpu_total_bytes(c->nranks) ||
           (size_t)st.st_size != h->total_bytes || h->stage_bytes != ML_CPU_STAGE_BYTES)
    s = ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                "rank %d: shared memory %s has a different layout (a different moelink build "
                "on rank 0?)",
                c->rank, cid->name);
  munmap(h, ML_CPU_HEADER_BYTES);
  if (s != MOELINK_SUCCESS) {
    close(fd);
    return s;
  }
  c->map_bytes = ml_cpu_total_bytes(c->nranks);
  c->map = ml_cpu_map(fd, c->map_bytes);
  int e = errno;
  close(fd);
  if (!c->map)
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "rank %d: cannot map %zu bytes of %s: %s",
                   c->rank, c->map_bytes, cid->name, strerror(e));
  ml_cpu_set_layout(c);
  int expect = 0;
  if (!atomic_compare_exchange_strong(&c->slots[c->rank].pid, &expect, (int)getpid())) {
    /* Not announced: the process that holds this rank is fine. */
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "rank %d: another process (pid %d) already joined as rank %d: each process "
                   "needs its own rank",
                   c->rank, expect, c->rank);
  }
  atomic_fetch_add_explicit(&c->hdr->joined, 1, memory_order_acq_rel);
  int64_t checked = 0;
  while (!atomic_load_explicit(&c->hdr->all_joined, memory_order_acquire)) {
    waited = ml_cpu_backoff_pause(&b);
    /* Fast ranks may finish init and fail a collective while this one
     * sleeps: init itself succeeded then, and the collective reports it. */
    if (atomic_load_explicit(&c->hdr->all_joined, memory_order_acquire)) break;
    ML_TRY(ml_cpu_failed(c));
    int dead0 = 0;
    if (waited - checked >= 20) {
      checked = waited;
      dead0 = ml_cpu_pid_dead(atomic_load_explicit(&c->slots[0].pid, memory_order_relaxed));
    }
    if (waited >= c->init_timeout_ms || dead0) {
      /* Rank 0 unlinks the name when all joined; if it died, do it for it. */
      if (dead0) shm_unlink(cid->name);
      char missing[96];
      (void)ml_cpu_missing(c, missing, sizeof missing);
      return ml_cpu_fail(c, MOELINK_ERR_TIMEOUT,
                         "rank %d: waited %lld ms for init (value %d ranks) from rank 0%s%s%s",
                         c->rank, (long long)waited, c->nranks, dead0 ? ": rank 0 has exited" : "",
                         missing[0] ? "; not joined: rank " : "", missing);
    }
  }
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cpu_init(moelink_comm_t comm, const moelink_unique_id_t *id) {
  ml_cpu_id cid;
  ML_TRY(ml_cpu_parse_id(id, &cid));
  if (comm->nranks > ML_CPU_MAX_RANKS)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: nranks %d > %d (cpu ranks)",
                   comm->nranks, ML_CPU_MAX_RANKS);
  ml_cpu_comm *c = (ml_cpu_comm *)calloc(1, sizeof *c);
  if (!c) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "cpu communicator allocation failed");
  c->rank = comm->rank;
  c->nranks = comm->nranks;
  c->timeout_ms = ml_comm_timeout_ms();
  c->init_timeout_ms = ml_comm_init_timeout_ms();
  c->stage_bytes = ML_CPU_STAGE_BYTES;
  snprintf(c->name, sizeof c->name, "%s", cid.name);
  moelink_status_t s =
      c->rank == 0 ? ml_cpu_init_rank0(c, &cid) : ml_cpu_init_joiner(c, &cid);
  if (s != MOELINK_SUCCESS) {
    ml_cpu_unmap_all(c);
    free(c);
    return s;
  }
  comm->impl = c;
  return MOELINK_SUCCESS;
}

static void ml_cpu_destroy(moelink_comm_t comm) {
  ml_cpu_comm *c = ml_cpu_of(comm);
  if (!c) return;
  /* Collective, as on the GPU; a failed communicator skips the barrier
   * (its peers may be gone) and a failed barrier changes nothing here. */
  if (ml_cpu_failed(c) == MOELINK_SUCCESS) (void)ml_cpu_barrier_impl(c, "comm_destroy barrier");
  ml_cpu_unmap_all(c);
  free(c);
  comm->impl = NULL;
}

static moelink_status_t ml_cpu_check(moelink_comm_t comm, void *stream) {
  return ml_cpu_failed(ml_cpu_of(comm));
}

/* ---- symmetric memory --------------------------------------------------- */

enum { ML_SYMM_OK = 0, ML_SYMM_FAILED = 1 };

/* Only the size is posted before the first barrier: peers may still read it
 * while this rank posts its later outcomes, which must not touch it. */
static void ml_cpu_post_size(ml_cpu_comm *c, uint64_t value) {
  ml_cpu_slot *s = &c->slots[c->rank];
  s->status = ML_SYMM_OK;
  s->err = 0;
  s->value = value;
}

static void ml_cpu_post_outcome(ml_cpu_comm *c, int err) {
  ml_cpu_slot *s = &c->slots[c->rank];
  s->status = err ? ML_SYMM_FAILED : ML_SYMM_OK;
  s->err = err;
}

static moelink_status_t ml_cpu_symm_alloc(moelink_comm_t comm, size_t bytes, void **ptr) {
  ml_cpu_comm *c = ml_cpu_of(comm);
  ML_TRY(ml_cpu_failed(c));
  unsigned long long nth = ++c->symm_count;
  int n = c->nranks;

  /* 1: agree on the size (all ranks see the same posted values). */
  ml_cpu_post_size(c, (uint64_t)bytes);
  ML_TRY(ml_cpu_barrier_impl(c, "symm_alloc barrier"));
  for (int p = 0; p < n; ++p) {
    uint64_t v = c->slots[p].value;
    if (v != (uint64_t)bytes) {
      /* Nobody may post the next allocation's values before all read these. */
      ML_TRY(ml_cpu_barrier_impl(c, "symm_alloc barrier"));
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "symm_alloc #%llu: rank %d asked for %zu bytes but rank %d for %llu: every "
                     "rank must allocate the same sizes in the same order",
                     nth, c->rank, bytes, p, (unsigned long long)v);
    }
  }
  size_t stride = ml_round_up(bytes, ML_CPU_PAGE);
  if (stride < bytes || stride > SIZE_MAX / (size_t)n) {
    ML_TRY(ml_cpu_barrier_impl(c, "symm_alloc barrier"));
    return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "symm_alloc: %zu bytes times %d ranks is too large",
                   bytes, n);
  }
  size_t total = stride * (size_t)n;
  ml_cpu_symm *s = (ml_cpu_symm *)calloc(1, sizeof *s);
  char name[ML_CPU_NAME_MAX + 24];
  snprintf(name, sizeof name, "%s-s%llu", c->name, nth);

  /* 2: rank 0 creates the segment. */
  int err = 0;
  unsigned char *base = NULL;
  if (c->rank == 0) {
    err = s ? ml_cpu_create_segment(name, total, &base) : ENOMEM;
    ml_cpu_post_outcome(c, err);
  }
  moelink_status_t st = ml_cpu_barrier_impl(c, "symm_alloc barrier");
  if (st == MOELINK_SUCCESS && c->slots[0].status != ML_SYMM_OK) {
    int e0 = c->slots[0].err;
    st = ml_fail(e0 == ENOSPC || e0 == ENOMEM ? MOELINK_ERR_OUT_OF_MEMORY
                                              : MOELINK_ERR_INVALID_STATE,
                 "symm_alloc: rank 0 could not create %zu bytes of shared memory: %s", total,
                 strerror(e0));
    /* Keep the slots untouched until every rank has read rank 0's status. */
    moelink_status_t b = ml_cpu_barrier_impl(c, "symm_alloc barrier");
    free(s);
    return b != MOELINK_SUCCESS ? b : st;
  }
  if (st != MOELINK_SUCCESS) {
    /* Any rank removes the name: rank 0 may have died between creating it
     * and unlinking it, and the communicator is failed for everyone. */
    if (base) munmap(base, total);
    shm_unlink(name);
    free(s);
    return st;
  }

  /* 3: the others map it; everyone posts how that went. */
  if (c->rank != 0) {
    if (!s) {
      err = ENOMEM;
    } else {
      int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0) {
        err = errno;
      } else {
        struct stat sb;
        if (fstat(fd, &sb) != 0)
          err = errno;
        else if ((size_t)sb.st_size != total)
          err = EINVAL;
        else if (!(base = ml_cpu_map(fd, total)))
          err = errno;
        close(fd);
      }
    }
    ml_cpu_post_outcome(c, err);
  }
  st = ml_cpu_barrier_impl(c, "symm_alloc barrier");
  if (c->rank == 0 || st != MOELINK_SUCCESS) shm_unlink(name);
  int bad = -1;
  for (int p = 0; st == MOELINK_SUCCESS && p < n && bad < 0; ++p)
    if (c->slots[p].status != ML_SYMM_OK) bad = p;
  if (st == MOELINK_SUCCESS && bad >= 0) {
    int e = c->slots[bad].err;
    st = ml_fail(e == ENOMEM || e == ENOSPC ? MOELINK_ERR_OUT_OF_MEMORY : MOELINK_ERR_INVALID_STATE,
                 "symm_alloc: rank %d could not map the %zu-byte segment %s: %s", bad, total, name,
                 strerror(e));
    moelink_status_t b = ml_cpu_barrier_impl(c, "symm_alloc barrier");
    if (b != MOELINK_SUCCESS) st = b;
  }
  if (st != MOELINK_SUCCESS) {
    if (base) munmap(base, total);
    free(s);
    return st;
  }
  s->base = base;
  s->stride = stride;
  s->bytes = bytes;
  s->map_bytes = total;
  s->next = c->symm;
  c->symm = s;
  *ptr = base + (size_t)c->rank * stride;
  return MOELINK_SUCCESS;
}

static moelink_status_t ml_cpu_symm_free(moelink_comm_t comm, void *ptr) {
  ml_cpu_comm *c = ml_cpu_of(comm);
  /* Local: the segment lives on in the peers' mappings until they free it
   * too, so a peer still reading this rank's slice reads valid memory. */
  for (ml_cpu_symm **pp = &c->symm; *pp; pp = &(*pp)->next) {
    ml_cpu_symm *s = *pp;
    if ((unsigned char *)ptr == s->base + (size_t)c->rank * s->stride) {
      *pp = s->next;
      munmap(s->base, s->map_bytes);
      free(s);
      return MOELINK_SUCCESS;
    }
  }
  return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                 "symm_free: %p was not returned by moelink_symm_alloc on this communicator "
                 "(or was freed already)",
                 ptr);
}

void *ml_cpu_peer_ptr(moelink_comm_t comm, const void *ptr, int peer) {
  ml_cpu_comm *c = ml_cpu_of(comm);
  if (!c || peer < 0 || peer >= c->nranks) return NULL;
  uintptr_t p = (uintptr_t)ptr;
  for (ml_cpu_symm *s = c->symm; s; s = s->next) {
    uintptr_t mine = (uintptr_t)(s->base + (size_t)c->rank * s->stride);
    if (p >= mine && p < mine + s->bytes)
      return s->base + (size_t)peer * s->stride + (p - mine);
  }
  return NULL;
}

/* ---- the table ---------------------------------------------------------- */

static const ml_comm_ops ml_cpu_comm_ops = {
    .name = "cpu",
    .unique_id = ml_cpu_unique_id,
    .init = ml_cpu_init,
    .init_from_nccl = NULL,
    .destroy = ml_cpu_destroy,
    .check = ml_cpu_check,
    .symm_alloc = ml_cpu_symm_alloc,
    .symm_free = ml_cpu_symm_free,
    .allreduce = ml_cpu_allreduce,
    .allgather = ml_cpu_allgather,
    .reduce_scatter = ml_cpu_reduce_scatter,
    .alltoallv = ml_cpu_alltoallv,
};

const ml_comm_ops *ml_comm_cpu_ops(void) { return &ml_cpu_comm_ops; }
