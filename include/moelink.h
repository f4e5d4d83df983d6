/*
 * moelink: Mixture-of-Experts layers and the collectives around them.
 *
 * Public C11 API. Every entry point returns a moelink_status_t; on failure
 * moelink_last_error() (thread-local) holds a one-line reason. The library
 * never prints, aborts or exits.
 *
 * Pointers handed to an object of the CUDA backend are device pointers; for
 * the CPU backend they are host pointers. Device work is stream-ordered: each
 * call that may run on the device takes the stream last (a cudaStream_t passed
 * as void *, NULL for the default stream; ignored by the CPU backend) and never
 * synchronizes the host.
 */
#ifndef MOELINK_H
#define MOELINK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MOELINK_BUILDING)
#define MOELINK_API __attribute__((visibility("default")))
#else
#define MOELINK_API
#endif

#define MOELINK_VERSION_MAJOR 0
#define MOELINK_VERSION_MINOR 1
#define MOELINK_VERSION_PATCH 0
/* One integer that grows with every release: major*10000 + minor*100 + patch. */
#define MOELINK_VERSION_CODE                                                   \
  (MOELINK_VERSION_MAJOR * 10000 + MOELINK_VERSION_MINOR * 100 +               \
   MOELINK_VERSION_PATCH)

/* ------------------------------------------------------------------------ */
/* Status                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum moelink_status {
  MOELINK_SUCCESS = 0,
  MOELINK_ERR_INVALID_ARGUMENT = 1, /* a NULL pointer, a size out of range */
  MOELINK_ERR_DTYPE_MISMATCH = 2,   /* dtypes that must agree do not */
  MOELINK_ERR_NOT_FOUND = 3,        /* unknown preset or name */
  MOELINK_ERR_INVALID_STATE = 4,    /* e.g. forward before set_weights */
  MOELINK_ERR_UNSUPPORTED = 5,      /* backend or feature not built/available */
  MOELINK_ERR_OUT_OF_MEMORY = 6,    /* host or device allocation failed */
  MOELINK_ERR_CUDA = 7,             /* a CUDA runtime call failed */
  MOELINK_ERR_NCCL = 8,             /* an NCCL call failed */
  MOELINK_ERR_TIMEOUT = 9,          /* a device-side wait timed out */
  MOELINK_ERR_INTERNAL = 10         /* a bug in moelink: please report it */
} moelink_status_t;

/* Static name of a status ("MOELINK_ERR_INVALID_ARGUMENT"); never NULL. */
MOELINK_API const char *moelink_status_string(moelink_status_t status);

/* The reason for the last failure on the calling thread, e.g.
 * "top_k 9 > num_experts 8". Empty string when none. The pointer stays valid
 * until the next moelink call on this thread. */
MOELINK_API const char *moelink_last_error(void);

/* Version of the library that is loaded, as "major.minor.patch". */
MOELINK_API const char *moelink_version(void);

/* MOELINK_VERSION_CODE of the library that is loaded (compare with the header's). */
MOELINK_API int moelink_version_code(void);

/* ------------------------------------------------------------------------ */
/* Data types                                                               */
/* ------------------------------------------------------------------------ */

typedef enum moelink_dtype {
  MOELINK_DTYPE_F32 = 0,
  MOELINK_DTYPE_BF16 = 1,
  MOELINK_DTYPE_F16 = 2,
  MOELINK_DTYPE_FP8_E4M3 = 3 /* reserved: rejected with MOELINK_ERR_UNSUPPORTED */
} moelink_dtype_t;

/* Bytes per element of a dtype; 0 for an unknown value. */
MOELINK_API size_t moelink_dtype_size(moelink_dtype_t dtype);

/* Static lower-case name ("bf16"); "unknown" for an unknown value. */
MOELINK_API const char *moelink_dtype_name(moelink_dtype_t dtype);

/* ------------------------------------------------------------------------ */
/* Context: a backend and a device                                          */
/* ------------------------------------------------------------------------ */

typedef enum moelink_backend {
  MOELINK_BACKEND_CPU = 0,
  MOELINK_BACKEND_CUDA = 1
} moelink_backend_t;

typedef struct moelink_context *moelink_context_t;

typedef struct moelink_context_config {
  size_t size;               /* sizeof(moelink_context_config_t): set by the INIT macro */
  moelink_backend_t backend; /* MOELINK_BACKEND_CPU or MOELINK_BACKEND_CUDA */
  int device;                /* CUDA device index (CUDA backend only) */
  int num_threads;           /* CPU worker threads; 0 = one per core */
} moelink_context_config_t;

#define MOELINK_CONTEXT_CONFIG_INIT                                            \
  { sizeof(moelink_context_config_t), MOELINK_BACKEND_CPU, 0, 0 }

/* Whether a backend was built into this library and can run here (for CUDA: a
 * device is visible). Returns 1 or 0; never fails. */
MOELINK_API int moelink_backend_available(moelink_backend_t backend);

/* Creates a context. cfg may be NULL for the defaults (CPU). Errors:
 * INVALID_ARGUMENT (NULL out, bad size field, unknown backend, negative
 * threads), UNSUPPORTED (backend not built in or no such device), CUDA. */
MOELINK_API moelink_status_t
moelink_context_create(const moelink_context_config_t *cfg, moelink_context_t *out);

/* Destroys a context. Objects created on it must be destroyed first. NULL is a
 * no-op that returns MOELINK_SUCCESS. */
MOELINK_API moelink_status_t moelink_context_destroy(moelink_context_t ctx);

/* The backend a context runs on (MOELINK_BACKEND_CPU for NULL). */
MOELINK_API moelink_backend_t moelink_context_backend(moelink_context_t ctx);

/* ------------------------------------------------------------------------ */
/* MoE configuration                                                        */
/* ------------------------------------------------------------------------ */

typedef enum moelink_router {
  /* p = softmax(logits) over all experts; top-k of p (+ correction bias, group
   * limit); weights are the selected p, renormalized to sum 1 if asked.
   * Mixtral, Qwen2-MoE, Qwen3-MoE. */
  MOELINK_ROUTER_SOFTMAX_TOPK = 0,
  /* s = sigmoid(logits); top-k of s (+ correction bias, group limit); weights
   * are the unbiased selected s, renormalized if asked. DeepSeek-V3. */
  MOELINK_ROUTER_SIGMOID_TOPK = 1,
  /* top-k of the raw logits (+ correction bias); weights = softmax over the k
   * selected logits (they sum to 1 by construction). gpt-oss style. */
  MOELINK_ROUTER_TOPK_SOFTMAX = 2
} moelink_router_t;

/*
 * A routed-expert layer. Shapes: x [T, H]; router weight [E, H]; gate+up
 * [E, 2*I, H] (the I gate rows of an expert first, then its I up rows); down
 * [E, H, I]; shared expert gate+up [2*Is, H], down [H, Is]; shared gate [H].
 * All weights and activations have the same dtype; accumulation is fp32.
 * Routing scores are fp32. Selection ties break toward the lower expert index.
 */
typedef struct moelink_moe_config {
  size_t size;            /* sizeof(moelink_moe_config_t): set by the INIT macro */
  int hidden;             /* H */
  int inter;              /* I: intermediate size of one routed expert */
  int num_experts;        /* E */
  int top_k;              /* k, 1 <= k <= E */
  moelink_router_t router;
  int renormalize;        /* 1: the k weights are divided by their sum */
  int n_group;            /* expert groups for group-limited selection (1 = off) */
  int topk_group;         /* groups kept; a group scores the sum of its top-2
                             biased scores; experts of other groups are -inf */
  float routed_scaling;   /* routed weights are multiplied by this (1.0 = off) */
  int correction_bias;    /* 1: weights carry an fp32 [E] bias added to the
                             scores for selection only */
  int shared_inter;       /* Is: shared expert intermediate size (0 = none);
                             several shared experts are one MLP of their summed
                             intermediate size */
  int shared_gate;        /* 1: shared output is scaled by sigmoid(x . w_g) */
  moelink_dtype_t dtype;  /* activations and weights */
  int max_tokens;         /* workspace is sized for this many tokens per call;
                             larger calls are processed in chunks of it */
  int fp8_experts;        /* 1: the routed experts' gate_up and down weights are
                             FP8, DeepSeek-V3's format: e4m3 bytes with one fp32
                             scale per 128 x 128 block (hidden and inter multiples
                             of 128); each expert's inputs (the token row, then
                             its SwiGLU output) are quantized per 128 elements on
                             the fly (moelink_quantize's FP8) and the products
                             summed in fp32. Router, shared expert, activations
                             and outputs stay in dtype. 0: experts in dtype */
  int fp8_shared;         /* 1: the shared expert's weights are FP8 in the same
                             format (shared_gate_up_scale, shared_down_scale;
                             hidden and shared_inter multiples of 128), its
                             inputs quantized the same way; needs shared_inter
                             > 0. Independent of fp8_experts. Not supported by
                             the expert-parallel layer (moelink_ep_*). 0: the
                             shared expert in dtype */
} moelink_moe_config_t;

#define MOELINK_MOE_CONFIG_INIT                                                                    \
  {                                                                                                \
    sizeof(moelink_moe_config_t), 0, 0, 0, 0, MOELINK_ROUTER_SOFTMAX_TOPK, 1, 1, 1, 1.0f, 0, 0, 0, \
        MOELINK_DTYPE_BF16, 1024, 0, 0                                                             \
  }

/* Number of named presets. */
MOELINK_API int moelink_preset_count(void);

/* Name of preset i (0 <= i < count), or NULL. */
MOELINK_API const char *moelink_preset_name(int i);

/* Fills the model fields of cfg (sizes, router, groups, scaling, shared
 * expert) from a named preset ("mixtral-8x7b", "deepseek-v3", ...); leaves
 * size, dtype and max_tokens as they are. Errors: INVALID_ARGUMENT (NULL),
 * NOT_FOUND (unknown name). */
MOELINK_API moelink_status_t moelink_moe_preset(const char *name, moelink_moe_config_t *cfg);

/* Checks a config without creating anything; the reason is in last_error. */
MOELINK_API moelink_status_t moelink_moe_config_check(const moelink_moe_config_t *cfg);

/* FLOPs of one forward over num_tokens tokens (router, routed experts, shared
 * expert; 2 per multiply-add). */
MOELINK_API double moelink_moe_flops(const moelink_moe_config_t *cfg, int num_tokens);

/* ------------------------------------------------------------------------ */
/* MoE layer                                                                */
/* ------------------------------------------------------------------------ */

typedef struct moelink_moe *moelink_moe_t;

/* Weights of a layer: caller-owned buffers, never copied; they must stay valid
 * and unchanged while forward calls that use them may run. Host pointers for
 * the CPU backend, device pointers for CUDA. */
typedef struct moelink_moe_weights {
  size_t size;                   /* sizeof(moelink_moe_weights_t) */
  moelink_dtype_t dtype;         /* dtype of the buffers below but the bias;
                                    must equal the layer's (DTYPE_MISMATCH) */
  const void *router;            /* [E, H] dtype */
  const float *correction_bias;  /* [E] fp32; required iff cfg.correction_bias */
  const void *gate_up;           /* [E, 2*I, H] dtype (fp8_experts: e4m3 bytes) */
  const void *down;              /* [E, H, I] dtype (fp8_experts: e4m3 bytes) */
  const void *shared_gate_up;    /* [2*Is, H] dtype; iff cfg.shared_inter > 0
                                    (fp8_shared: e4m3 bytes) */
  const void *shared_down;       /* [H, Is] dtype; iff cfg.shared_inter > 0
                                    (fp8_shared: e4m3 bytes) */
  const void *shared_gate;       /* [H] dtype; iff cfg.shared_gate */
  const float *gate_up_scale;    /* [E, 2*I/128, H/128] fp32; iff cfg.fp8_experts:
                                    weight [n, k] = e4m3 value * scale[n/128][k/128] */
  const float *down_scale;       /* [E, H/128, I/128] fp32; iff cfg.fp8_experts */
  const float *shared_gate_up_scale; /* [2*Is/128, H/128] fp32; iff cfg.fp8_shared */
  const float *shared_down_scale;    /* [H/128, Is/128] fp32; iff cfg.fp8_shared */
} moelink_moe_weights_t;

#define MOELINK_MOE_WEIGHTS_INIT                                                                   \
  {                                                                                                \
    sizeof(moelink_moe_weights_t), MOELINK_DTYPE_BF16, NULL, NULL, NULL, NULL, NULL, NULL, NULL,   \
        NULL, NULL, NULL, NULL                                                                     \
  }

/* Bytes of workspace a layer with this config allocates at create (host for
 * CPU, device for CUDA). Grows with max_tokens * top_k * (H + I). */
MOELINK_API moelink_status_t moelink_moe_workspace_size(moelink_context_t ctx,
                                                        const moelink_moe_config_t *cfg,
                                                        size_t *bytes);

/* Creates a layer on a context and allocates its workspace. Errors:
 * INVALID_ARGUMENT (bad config: the message names the field),
 * UNSUPPORTED (dtype not supported by the backend), OUT_OF_MEMORY, CUDA. */
MOELINK_API moelink_status_t moelink_moe_create(moelink_context_t ctx,
                                                const moelink_moe_config_t *cfg,
                                                moelink_moe_t *out);

/* Destroys a layer (NULL: no-op). Waits for nothing: the caller makes sure no
 * device work that uses it is still queued. */
MOELINK_API moelink_status_t moelink_moe_destroy(moelink_moe_t moe);

/* Binds weights (no copy). Errors: INVALID_ARGUMENT (a required pointer is
 * NULL, or a pointer is given that the config does not use), DTYPE_MISMATCH
 * (w->dtype is not the layer's dtype). */
MOELINK_API moelink_status_t moelink_moe_set_weights(moelink_moe_t moe,
                                                     const moelink_moe_weights_t *w);

/* The config a layer was created with. */
MOELINK_API moelink_status_t moelink_moe_get_config(moelink_moe_t moe, moelink_moe_config_t *cfg);

/* The whole layer: out[T, H] = sum over the k routed experts of
 * weight * expert(x) (+ shared expert), for x [T, H], both of the layer's
 * dtype. num_tokens may be 0 (nothing is touched) and may exceed max_tokens
 * (processed in chunks). x and out must not overlap. Deterministic: the same
 * inputs give bitwise the same output. On CUDA: stream-ordered, no host
 * synchronization, capturable in a CUDA graph. A layer's calls (this one
 * and the pieces) share its workspace: calls on one layer must not run at
 * the same time (one stream, or streams ordered by events; the same for
 * replays of graphs that captured them); use one layer object per
 * concurrent stream. Errors: INVALID_ARGUMENT, INVALID_STATE (no weights
 * set), CUDA. */
MOELINK_API moelink_status_t moelink_moe_forward(moelink_moe_t moe, const void *x,
                                                 int num_tokens, void *out, void *stream);

/* ------------------------------------------------------------------------ */
/* The pieces, for engines that own part of the pipeline                    */
/* ------------------------------------------------------------------------ */

/* Routing: for x [T, H] writes topk_ids [T, k] (int32, expert indices, in
 * decreasing order of selection score, ties to the lower index) and
 * topk_weights [T, k] (fp32, final weights: renormalized and scaled as the
 * config says). Needs the router weights (set_weights). */
MOELINK_API moelink_status_t moelink_moe_route(moelink_moe_t moe, const void *x, int num_tokens,
                                               int32_t *topk_ids, float *topk_weights,
                                               void *stream);

/*
 * A plan: the permutation of the T*k (token, slot) pairs into expert-major
 * order and the tile schedule over it, all int32 in one buffer of
 * moelink_plan_bytes() bytes that moelink_plan_view() cuts into arrays:
 *   expert_offsets [E+1]   rows of expert e are [offsets[e], offsets[e+1])
 *   sorted_pairs   [T*k]   row r of the permuted order holds pair t*k+j;
 *                          within an expert, pairs ascend; rows past
 *                          offsets[E] are unused
 *   pair_rows      [T*k]   the inverse: pair t*k+j sits at row pair_rows[t*k+j]
 *                          (-1 for an empty slot)
 *   tiles          [max_tiles*3]  (expert, first row, row count) per tile;
 *                          each tile has 1..tile_rows rows of one expert
 *   num_tiles      [1]
 * max_tiles = ceil(T*k / tile_rows) + E.
 */
typedef struct moelink_plan {
  int num_tokens, top_k, num_experts, tile_rows, max_tiles;
  int32_t *expert_offsets;
  int32_t *sorted_pairs;
  int32_t *pair_rows;
  int32_t *tiles;
  int32_t *num_tiles;
} moelink_plan_t;

/* Bytes of a plan buffer for these sizes (tile_rows >= 1). */
MOELINK_API size_t moelink_plan_bytes(int num_tokens, int top_k, int num_experts, int tile_rows);

/* Cuts a plan buffer (any pointer: host or device, aligned to 4) into arrays;
 * touches no memory. */
MOELINK_API moelink_status_t moelink_plan_view(void *buffer, int num_tokens, int top_k,
                                               int num_experts, int tile_rows,
                                               moelink_plan_t *plan);

/* Tile rows the layer's backend uses in its plans (the CPU uses 64). */
MOELINK_API int moelink_moe_tile_rows(moelink_moe_t moe);

/* Builds the plan for topk_ids [T, k] into plan_buffer (moelink_plan_bytes for
 * this T and the layer's tile rows). An id outside [0, E) (say -1) marks an
 * empty slot: the pair gets no row (pair_rows = -1), so expert_offsets[E] is
 * the number of valid pairs, and it contributes nothing to combine. */
MOELINK_API moelink_status_t moelink_moe_plan(moelink_moe_t moe, const int32_t *topk_ids,
                                              int num_tokens, void *plan_buffer, void *stream);

/* Routed experts: for each plan row r < offsets[E] holding pair p = t*k+j of expert e,
 * y[r] = w[p] * down_e(silu(gate_e(x[t])) * up_e(x[t])), y [T*k, H] of the
 * layer's dtype in permuted order. topk_weights may be NULL (w = 1). Needs
 * gate_up and down (set_weights). */
MOELINK_API moelink_status_t moelink_moe_experts(moelink_moe_t moe, const void *x, int num_tokens,
                                                 const void *plan_buffer,
                                                 const float *topk_weights, void *y,
                                                 void *stream);

/* Combine: out[t] = sum over j = 0..k-1, in that order, of y[pair_rows[t*k+j]]
 * (fp32 sums, one rounding; empty slots skipped). Deterministic. */
MOELINK_API moelink_status_t moelink_moe_combine(moelink_moe_t moe, const void *y, int num_tokens,
                                                 const void *plan_buffer, void *out,
                                                 void *stream);

/* ------------------------------------------------------------------------ */
/* Communicators, symmetric memory and collectives                          */
/* ------------------------------------------------------------------------ */

/* A group of ranks, one process each (one GPU each on CUDA; on CPU, processes
 * of one machine sharing POSIX shared memory). No call here ever waits
 * forever: device-side waits give up after MOELINK_COMM_TIMEOUT_MS and are
 * reported by moelink_comm_check as MOELINK_ERR_TIMEOUT. CPU ranks wait for
 * each other at init up to MOELINK_COMM_INIT_TIMEOUT_MS (default: the same
 * limit), for ranks that start far apart. */
typedef struct moelink_comm *moelink_comm_t;

/* Opaque bootstrap token made by rank 0 and handed to every rank. */
#define MOELINK_UNIQUE_ID_BYTES 128
typedef struct moelink_unique_id {
  unsigned char bytes[MOELINK_UNIQUE_ID_BYTES];
} moelink_unique_id_t;

/* Makes a unique id for a new communicator on ctx's backend (rank 0 calls it
 * and passes the id to the others by any means). */
MOELINK_API moelink_status_t moelink_get_unique_id(moelink_context_t ctx, moelink_unique_id_t *id);

/* Id <-> printable text (2*MOELINK_UNIQUE_ID_BYTES hex digits + NUL), as
 * `moelink launch` passes it in MOELINK_UNIQUE_ID. */
MOELINK_API moelink_status_t moelink_unique_id_to_hex(const moelink_unique_id_t *id, char *hex,
                                                      size_t hex_size);
MOELINK_API moelink_status_t moelink_unique_id_from_hex(const char *hex, moelink_unique_id_t *id);

/* Joins a communicator of nranks ranks as `rank` (collective: every rank must
 * call it with the same id). Errors: INVALID_ARGUMENT, TIMEOUT (peers never
 * came), NCCL, CUDA, OUT_OF_MEMORY. */
MOELINK_API moelink_status_t moelink_comm_init(moelink_context_t ctx, int rank, int nranks,
                                               const moelink_unique_id_t *id, moelink_comm_t *out);

/* moelink_comm_init with rank, size and id from the environment that
 * `moelink launch` sets: MOELINK_RANK, MOELINK_WORLD_SIZE, MOELINK_UNIQUE_ID. */
MOELINK_API moelink_status_t moelink_comm_init_from_env(moelink_context_t ctx, moelink_comm_t *out);

/* Wraps an existing ncclComm_t (passed as void *) of a CUDA context; the
 * caller keeps ownership of it. UNSUPPORTED on the CPU backend. */
MOELINK_API moelink_status_t moelink_comm_init_from_nccl(moelink_context_t ctx, void *nccl_comm,
                                                         moelink_comm_t *out);

/* Leaves and frees a communicator (collective). NULL: no-op. */
MOELINK_API moelink_status_t moelink_comm_destroy(moelink_comm_t comm);

MOELINK_API int moelink_comm_rank(moelink_comm_t comm);
MOELINK_API int moelink_comm_size(moelink_comm_t comm);

/* Waits for the communicator's queued work on `stream` (synchronizes the
 * host) and reports a device-side wait that timed out as MOELINK_ERR_TIMEOUT,
 * naming the rank, the primitive and the value awaited. */
MOELINK_API moelink_status_t moelink_comm_check(moelink_comm_t comm, void *stream);

/* Symmetric memory: every rank allocates the same size, in the same order
 * (collective); each rank's buffer is addressable by its peers (device
 * primitives, moelink_device.cuh). */
MOELINK_API moelink_status_t moelink_symm_alloc(moelink_comm_t comm, size_t bytes, void **ptr);
MOELINK_API moelink_status_t moelink_symm_free(moelink_comm_t comm, void *ptr);

/* Collectives (sum), stream-ordered, graph-capturable on CUDA; f32, bf16,
 * f16 with fp32 accumulation. Buffers are ordinary memory of the backend;
 * counts are elements. in-place (send == recv) is allowed for all-reduce.
 *   allreduce:      recv[i] = sum over ranks of send[i], i < count
 *   allgather:      recv[r*count + i] = send_of_rank_r[i]
 *   reduce_scatter: recv[i] = sum over ranks of send[rank*count + i]        */
MOELINK_API moelink_status_t moelink_allreduce(moelink_comm_t comm, const void *send, void *recv,
                                               size_t count, moelink_dtype_t dtype, void *stream);
MOELINK_API moelink_status_t moelink_allgather(moelink_comm_t comm, const void *send, void *recv,
                                               size_t count, moelink_dtype_t dtype, void *stream);
MOELINK_API moelink_status_t moelink_reduce_scatter(moelink_comm_t comm, const void *send,
                                                    void *recv, size_t count,
                                                    moelink_dtype_t dtype, void *stream);

/* All-to-all with per-peer counts (expert-parallel dispatch and combine): a
 * bitwise copy, f32, bf16, f16. The count arrays live where the data lives:
 * device memory on CUDA (written by earlier kernels on the stream: the call
 * reads them on the device, never synchronizes, and is graph-capturable;
 * host memory is rejected), host memory on CPU. Each array has one int64_t
 * element count per rank:
 *   send_counts[p]   elements this rank sends to rank p (>= 0), read from
 *                    send + send_offsets[p] (send_offsets NULL: packed in rank
 *                    order, the exclusive prefix sums of send_counts);
 *   recv_counts[p]   (output) elements that came from rank p: its
 *                    send_counts[this rank];
 *   recv_offsets[p]  (output, may be NULL) where they start in recv: the data
 *                    arrives packed in source-rank order, each peer's
 *                    elements in the order it sent them, so recv_offsets
 *                    is the exclusive prefix sum of recv_counts.
 * recv holds recv_capacity elements. Incoming elements that would land at or
 * past recv_capacity are dropped, never written; recv_counts and recv_offsets
 * still give the full counts (a kernel can compare their sum with the
 * capacity), and the rank reports MOELINK_ERR_INVALID_ARGUMENT ("received N
 * elements, capacity C"): on CPU from this call, on CUDA from the next
 * moelink_comm_check. A negative count or offset is sent as a count of 0 and
 * reported the same way by the rank that passed it. Either report leaves the
 * communicator usable (every rank completes the exchange). The ranges
 * send + send_offsets[p] .. + send_counts[p] are the caller's to keep inside
 * send. No in place: send must not lie inside recv, and the output arrays
 * must not overlap the input arrays or each other. send must not be NULL;
 * recv may be NULL only with recv_capacity 0. Every rank must call it (a
 * collective, in the same order as the others), whatever its counts. On
 * CUDA it needs every rank in one NVLink domain (else UNSUPPORTED). */
MOELINK_API moelink_status_t moelink_alltoallv(moelink_comm_t comm, const void *send,
                                               const int64_t *send_counts,
                                               const int64_t *send_offsets, void *recv,
                                               size_t recv_capacity, int64_t *recv_counts,
                                               int64_t *recv_offsets, moelink_dtype_t dtype,
                                               void *stream);

/* ------------------------------------------------------------------------ */
/* Tensor-parallel GEMMs fused with their collective                        */
/* ------------------------------------------------------------------------ */

/* The three GEMMs of a tensor-parallel dense layer, each fused with the
 * collective around it, over the ranks of a communicator. Matrices are
 * row-major and contiguous; B is a linear layer's weight [n, k] (out = a b^T).
 * Every rank calls the same op with the same m, n, k (a collective). The GEMM
 * accumulates in fp32 and rounds its partial result to the dtype; partials are
 * summed over ranks in rank order 0..n-1 in fp32 and rounded once, so every
 * rank gets bitwise the same C, run after run (the same numbers as "GEMM, then
 * the dtype's collective" computes). m = 0 does nothing; n, k >= 1; c must
 * not overlap a or b. Stream-ordered, graph-capturable on CUDA. On CUDA the
 * ranks must share one NVLink domain, and shapes with n or k not a multiple
 * of 8 run on a slow fallback GEMM. */
typedef struct moelink_tp *moelink_tp_t;

typedef struct moelink_tp_config {
  size_t size;           /* sizeof(moelink_tp_config_t) */
  moelink_dtype_t dtype; /* of a, b and c: BF16 or F16 (F32 on the CPU backend too) */
  int max_m;             /* the largest m a call may pass (all ranks' rows together) */
  int max_n;             /* the largest n */
  int max_k;             /* the largest k (ag_gemm: the full k; gemm_rs/ar: this rank's slice) */
  int comm_ctas;         /* CTAs communication kernels may take; 0: the measured default */
} moelink_tp_config_t;

#define MOELINK_TP_CONFIG_INIT {sizeof(moelink_tp_config_t), MOELINK_DTYPE_BF16, 0, 0, 0, 0}

/* Bytes of workspace (symmetric memory on CUDA, per rank) moelink_tp_create
 * allocates for cfg on comm. */
MOELINK_API moelink_status_t moelink_tp_workspace_size(moelink_comm_t comm,
                                                       const moelink_tp_config_t *cfg,
                                                       size_t *bytes);

/* Creates the fused ops' state for cfg on comm (collective: every rank, same
 * cfg, same order as other symmetric allocations). Errors: INVALID_ARGUMENT
 * (sizes < 1, dtype), UNSUPPORTED (F32 on CUDA), OUT_OF_MEMORY, CUDA, NCCL. */
MOELINK_API moelink_status_t moelink_tp_create(moelink_comm_t comm, const moelink_tp_config_t *cfg,
                                               moelink_tp_t *out);

/* Frees it (collective). NULL: no-op. The communicator must outlive it. */
MOELINK_API moelink_status_t moelink_tp_destroy(moelink_tp_t tp);

/* All-gather + GEMM (column-parallel layer): a [m / nranks, k] holds this
 * rank's rows (rank r: rows r*m/nranks ..), b [n, k]; c [m, n] = A b^T with A
 * the [m, k] rows of all ranks. m % nranks == 0. */
MOELINK_API moelink_status_t moelink_ag_gemm(moelink_tp_t tp, const void *a, const void *b,
                                             void *c, int m, int n, int k, void *stream);

/* GEMM + reduce-scatter (row-parallel layer): a [m, k] and b [n, k] are this
 * rank's slices of the reduction dimension; c [m / nranks, n] = rows
 * rank*m/nranks .. of the sum over ranks of a b^T. m % nranks == 0. */
MOELINK_API moelink_status_t moelink_gemm_rs(moelink_tp_t tp, const void *a, const void *b,
                                             void *c, int m, int n, int k, void *stream);

/* GEMM + all-reduce: a [m, k], b [n, k] as in moelink_gemm_rs; c [m, n] = the
 * sum over ranks of a b^T, on every rank. */
MOELINK_API moelink_status_t moelink_gemm_ar(moelink_tp_t tp, const void *a, const void *b,
                                             void *c, int m, int n, int k, void *stream);

/* ------------------------------------------------------------------------ */
/* 8-bit row formats                                                        */
/* ------------------------------------------------------------------------ */

/* Token rows as E4M3 bytes (the "fn" variant: largest finite 448, no
 * infinities) plus a scale per block of a row:
 *   FP8    one fp32 scale per 128 elements (DeepSeek-V3's activations):
 *          s = amax / 448 in fp32 (amax: the block's largest |x|, NaN
 *          ignored), element e4m3(x / s); s = 0 (amax 0, or below ~6e-43):
 *          elements 0. An infinite element makes s infinite: the block's
 *          other elements become 0 (and the infinite one NaN);
 *   MXFP8  one e8m0 byte per 32 elements (OCP MX): X = floor(log2(amax)) - 8
 *          clamped to [-127, 127] (amax 0: X = 0; infinite: X = 120), byte
 *          X + 127, element e4m3(x * 2^-X).
 * e4m3() rounds to nearest even and saturates to +-448, infinities included;
 * every NaN becomes the code 0x7f. A dequantized element is its e4m3 value
 * times the block's scale, in fp32, rounded once to the dtype (an e8m0 byte
 * 255, never written here, is an infinite scale). Every backend writes the
 * same bytes, scales and values (a NaN's bit pattern aside). */
typedef enum moelink_quant {
  MOELINK_QUANT_NONE = 0,
  MOELINK_QUANT_FP8 = 1,
  MOELINK_QUANT_MXFP8 = 2
} moelink_quant_t;

/* Elements per scale block (128 or 32; 0 for NONE or an unknown value). */
MOELINK_API int moelink_quant_block(moelink_quant_t format);

/* Bytes of one row's scales for cols elements: cols / 128 * 4 (FP8) or
 * cols / 32 (MXFP8); 0 for NONE or an unknown format. */
MOELINK_API size_t moelink_quant_scale_bytes(moelink_quant_t format, int cols);

/* x [rows, cols] of dtype (F32, BF16, F16) into q [rows, cols] (e4m3 bytes)
 * and scales [rows][moelink_quant_scale_bytes] (fp32 or e8m0), as above.
 * cols a positive multiple of the block; memory of ctx's backend; on CUDA
 * stream-ordered, 16-byte aligned pointers. Errors: INVALID_ARGUMENT (NULL,
 * sizes, format NONE), UNSUPPORTED (dtype). */
MOELINK_API moelink_status_t moelink_quantize(moelink_context_t ctx, moelink_quant_t format,
                                              moelink_dtype_t dtype, const void *x, int rows,
                                              int cols, uint8_t *q, void *scales, void *stream);

/* The inverse: x [rows, cols] of dtype = e4m3 value * scale, rounded once to
 * dtype. Same arguments and errors as moelink_quantize. */
MOELINK_API moelink_status_t moelink_dequantize(moelink_context_t ctx, moelink_quant_t format,
                                                moelink_dtype_t dtype, const uint8_t *q,
                                                const void *scales, int rows, int cols, void *x,
                                                void *stream);

/* ------------------------------------------------------------------------ */
/* Expert parallelism                                                       */
/* ------------------------------------------------------------------------ */

/* An expert-parallel layer: the routed experts of one MoE layer split evenly
 * over the ranks of a communicator (rank r owns experts
 * [r*E/n, (r+1)*E/n), E = moe.num_experts, n ranks), everything else
 * (router, correction bias, shared expert) replicated. Each rank passes its
 * own tokens; a forward routes them locally, sends each token once to every
 * rank that owns at least one of its k experts (with its routing weights and
 * expert ids), runs the local experts on what arrived, sends the weighted
 * expert outputs back, and the token's own rank adds its k contributions in
 * slot order j = 0..k-1 in fp32, plus the shared expert, and rounds once:
 * the sums the single-rank layer (moelink_moe_forward on all ranks' tokens
 * concatenated in rank order, same weights) does, in the same order.
 *
 * Memory is fixed at create and never depends on the token count or on how
 * the tokens route: a rank receives at most recv_capacity token rows per
 * round; more go through in further rounds, and more than moe.max_tokens
 * tokens on a rank in further steps. All ranks run the same rounds, so a
 * call on which every token picks one rank's experts is slower, never larger
 * or failed. */
typedef struct moelink_ep *moelink_ep_t;

typedef struct moelink_ep_config {
  size_t size;              /* sizeof(moelink_ep_config_t): set by the INIT macro */
  moelink_moe_config_t moe; /* the whole layer (E = all experts of all ranks); its
                               max_tokens bounds the tokens a rank handles per
                               step (a forward of more takes several steps) */
  int recv_capacity;        /* token rows a rank receives per round (>= 1);
                               0: on CUDA ranks ranks * moe.max_tokens (every
                               source's whole step: one round, capturable), on
                               CPU ranks moe.max_tokens * min(ranks, top_k),
                               about one round per step with balanced routing.
                               CUDA ranks below ranks * max_tokens run rounds
                               (see moelink_ep_create) */
  moelink_quant_t dispatch_quant; /* how token rows travel to the experts' ranks:
                               MOELINK_QUANT_NONE (moe.dtype, the default), or
                               FP8 / MXFP8 (moelink_quantize's formats; hidden a
                               multiple of the block): the routed experts then
                               compute on moelink_dequantize(moelink_quantize(x))
                               rounded to moe.dtype, every rank alike (its own
                               tokens too); routing and the shared expert use x */
  int call_tokens;          /* the most tokens a rank passes to one forward
                               (>= 0; 0: moe.max_tokens). On CUDA every forward
                               runs ceil(call_tokens / moe.max_tokens) steps on
                               every rank (a rank out of tokens takes part with
                               none), so that the ranks agree on the steps with
                               no host round trip; more tokens than call_tokens
                               is a bad argument there. CPU ranks agree on the
                               steps by themselves: any count, whatever this is */
} moelink_ep_config_t;

#define MOELINK_EP_CONFIG_INIT                                                 \
  { sizeof(moelink_ep_config_t), MOELINK_MOE_CONFIG_INIT, 0, MOELINK_QUANT_NONE, 0 }

/* Bytes one rank allocates for cfg on comm at create (host memory plus
 * symmetric memory on CPU ranks; device and symmetric memory on CUDA): a
 * function of the config and the rank count alone. Errors as
 * moelink_ep_create's argument checks. */
MOELINK_API moelink_status_t moelink_ep_workspace_size(moelink_comm_t comm,
                                                       const moelink_ep_config_t *cfg,
                                                       size_t *bytes);

/* Creates an expert-parallel layer on comm (collective: every rank, the same
 * cfg, in the same order as other symmetric allocations; ranks that pass
 * different configs all fail). Errors: INVALID_ARGUMENT (NULL, bad size
 * field, a bad moe config: the message names the field, num_experts not a
 * multiple of the rank count, recv_capacity or call_tokens < 0), UNSUPPORTED (no
 * expert-parallel ops for the communicator's backend in this build: CUDA
 * needs the NCCL communicator and all ranks in one NVLink domain; moe.dtype
 * FP8_E4M3: the layer computes in bf16 or f16, FP8 weights are fp8_experts),
 * OUT_OF_MEMORY, TIMEOUT (a peer never came). On CUDA ranks a recv_capacity
 * of ranks * moe.max_tokens (the default) receives every source's whole step
 * at once; a smaller one runs each step in rounds by expert: the pairs
 * (token, expert) of each receiving rank are ordered by its local expert,
 * then source, then token, and round r moves pairs [r * R, (r + 1) * R) of
 * that order (a token with experts in several rounds travels once per
 * round), so each expert's weights stream about once a step; R is
 * recv_capacity / P with P rounds in flight at a time on P streams
 * (MOELINK_EP_ROUND_PIPES, docs/ENV.md: P = 2 by default, at most one a
 * row). A step then learns its number of rounds on the host (one
 * synchronization): forward is not capturable there (UNSUPPORTED while the
 * stream captures), and moelink_ep_dispatch refuses (UNSUPPORTED, on every
 * rank) pairs that need more than one round. */
MOELINK_API moelink_status_t moelink_ep_create(moelink_comm_t comm, const moelink_ep_config_t *cfg,
                                               moelink_ep_t *out);

/* Frees it (collective). NULL: no-op. The communicator must outlive it, and
 * no call that uses it may still run. */
MOELINK_API moelink_status_t moelink_ep_destroy(moelink_ep_t ep);

/* The config it was created with (recv_capacity and call_tokens resolved),
 * this rank's first expert and its number of experts (E / ranks). Any output
 * may be NULL. */
MOELINK_API moelink_status_t moelink_ep_get_config(moelink_ep_t ep, moelink_ep_config_t *cfg,
                                                   int *first_expert, int *local_experts);

/* Binds this rank's weights (no copy; they must stay valid and unchanged
 * while forward calls may run). Shapes, with El = E / ranks local experts:
 *   router [E, H], correction_bias [E], shared_gate_up [2*Is, H],
 *   shared_down [H, Is], shared_gate [H]: the whole layer's, the same on
 *   every rank;
 *   gate_up [El, 2*I, H] and down [El, H, I]: experts first_expert ..
 *   first_expert + El - 1 only (the slices at offsets first_expert*2*I*H and
 *   first_expert*H*I of the full tensors), and with moe.fp8_experts their
 *   scales likewise (gate_up_scale [El, 2*I/128, H/128], down_scale
 *   [El, H/128, I/128]).
 * A pointer is required exactly when the config uses it. Errors:
 * INVALID_ARGUMENT (NULL, bad size field, a pointer missing or one the config
 * does not use), DTYPE_MISMATCH (w->dtype is not moe.dtype). Not collective. */
MOELINK_API moelink_status_t moelink_ep_set_weights(moelink_ep_t ep,
                                                    const moelink_moe_weights_t *w);

/* The routed layer over all ranks (collective: every rank calls it, the same
 * number of times, each with its own tokens): out[T, H] for this rank's
 * x[T, H], both of moe.dtype, T = num_tokens >= 0 and free to differ between
 * ranks (0 included: the rank still serves its experts). Any T runs in fixed
 * memory (steps of moe.max_tokens tokens, rounds of recv_capacity received
 * rows). x and out must not overlap. Deterministic: the same inputs on every
 * rank give bitwise the same output. On CUDA: stream-ordered, no host
 * synchronization, graph-capturable (with recv_capacity below ranks *
 * max_tokens: one synchronization a step, not capturable), and num_tokens <=
 * call_tokens (the
 * config's; every call runs ceil(call_tokens / moe.max_tokens) steps, the
 * same on every rank, each a full exchange: size call_tokens to the largest
 * batch, since a small one pays for every step). A rank whose own arguments
 * are bad (NULL x or out with T > 0, overlap, T < 0, on CUDA T > call_tokens)
 * still takes part with no tokens, so its peers finish, and then reports
 * INVALID_ARGUMENT. Errors: INVALID_ARGUMENT, INVALID_STATE
 * (no weights set on this rank: it does not take part and its peers report
 * TIMEOUT), TIMEOUT (a peer did not take part, or died: names the rank and
 * what was awaited), UNSUPPORTED. */
MOELINK_API moelink_status_t moelink_ep_forward(moelink_ep_t ep, const void *x, int num_tokens,
                                                void *out, void *stream);

/* The two exchanges of moelink_ep_forward as pieces, for engines that run
 * their own experts (or their own routing) between them: dispatch sends each
 * token once to every rank that owns one of its experts; this rank's experts
 * process what arrived (the rows below); combine sends the expert outputs
 * back and adds each token's k contributions on its own rank.
 *
 * Where a dispatch left this rank's received rows: memory of the layer
 * (device memory on CUDA, host memory on CPU), valid until the next combine
 * returns. A row r < capacity holds a token if some expert_ids[r][q] >= 0;
 * its local slots q = 0..top_k-1 list, in the source token's slot order, the
 * local expert ids (0 .. E/ranks - 1: expert first_expert + id) and routing
 * weights of that token's experts on this rank, then -1 and 0. Rows that
 * hold no token have only -1 (moelink_moe_plan drops them). */
typedef struct moelink_ep_recv {
  size_t size;               /* sizeof(moelink_ep_recv_t): set by the INIT macro */
  int capacity;              /* rows (CUDA: min(recv_capacity, ranks * max_tokens);
                                CPU: recv_capacity) */
  int top_k;                 /* local slots per row: min(k, E / ranks) */
  const void *rows;          /* [capacity][H] token rows, layer dtype */
  const int32_t *expert_ids; /* [capacity][top_k] */
  const float *weights;      /* [capacity][top_k] */
} moelink_ep_recv_t;

#define MOELINK_EP_RECV_INIT { sizeof(moelink_ep_recv_t), 0, 0, NULL, NULL, NULL }

/* Dispatch (collective: every rank calls it, then combine, the same number of
 * times): sends this rank's x [T, H] (moe.dtype) by its routing, topk_ids
 * [T, k] (int32 global expert ids, distinct within a token; an id outside
 * [0, E) is an empty slot) and topk_weights [T, k] (fp32), as
 * moelink_moe_route writes them, and fills
 * *recv with what this rank received. T = num_tokens in [0, moe.max_tokens],
 * free to differ between ranks. Needs no weights. On CUDA: stream-ordered,
 * graph-capturable, no host synchronization; every pointer device memory
 * (with recv_capacity below ranks * max_tokens: one synchronization, not
 * capturable, and when the ranks' pairs need more than one round every rank
 * returns UNSUPPORTED, nothing sent). On
 * CPU ranks every rank's incoming rows must fit recv_capacity: when one
 * rank's would not, every rank returns UNSUPPORTED (nothing is sent;
 * moelink_ep_forward takes any count in rounds); CPU ranks also refuse so,
 * on every rank, repeated ids that a received row cannot hold (CUDA does not
 * check for repeats). A combine must follow every dispatch that returned
 * SUCCESS or INVALID_ARGUMENT, and no other. Errors: INVALID_ARGUMENT (this
 * rank's own arguments: it still takes part with no tokens of its own, so
 * its peers finish; *recv, when usable, still lists the rows it received for
 * its experts, and with recv NULL or of a bad size its combine sends zeros
 * for them), INVALID_STATE (a dispatch without its combine, on this rank:
 * nothing is sent), TIMEOUT, UNSUPPORTED. */
MOELINK_API moelink_status_t moelink_ep_dispatch(moelink_ep_t ep, const void *x,
                                                 const int32_t *topk_ids,
                                                 const float *topk_weights, int num_tokens,
                                                 moelink_ep_recv_t *recv, void *stream);

/* moelink_ep_dispatch of rows already quantized (the layer's dispatch_quant
 * must be FP8 or MXFP8): xq [T, H] and scales [T][moelink_quant_scale_bytes]
 * as moelink_quantize writes them for the same format. Each rank receives
 * bitwise what moelink_ep_dispatch of the original x would give it; a rank may
 * use either call while its peers use the other. Errors as
 * moelink_ep_dispatch (dispatch_quant NONE is a bad argument: the rank takes
 * part with no tokens). */
MOELINK_API moelink_status_t moelink_ep_dispatch_quantized(moelink_ep_t ep, const uint8_t *xq,
                                                           const void *scales,
                                                           const int32_t *topk_ids,
                                                           const float *topk_weights,
                                                           int num_tokens,
                                                           moelink_ep_recv_t *recv, void *stream);

/* Combine (collective, after every dispatch): y holds this rank's expert
 * outputs, one row of H (moe.dtype) per valid (received row r, local slot q),
 * already multiplied by its routing weight, at row pair_rows[r * top_k + q]
 * (pair_rows NULL: at row r * top_k + q), e.g. moelink_moe_experts' output
 * with the plan's pair_rows. Each goes back to its token's rank, which writes
 * out [T, H] (the T of its dispatch) = the sum over the token's slots j =
 * 0..k-1, in that order, in fp32, rounded once: deterministic. No shared
 * expert (moelink_ep_forward adds it). Errors: INVALID_ARGUMENT (y NULL, or
 * out NULL with T > 0: the rank still takes part, so none of its peers
 * hangs, and sends zeros for the outputs of its experts), INVALID_STATE (no
 * dispatch before it), TIMEOUT. */
MOELINK_API moelink_status_t moelink_ep_combine(moelink_ep_t ep, const void *y,
                                                const int32_t *pair_rows, void *out,
                                                void *stream);

/* ------------------------------------------------------------------------ */
/* Utilities                                                                */
/* ------------------------------------------------------------------------ */

/* Fills n elements of dtype at ptr (host for CPU, device for CUDA) with
 * offset + scale * u, u uniform in [-1, 1): a counter-based generator, so
 * element i depends only on (seed, i) and every backend writes the same
 * values. For tests and benchmarks. Stream-ordered on CUDA. */
MOELINK_API moelink_status_t moelink_fill_random(moelink_context_t ctx, moelink_dtype_t dtype,
                                                 void *ptr, size_t n, uint64_t seed,
                                                 float scale, float offset, void *stream);

/* The value moelink_fill_random writes at index i, in fp32 before rounding
 * to the dtype: offset + scale * u(seed, i). */
MOELINK_API float moelink_random_value(uint64_t seed, size_t i, float scale, float offset);

#ifdef __cplusplus
}
#endif

#endif /* MOELINK_H */
