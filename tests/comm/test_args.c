/* The communicator front end: every argument error is refused with the right
 * status and a message naming what is wrong, before any rank talks to
 * another (so ranks stay in step: each rank makes the same calls); unique id
 * text round trips; init_from_env names the variable that is missing or bad.
 * Ends with a real collective, so the refused calls left the communicator
 * usable. */
#include "comm_test.h"

#include <stdint.h>

static moelink_context_t ctx;
static moelink_comm_t comm;
static int rank, nranks;

#define CHECK_MSG(call, want, needle, what)                                    \
  do {                                                                         \
    moelink_status_t s_ = (call);                                              \
    CHECK(s_ == (want) && strstr(moelink_last_error(), (needle)) != NULL,      \
          "%s -> %s (%s)", (what), moelink_status_string(s_),                  \
          moelink_last_error());                                               \
  } while (0)

static void test_hex(void) {
  moelink_unique_id_t id, back;
  char hex[2 * MOELINK_UNIQUE_ID_BYTES + 1];
  for (int i = 0; i < MOELINK_UNIQUE_ID_BYTES; ++i) id.bytes[i] = (unsigned char)(i * 37 + 11);
  CHECK_OK(moelink_unique_id_to_hex(&id, hex, sizeof hex), "unique_id_to_hex");
  CHECK(strlen(hex) == 2 * MOELINK_UNIQUE_ID_BYTES && strncmp(hex, "0b30", 4) == 0,
        "hex is %d lower-case digits, byte 0 first ('%.8s...')", 2 * MOELINK_UNIQUE_ID_BYTES,
        hex);
  CHECK_OK(moelink_unique_id_from_hex(hex, &back), "unique_id_from_hex");
  CHECK(memcmp(&id, &back, sizeof id) == 0, "id -> hex -> id round trips");
  hex[2] = 'A';
  hex[3] = 'f';
  CHECK_OK(moelink_unique_id_from_hex(hex, &back), "upper-case digits are accepted");
  CHECK(back.bytes[1] == 0xaf, "and read as such");
  CHECK_MSG(moelink_unique_id_to_hex(&id, hex, 256), MOELINK_ERR_INVALID_ARGUMENT, "256",
            "to_hex into 256 bytes (needs 257)");
  CHECK_MSG(moelink_unique_id_to_hex(NULL, hex, sizeof hex), MOELINK_ERR_INVALID_ARGUMENT,
            "id is NULL", "to_hex of NULL");
  CHECK_MSG(moelink_unique_id_to_hex(&id, NULL, sizeof hex), MOELINK_ERR_INVALID_ARGUMENT,
            "hex is NULL", "to_hex into NULL");
  CHECK_MSG(moelink_unique_id_from_hex("abc", &back), MOELINK_ERR_INVALID_ARGUMENT,
            "3 characters", "from_hex of 3 digits");
  CHECK_OK(moelink_unique_id_to_hex(&id, hex, sizeof hex), "unique_id_to_hex");
  hex[77] = 'g';
  CHECK_MSG(moelink_unique_id_from_hex(hex, &back), MOELINK_ERR_INVALID_ARGUMENT,
            "character 77 ('g')", "from_hex with a 'g'");
  CHECK_MSG(moelink_unique_id_from_hex(NULL, &back), MOELINK_ERR_INVALID_ARGUMENT,
            "hex is NULL", "from_hex of NULL");
  CHECK_MSG(moelink_unique_id_from_hex(hex, NULL), MOELINK_ERR_INVALID_ARGUMENT, "id is NULL",
            "from_hex into NULL");
}

static void test_unique_id(void) {
  moelink_unique_id_t a, b;
  CHECK_OK(moelink_get_unique_id(ctx, &a), "get_unique_id on a cpu context");
  CHECK_OK(moelink_get_unique_id(ctx, &b), "get_unique_id again");
  CHECK(memcmp(&a, &b, sizeof a) != 0, "two ids differ");
  CHECK_MSG(moelink_get_unique_id(NULL, &a), MOELINK_ERR_INVALID_ARGUMENT, "context is NULL",
            "get_unique_id(NULL context)");
  CHECK_MSG(moelink_get_unique_id(ctx, NULL), MOELINK_ERR_INVALID_ARGUMENT, "id is NULL",
            "get_unique_id(NULL id)");
}

static void test_init_args(void) {
  moelink_unique_id_t id;
  moelink_comm_t c = (moelink_comm_t)1;
  moelink_get_unique_id(ctx, &id);
  CHECK_MSG(moelink_comm_init(ctx, 0, 0, &id, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "nranks 0 must be >= 1", "comm_init nranks 0");
  CHECK(c == NULL, "a failed init sets *out to NULL");
  CHECK_MSG(moelink_comm_init(ctx, 2, 2, &id, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "rank 2 is out of range [0, 2)", "comm_init rank 2 of 2");
  CHECK_MSG(moelink_comm_init(ctx, -1, 2, &id, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "rank -1 is out of range", "comm_init rank -1");
  CHECK_MSG(moelink_comm_init(NULL, 0, 1, &id, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "context is NULL", "comm_init NULL context");
  CHECK_MSG(moelink_comm_init(ctx, 0, 1, NULL, &c), MOELINK_ERR_INVALID_ARGUMENT, "id is NULL",
            "comm_init NULL id");
  CHECK_MSG(moelink_comm_init(ctx, 0, 1, &id, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "out is NULL", "comm_init NULL out");
  CHECK_MSG(moelink_comm_init(ctx, 0, 100000, &id, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "nranks 100000 >", "comm_init with more ranks than the cpu backend takes");
  moelink_unique_id_t zero;
  memset(&zero, 0, sizeof zero);
  CHECK_MSG(moelink_comm_init(ctx, 0, 1, &zero, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "not made by moelink_get_unique_id on a cpu context", "comm_init with a zero id");
  /* A single rank needs nobody: its own fresh id works at once. */
  moelink_comm_t solo = NULL;
  CHECK_OK(moelink_comm_init(ctx, 0, 1, &id, &solo), "a one-rank communicator of its own");
  CHECK(moelink_comm_rank(solo) == 0 && moelink_comm_size(solo) == 1, "rank 0 of 1");
  CHECK_OK(moelink_comm_destroy(solo), "destroy the one-rank communicator");
  CHECK_OK(moelink_comm_destroy(NULL), "comm_destroy(NULL) is a no-op");
  CHECK(moelink_comm_rank(NULL) == -1 && moelink_comm_size(NULL) == -1,
        "rank and size of NULL are -1");

  CHECK_MSG(moelink_comm_init_from_nccl(ctx, (void *)&id, &c), MOELINK_ERR_UNSUPPORTED,
            "cuda context", "init_from_nccl on a cpu context");
  CHECK_MSG(moelink_comm_init_from_nccl(ctx, NULL, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "nccl_comm is NULL", "init_from_nccl(NULL)");
  CHECK_MSG(moelink_comm_init_from_env(ctx, NULL), MOELINK_ERR_INVALID_ARGUMENT, "out is NULL",
            "init_from_env NULL out");
  CHECK_MSG(moelink_comm_init_from_env(NULL, &c), MOELINK_ERR_INVALID_ARGUMENT,
            "context is NULL", "init_from_env NULL context");
}

/* Runs init_from_env with one variable changed, then restores it. */
static void env_case(const char *var, const char *value, moelink_status_t want,
                     const char *needle) {
  char *saved = getenv(var) ? strdup(getenv(var)) : NULL;
  if (value)
    setenv(var, value, 1);
  else
    unsetenv(var);
  moelink_comm_t c = NULL;
  char what[160];
  if (value)
    snprintf(what, sizeof what, "init_from_env with %s='%.20s'", var, value);
  else
    snprintf(what, sizeof what, "init_from_env with %s unset", var);
  CHECK_MSG(moelink_comm_init_from_env(ctx, &c), want, needle, what);
  if (saved) {
    setenv(var, saved, 1);
    free(saved);
  } else {
    unsetenv(var);
  }
}

static void test_env(void) {
  env_case("MOELINK_RANK", NULL, MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_RANK is not set");
  env_case("MOELINK_RANK", "one", MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_RANK='one'");
  env_case("MOELINK_RANK", "2x", MOELINK_ERR_INVALID_ARGUMENT, "is not an integer");
  env_case("MOELINK_RANK", "-1", MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_RANK=-1");
  env_case("MOELINK_RANK", "8", MOELINK_ERR_INVALID_ARGUMENT, "out of range [0, MOELINK_WORLD");
  env_case("MOELINK_WORLD_SIZE", NULL, MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_WORLD_SIZE is");
  env_case("MOELINK_WORLD_SIZE", "0", MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_WORLD_SIZE=0");
  env_case("MOELINK_UNIQUE_ID", NULL, MOELINK_ERR_INVALID_ARGUMENT, "MOELINK_UNIQUE_ID is not");
  env_case("MOELINK_UNIQUE_ID", "12ab", MOELINK_ERR_INVALID_ARGUMENT,
           "MOELINK_UNIQUE_ID has 4 characters");
}

static void test_collective_args(void) {
  float a[64], b[64 * 8];
  memset(a, 0, sizeof a);
  memset(b, 0, sizeof b);
  const moelink_dtype_t f32 = MOELINK_DTYPE_F32;
  CHECK_MSG(moelink_allreduce(NULL, a, b, 4, f32, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "allreduce: communicator is NULL", "allreduce(NULL comm)");
  CHECK_MSG(moelink_allgather(comm, NULL, b, 4, f32, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "allgather: send is NULL", "allgather(NULL send)");
  CHECK_MSG(moelink_reduce_scatter(comm, a, NULL, 4, f32, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "reduce_scatter: recv is NULL", "reduce_scatter(NULL recv)");
  CHECK_MSG(moelink_allreduce(comm, a, b, 4, (moelink_dtype_t)42, NULL),
            MOELINK_ERR_INVALID_ARGUMENT, "dtype 42 is not a moelink_dtype_t", "unknown dtype");
  CHECK_MSG(moelink_allreduce(comm, a, b, 0, (moelink_dtype_t)42, NULL),
            MOELINK_ERR_INVALID_ARGUMENT, "dtype 42", "unknown dtype even with count 0");
  CHECK_MSG(moelink_allgather(comm, a, b, 4, MOELINK_DTYPE_FP8_E4M3, NULL),
            MOELINK_ERR_UNSUPPORTED, "fp8_e4m3 is not supported", "fp8 all-gather");
  CHECK_MSG(moelink_allreduce(comm, a, a + 1, 4, f32, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "overlap", "allreduce with send and recv overlapping by 3 elements");
  CHECK_MSG(moelink_allgather(comm, b, b, 4, f32, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "only allreduce runs in place", "allgather in place");
  CHECK_MSG(moelink_reduce_scatter(comm, b, b + 4 * nranks - 1, 4, f32, NULL),
            MOELINK_ERR_INVALID_ARGUMENT, "overlap",
            "reduce_scatter with recv over send's last element");
  CHECK_MSG(moelink_allreduce(comm, (char *)a + 2, b, 4, f32, NULL),
            MOELINK_ERR_INVALID_ARGUMENT, "not aligned", "misaligned f32 send");
  CHECK_MSG(moelink_allreduce(comm, a, (char *)b + 1, 4, MOELINK_DTYPE_BF16, NULL),
            MOELINK_ERR_INVALID_ARGUMENT, "recv", "misaligned bf16 recv");
  CHECK_MSG(moelink_allgather(comm, a, b, SIZE_MAX / 2, f32, NULL),
            MOELINK_ERR_INVALID_ARGUMENT, "overflows", "a count that overflows");
  CHECK_OK(moelink_allreduce(comm, NULL, NULL, 0, f32, NULL), "count 0 with NULL buffers");
  void *p = (void *)1;
  CHECK_MSG(moelink_symm_alloc(comm, 0, &p), MOELINK_ERR_INVALID_ARGUMENT, "bytes is 0",
            "symm_alloc of 0 bytes");
  CHECK_MSG(moelink_symm_alloc(comm, 8, NULL), MOELINK_ERR_INVALID_ARGUMENT, "ptr is NULL",
            "symm_alloc(NULL ptr)");
  p = (void *)1;
  CHECK_MSG(moelink_symm_alloc(NULL, 8, &p), MOELINK_ERR_INVALID_ARGUMENT,
            "communicator is NULL", "symm_alloc(NULL comm)");
  CHECK(p == NULL, "a failed symm_alloc sets *ptr to NULL");
  CHECK_MSG(moelink_symm_free(NULL, a), MOELINK_ERR_INVALID_ARGUMENT, "communicator is NULL",
            "symm_free(NULL comm)");
  CHECK_MSG(moelink_comm_check(NULL, NULL), MOELINK_ERR_INVALID_ARGUMENT,
            "communicator is NULL", "comm_check(NULL)");
  CHECK_OK(moelink_comm_check(comm, NULL), "comm_check after refused calls");

  /* In place is allowed for all-reduce; and everything still works. */
  for (int i = 0; i < 64; ++i) a[i] = (float)(rank + 1) * (float)i;
  CHECK_OK(moelink_allreduce(comm, a, a, 64, f32, NULL), "allreduce in place");
  int ok = 1;
  float tri = (float)(nranks * (nranks + 1) / 2);
  for (int i = 0; i < 64; ++i) ok &= a[i] == tri * (float)i;
  CHECK(ok, "in-place sum of (rank + 1) * i over %d ranks", nranks);
}

static void test_cuda_without_nccl(void) {
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.backend = MOELINK_BACKEND_CUDA;
  moelink_context_t cuda = NULL;
  if (moelink_context_create(&cc, &cuda) != MOELINK_SUCCESS) {
    ml_t_diag("no cuda context here: the cuda communicator's front-end paths are not tried");
    return;
  }
  moelink_unique_id_t id;
  moelink_status_t s = moelink_get_unique_id(cuda, &id);
  CHECK(s == MOELINK_SUCCESS ||
            (s == MOELINK_ERR_UNSUPPORTED && strstr(moelink_last_error(), "NCCL")),
        "get_unique_id on cuda: works, or says NCCL is missing (%s: %s)",
        moelink_status_string(s), moelink_last_error());
  moelink_context_destroy(cuda);
}

int main(void) {
  ct_start(&ctx, &comm);
  rank = moelink_comm_rank(comm);
  nranks = moelink_comm_size(comm);
  test_hex();
  test_unique_id();
  test_init_args();
  test_env();
  test_collective_args();
  test_cuda_without_nccl();
  CHECK_OK(moelink_comm_destroy(comm), "comm_destroy");
  moelink_context_destroy(ctx);
  return ml_test_done();
}
