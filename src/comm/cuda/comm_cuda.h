/* The CUDA/NCCL communicator: declarations shared by its C host side
 * (comm_cuda.c) and its CUDA files (devcomm.cu: NCCL's device-API objects,
 * which need NCCL's C++ device headers; collectives.cu: the kernels).
 *
 * Every rank owns one internal symmetric buffer (NCCL window), laid out the
 * same on every rank:
 *
 *   [0, 4 KiB)         control block (moelink_device.cuh: MOELINK_CTL_*)
 *   [4 KiB, 64 KiB)    signals: ML_CCU_SIG_STRIDE words per CTA index;
 *                      word [b * STRIDE + s] is written only by CTA b of
 *                      rank s (monotonic epochs)
 *   [64 KiB, ...)      staging: [parity 2][CTA ML_CCU_MAX_CTAS][source nranks]
 *                      slots of slot_bytes; rank s pushes into slot
 *                      [., b, s] of each peer
 *
 * plus, in ordinary device memory, one epoch counter per CTA index, which
 * every collective kernel reads at its start and writes back at its end (so
 * CUDA graph replays continue the sequence).
 *
 * What that asks of callers (as NCCL does): every rank issues the same
 * collectives of a communicator in the same order with the same sizes, and
 * one communicator's collectives never run concurrently (one stream, or
 * streams ordered by events; graph replays count as calls in that order). A
 * rank that breaks this gets timeouts, never a hang. */
#ifndef MOELINK_COMM_CUDA_H
#define MOELINK_COMM_CUDA_H

#include "comm/comm.h"
#include "moelink_device.cuh"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stddef.h>
#include <stdint.h>

#if defined(ML_NCCL_HEADER_CODE) && NCCL_VERSION_CODE != ML_NCCL_HEADER_CODE
#error "the compiler found another nccl.h than the one CMake chose (mixed NCCL installations)"
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define ML_CCU_MAX_RANKS MOELINK_DEVICE_MAX_RANKS
#define ML_CCU_THREADS 512
/* CTA indices the staging has room for (the layout never changes, so that
 * a CTA index owns the same slots in every call), and the default number of
 * CTAs a collective uses (MOELINK_COMM_MAX_CTAS, at most the former). */
#define ML_CCU_MAX_CTAS 128
#define ML_CCU_DEFAULT_CTAS 128
#define ML_CCU_SIG_STRIDE 16 /* >= ML_CCU_MAX_RANKS; one 128-byte line per CTA */
#define ML_CCU_CTL_OFFSET ((size_t)0)
#define ML_CCU_SIG_OFFSET ((size_t)4096)
#define ML_CCU_STAGE_OFFSET ((size_t)65536)
/* Bytes one CTA moves to one peer per round. */
#define ML_CCU_SLOT_BYTES ((size_t)64 << 10)
/* All-reduce switches from one-shot to two-shot above this many bytes
 * (MOELINK_COMM_ONESHOT_MAX_BYTES). */
#define ML_CCU_ONESHOT_MAX_DEFAULT ((size_t)512 << 10)

/* Primitive ids of the collectives' waits (moelink_device.cuh leaves
 * ids 16..255 to moelink). */
#define ML_CCU_PRIM_AR_ONESHOT 16
#define ML_CCU_PRIM_AR_RS 17
#define ML_CCU_PRIM_AR_AG 18
#define ML_CCU_PRIM_ALLGATHER 19
#define ML_CCU_PRIM_REDUCE_SCATTER 20
#define ML_CCU_PRIM_A2A_COUNTS 24 /* alltoallv: a peer's counts */
#define ML_CCU_PRIM_A2A_DATA 25   /* alltoallv: a peer's data */
/* Byte offset, in a rank's control block, of alltoall.cu's status words
 * (the first capacity or count error since moelink_comm_check last read
 * them; moelink_device.cuh's words sit at the start of the block). */
#define ML_CCU_A2A_STATUS ((size_t)2048)
#define ML_CCU_PRIM_AG_CE_READY 30   /* copy-engine all-gather: a peer's data */
#define ML_CCU_PRIM_AG_CE_RELEASE 31 /* copy-engine all-gather: a peer's release of staging */

/* All-gather engines (MOELINK_COMM_ALLGATHER, ml_comm_cuda_set_allgather). */
#define ML_CCU_AG_SM 0 /* collectives.cu's kernel */
#define ML_CCU_AG_CE 1 /* allgather_ce.c: copy engines */

/* The copy-engine all-gather's own symmetric buffer, made when that engine
 * is first selected (allgather_ce.c has the protocol):
 *   [0, 2 KiB)      ready words [source]: word s written only by rank s
 *   [2 KiB, 4 KiB)  released words [reader]: word p written only by rank p
 *   [4 KiB, ...)    staging: [source nranks] regions of `region` bytes
 * ML_CCU_CE_STAGE_BYTES of staging whatever the number of ranks. */
#define ML_CCU_CE_READY_OFFSET ((size_t)0)
#define ML_CCU_CE_RELEASED_OFFSET ((size_t)2048)
#define ML_CCU_CE_STAGE_OFFSET ((size_t)4096)
#define ML_CCU_CE_STAGE_BYTES ((size_t)64 << 20)

typedef struct ml_ccu_ce {
  char *stage[ML_CCU_MAX_RANKS];        /* each rank's staging regions */
  uint64_t *ready[ML_CCU_MAX_RANKS];    /* each rank's ready words */
  uint64_t *released[ML_CCU_MAX_RANKS]; /* each rank's released words */
  uint64_t *round;                      /* round counter, this rank's device memory */
  size_t region;                        /* bytes of one source's region (0: no buffer) */
} ml_ccu_ce;

/* The low-latency all-reduce (allreduce_ll.cu): messages up to this many
 * 4-byte words (MOELINK_COMM_LL_MAX_BYTES lowers it), at most this many CTAs. */
#define ML_CCU_LL_MAX_WORDS 16384
#define ML_CCU_LL_MAX_CTAS 16
#define ML_CCU_PRIM_AR_LL 21

/* Its state: each rank's cell buffer (symmetric, [2][nranks][max_words]
 * 8-byte cells), this rank's call count and CTA ticket, and the most CTAs a
 * call may take. The communicator's own uses ML_CCU_LL_MAX_WORDS and
 * ML_CCU_LL_MAX_CTAS; other users (src/tp/cuda/) size theirs. */
typedef struct ml_ccu_ll {
  uint64_t *cells[ML_CCU_MAX_RANKS];
  uint64_t *epoch;
  unsigned *ticket;
  size_t max_words;
  int max_ctas;
  /* Launch with programmatic stream serialization: the kernel is resident
   * while the previous kernel of the stream drains, and reads nothing before
   * that kernel is done (griddepcontrol.wait). */
  int pdl;
} ml_ccu_ll;

/* Bytes of a cell buffer for nranks ranks and max_words words. */
#define ML_CCU_LL_BYTES(nranks, max_words) ((size_t)2 * (size_t)(nranks) * (max_words) * 8)

/* Enqueues a low-latency all-reduce (count * size of dt <= 4 * ll->max_words). */
moelink_status_t ml_ccu_allreduce_ll(const ml_ccu_ll *ll, int rank, int nranks,
                                     const moelink_device_comm_t *dc, const void *send,
                                     void *recv, size_t count,
                                     moelink_dtype_t dt, cudaStream_t stream);

/* What a collective kernel needs to know about its communicator. */
typedef struct ml_ccu_coll {
  int rank, nranks;
  int alloc_ctas;                      /* CTA indices the staging is laid out for */
  int max_ctas;                        /* CTAs a collective may use (<= alloc_ctas) */
  size_t slot_bytes;                   /* ML_CCU_SLOT_BYTES */
  size_t oneshot_max;                  /* all-reduce bytes still done one-shot */
  int force_allreduce;                 /* 0 auto, 1 one-shot, 2 two-shot, 3 low-latency (tests) */
  char *stage[ML_CCU_MAX_RANKS];       /* each rank's staging area */
  uint64_t *sig[ML_CCU_MAX_RANKS];     /* each rank's signal area */
  uint64_t *epoch;                     /* [ML_CCU_MAX_CTAS], this rank's device memory */
  moelink_device_comm_t dc;            /* timeouts and control blocks */
  int allgather_engine;                /* ML_CCU_AG_SM or ML_CCU_AG_CE */
  ml_ccu_ce ce;                        /* set up once CE was selected */
  ml_ccu_ll ll;                        /* the low-latency all-reduce */
  size_t ll_max;                       /* bytes it takes (0: never) */
} ml_ccu_coll;

typedef enum { ML_CCU_ALLREDUCE = 0, ML_CCU_ALLGATHER = 1, ML_CCU_REDUCE_SCATTER = 2 } ml_ccu_op;

/* Bytes of the internal symmetric buffer for these sizes. */
size_t ml_ccu_internal_bytes(int nranks, int alloc_ctas);

/* Enqueues one collective on stream (count >= 1, arguments checked by the
 * front end). Never synchronizes; capturable. */
moelink_status_t ml_ccu_collective(const ml_ccu_coll *c, ml_ccu_op op, const void *send,
                                   void *recv, size_t count, moelink_dtype_t dtype,
                                   cudaStream_t stream);

/* ---- alltoall.cu ----------------------------------------------------------- */

/* Enqueues moelink_alltoallv (counts in device memory; arguments checked by
 * the front end). Never synchronizes; capturable. */
moelink_status_t ml_ccu_alltoallv(const ml_ccu_coll *c, const void *send,
                                  const int64_t *send_counts, const int64_t *send_offsets,
                                  void *recv, size_t recv_capacity, int64_t *recv_counts,
                                  int64_t *recv_offsets, moelink_dtype_t dtype,
                                  cudaStream_t stream);
/* After the stream was synchronized: the first error alltoallv recorded on
 * the device since the last report (INVALID_ARGUMENT with its message, and
 * the record cleared), or MOELINK_SUCCESS. */
moelink_status_t ml_ccu_alltoallv_report(const ml_ccu_coll *c);

/* ---- allgather_ce.c, allgather_ce_sync.cu: the copy-engine all-gather ---- */

/* Enqueues an all-gather of `bytes` per rank through the copy engines (the
 * front end checked the arguments; c->ce is set up). Capturable. */
moelink_status_t ml_ccu_allgather_ce(const ml_ccu_coll *c, const void *send, void *recv,
                                     size_t bytes, cudaStream_t stream);
/* One wait step of it: arrive 0 opens the next round, 1 waits for its data. */
moelink_status_t ml_ccu_ce_sync(const ml_ccu_coll *c, int arrive, cudaStream_t stream);

/* ---- devcomm.cu: NCCL device-API objects ---------------------------------- */

/* ncclDevCommCreate with `lsa_barriers` LSA barriers (collective); the
 * ncclDevComm stays behind *out. Reports the rank's LSA team. */
moelink_status_t ml_ccu_devcomm_create(ncclComm_t comm, int lsa_barriers, void **out,
                                       int *lsa_rank, int *lsa_size);
void ml_ccu_devcomm_destroy(ncclComm_t comm, void *devcomm);

/* The address of each LSA rank's copy of window win (offset 0), as this
 * process addresses it: host_out[p] for p < lsa_size. scratch: device memory
 * of lsa_size words. Synchronizes stream. */
moelink_status_t ml_ccu_window_bases(ncclWindow_t win, int lsa_size, uint64_t *scratch,
                                     uint64_t *host_out, cudaStream_t stream);

/* Whether every rank passed the same value (collective, a host round trip:
 * for setup calls such as a layer's create). */
moelink_status_t ml_comm_cuda_same(moelink_comm_t comm, uint64_t value, int *same);

/* ---- hooks for tests and benchmarks (hidden; static library only) -------- */

/* 0: choose by size, 1: always one-shot, 2: always two-shot, 3: low-latency
 * (allreduce_ll.cu) wherever the size allows it, chosen by size above. */
moelink_status_t ml_comm_cuda_force_allreduce(moelink_comm_t comm, int algorithm);

/* CTAs a collective may use, 1..ML_CCU_MAX_CTAS (every rank must set the
 * same value before the same call). */
moelink_status_t ml_comm_cuda_set_ctas(moelink_comm_t comm, int ctas);

/* All-gather engine: ML_CCU_AG_SM or ML_CCU_AG_CE (collective the first time
 * CE is chosen: it allocates the CE buffer; every rank must set the same
 * engine before the same call). UNSUPPORTED when the ranks do not share one
 * NVLink domain (their all-gather is NCCL's). */
moelink_status_t ml_comm_cuda_set_allgather(moelink_comm_t comm, int engine);

/* The NCCL communicator under a CUDA moelink communicator (NULL otherwise). */
ncclComm_t ml_comm_cuda_nccl(moelink_comm_t comm);

#ifdef __cplusplus
}
#endif

#endif
