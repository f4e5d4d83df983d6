/* PTX building blocks of the tile GEMM engine: asynchronous 16-byte copies
 * into shared memory, ldmatrix, the m16n8k16 tensor-core MMA and fp32 ->
 * 16-bit packing. Each is one instruction; they are wrapped so the engine
 * reads as the algorithm rather than as assembly.
 *
 * All wrappers that touch memory are asm volatile with a memory clobber:
 * a shared-memory slot is refilled every STAGES k-steps at the same address,
 * so the compiler must never merge or hoist two ldmatrix of one address. */
#ifndef MOELINK_CUDA_GEMM_PTX_CUH
#define MOELINK_CUDA_GEMM_PTX_CUH

#include "moelink.h"

#include <stdint.h>

static __device__ __forceinline__ uint32_t ml_smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, bypassing L1 (.cg: every tile element is used
 * once per CTA, so L1 would only hold dead lines). src_bytes is 16 or 0; 0
 * writes zeros and reads nothing, which is how rows past a tile and columns
 * past k become zero without a branch around the copy. */
static __device__ __forceinline__ void ml_cp_async16(uint32_t dst, const void *src,
                                                     int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

static __device__ __forceinline__ void ml_cp_async_commit(void) {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's committed groups are in flight. */
template <int N> static __device__ __forceinline__ void ml_cp_async_wait(void) {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* This thread's generic-proxy writes to shared memory ordered before later
 * async-proxy accesses (TMA, wgmma) of the CTA. */
static __device__ __forceinline__ void ml_fence_proxy_async(void) {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* *p += v at GPU scope with release semantics: this thread's earlier writes,
 * and those it synchronized with (a CTA or warp barrier before it), are
 * visible to whoever reads the sum with acquire. A release fence and the
 * add, without __threadfence's sequentially consistent fence and L1
 * invalidation. */
static __device__ __forceinline__ void ml_red_add_release_gpu(uint32_t *p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

/* The same with the old value back and acquire semantics too: the caller
 * also sees what the earlier adders released. */
static __device__ __forceinline__ uint32_t ml_atom_add_acq_rel_gpu(uint32_t *p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

/* The one thread's part of a ticket: an acquire-release arrival on t,
 * whether it made the count last + 1; that one puts t back to zero for the
 * next launch. */
static __device__ __forceinline__ bool ml_ticket_take(uint32_t *t, uint32_t last) {
  const bool mine = ml_atom_add_acq_rel_gpu(t, 1u) == last;
  if (mine)
    *t = 0u;
  return mine;
}

/* One CTA's arrival on ticket t, counted across the grid: whether it is the
 * one that makes the count last + 1. The CTA's stores so far are published
 * first (the barrier, then one acquire-release add by thread 0); the last
 * one also sees what the others published and puts the ticket back to zero
 * for the next launch. Every thread of the CTA calls it; flag: a shared
 * word. */
static __device__ __forceinline__ bool ml_cta_ticket(uint32_t *t, uint32_t last, int *flag) {
  __syncthreads();
  if (threadIdx.x == 0)
    *flag = ml_ticket_take(t, last);
  __syncthreads();
  return *flag != 0;
}

/* The GPU's global nanosecond timer (%globaltimer): measurement stamps and
 * wait deadlines. */
static __device__ __forceinline__ uint64_t ml_globaltimer(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

/* Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8. */
static __device__ __forceinline__ void ml_ldmatrix_x4(uint32_t addr, uint32_t r[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

/* c += a * b for one 16x8x16 step, fp32 accumulate. DT is MOELINK_DTYPE_BF16
 * or MOELINK_DTYPE_F16 (the operand format of a and b). */
template <int DT>
static __device__ __forceinline__ void ml_mma_16816(float c[4], const uint32_t a[4],
                                                    const uint32_t b[2]) {
  if constexpr (DT == MOELINK_DTYPE_BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

/* c += a * b for one 16x8x32 step of e4m3 operands, fp32 accumulate. The
 * fragments hold four 8-bit elements per register where the 16x8x16 step
 * holds two 16-bit ones, at the same byte positions, so the same ldmatrix
 * loads feed both. */
static __device__ __forceinline__ void ml_mma_16832_e4m3(float c[4], const uint32_t a[4],
                                                         const uint32_t b[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* 4 bytes global -> shared (through L1: small, reused values such as
 * scales); src_bytes 4 or 0 (0 writes zeros and reads nothing). */
static __device__ __forceinline__ void ml_cp_async4(uint32_t dst, const void *src,
                                                    int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

/* 8 bytes global -> shared through L1, the same way (the FP8 kernel's A
 * scales, two k blocks of a row); src_bytes 8, 4 or 0, the rest zeros. */
static __device__ __forceinline__ void ml_cp_async8(uint32_t dst, const void *src,
                                                    int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

/* Two fp32 values rounded to nearest even into one 32-bit word of two DT
 * elements, lo at the lower address. */
template <int DT>
static __device__ __forceinline__ uint32_t ml_pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (DT == MOELINK_DTYPE_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

#endif
