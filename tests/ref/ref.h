/* The naive reference and the test-data generator. Used only by the tests,
 * the CLI's --verify and benchmarks; never linked into libmoelink.
 *
 * The reference is written independently of the backends: it reads the
 * layer's weights element by element in their dtype (its own conversions),
 * computes everything in double, one token at a time, straight from the
 * model semantics in DESIGN.md section 2. It is slow on purpose. */
#ifndef MOELINK_REF_H
#define MOELINK_REF_H

#include "moelink.h"

#include <stddef.h>
#include <stdint.h>

/* Element i of a buffer of dtype, as a double (own conversion code). */
double ref_load(moelink_dtype_t dtype, const void *p, size_t i);

/* Router of one token: selection (ids, decreasing selection score, ties to
 * the lower index) and final weights (renormalized, scaled). w holds host
 * pointers of cfg->dtype. Returns 0, or -1 on a config it cannot handle. */
int ref_route_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                    const void *x_row, int32_t *ids, double *weights);

/* One routed expert e on one token: out[H] = down_e(silu(gate_e x) * up_e x).
 * With cfg->fp8_experts, w->gate_up / w->down hold e4m3 bytes and
 * w->gate_up_scale / w->down_scale one fp32 scale per 128 x 128 block
 * (weight = byte value * scale), and x and the SwiGLU output are replaced by
 * dequantize(quantize(.)) per 128 elements (s = amax / 448 in fp32, e4m3 of
 * x / s rounded to nearest even, saturating) before their products. */
void ref_expert_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w, int e,
                      const void *x_row, double *out);

/* The shared expert (with its sigmoid gate if cfg->shared_gate) on one
 * token: out[H]; zeros when cfg->shared_inter == 0. With cfg->fp8_shared its
 * weights are FP8 as ref_expert_token's (the gate reads x itself). */
void ref_shared_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                      const void *x_row, double *out);

/* The whole layer on one token: out[H]. Returns 0 or -1 like ref_route_token. */
int ref_forward_token(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                      const void *x_row, double *out);

/* fp32 -> e4m3fn byte (round to nearest even, saturating at +-448, NaN as
 * 0x7f): the reference's own encoder, for tests that quantize weights. */
uint8_t ref_e4m3_encode(float f);
/* One [rows, cols] matrix of dtype (rows, cols multiples of 128) as e4m3
 * bytes q [rows, cols] and fp32 scales sc [rows/128, cols/128], per 128 x 128
 * block: s = amax / 448 (fp32), q = e4m3(w / s) (0 where s is 0). */
void ref_fp8_quantize(moelink_dtype_t dtype, const void *w, int rows, int cols, uint8_t *q,
                      float *sc);

/* Relative L2 error ||got - ref|| / ||ref|| over n elements (got in dtype);
 * NaN or Inf in got gives +Inf. ref all zeros: returns ||got||. */
double ref_rel_l2(moelink_dtype_t dtype, const void *got, const double *ref, size_t n);

/* Stores v at element i of a dtype buffer: rounded to fp32, then to the dtype
 * with round-to-nearest-even (own conversion code). */
void ref_store(moelink_dtype_t dtype, void *p, size_t i, double v);

/* How close the token is to a different routing decision: the smallest
 * relative gap between two scores whose order decides the selection (adjacent
 * selected experts, the k-th selected against the best unselected, the last
 * kept group against the best dropped one), relative to the larger of the two
 * and of their unbiased scores (raw logits: at least 1e-3). Tests skip the id
 * comparison of tokens below 1e-6, where fp32 rounding may legitimately flip
 * the choice. +Inf when no two scores compete (E = 1); -1 on a config
 * ref_route_token rejects. */
double ref_route_margin(const moelink_moe_config_t *cfg, const moelink_moe_weights_t *w,
                        const void *x_row);

/* ---- test data ---------------------------------------------------------- */

/* A layer's weights in host memory, owned by this struct. Values come from
 * moelink_fill_random (so a device copy made with the same seeds matches):
 * gate_up scale 2/sqrt(H), down 2/sqrt(I), shared likewise (Is), shared gate
 * 1/sqrt(H), router 3/sqrt(H) (logits of standard deviation 1), correction
 * bias in [-0.05, 0.05) (negative values included), x scale 1.
 * zipf_alpha > 0 skews routing: expert e gets log((e+1)^-alpha) added to
 * its logit through hidden feature 0 (x[.,0] = 1 in ref_fill_x when skewed). */
typedef struct ref_layer {
  moelink_moe_config_t cfg;
  moelink_moe_weights_t w;   /* points into the buffers below */
  void *router, *gate_up, *down, *shared_gate_up, *shared_down, *shared_gate;
  float *bias;
  float *gate_up_scale, *down_scale; /* cfg.fp8_experts: gate_up/down hold e4m3 bytes */
  /* cfg.fp8_shared: shared_gate_up/shared_down hold e4m3 bytes (the dtype
   * tensor's, quantized by ref_fp8_quantize) */
  float *shared_gate_up_scale, *shared_down_scale;
  uint64_t seed;
  double zipf_alpha;
} ref_layer;

/* Seeds used for each tensor, derived from the layer seed, so device-side
 * generation can reproduce the host buffers tensor by tensor. */
enum { REF_T_ROUTER = 1, REF_T_BIAS, REF_T_GATE_UP, REF_T_DOWN, REF_T_SH_GATE_UP, REF_T_SH_DOWN,
       REF_T_SH_GATE, REF_T_X };
uint64_t ref_tensor_seed(uint64_t layer_seed, int tensor);
/* Scale used for a tensor (what ref_layer_make passes to moelink_fill_random). */
float ref_tensor_scale(const moelink_moe_config_t *cfg, int tensor);

/* A preset at test sizes: the preset's routing with hidden H, inter I, the
 * shared expert's inter Is where the preset has one, and dtype dt. Returns
 * 0, or -1 for an unknown preset (moelink_last_error says why). */
int ref_preset_reduced(const char *preset, int H, int I, int Is, moelink_dtype_t dt,
                       moelink_moe_config_t *cfg);

/* Allocates and fills a layer. Returns 0, or -1 (out of memory / bad cfg). */
int ref_layer_make(ref_layer *L, const moelink_moe_config_t *cfg, uint64_t seed, double zipf_alpha);
/* ref_layer_make in two steps, for callers that spread FP8 experts over
 * threads. ref_layer_begin does all of it but, with cfg->fp8_experts, the
 * routed experts' bytes and scales (allocated, not written), and sets
 * *pieces (NULL: not wanted) to how many pieces they come in (0 without
 * fp8_experts). ref_layer_fp8_piece writes piece p < *pieces: 128 rows of one
 * expert's gate_up or down and their scales, as ref_layer_make would; distinct
 * pieces may be written at the same time. Both return 0, or -1 (begin: as
 * ref_layer_make, L freed; piece: out of memory or p out of range). */
int ref_layer_begin(ref_layer *L, const moelink_moe_config_t *cfg, uint64_t seed,
                    double zipf_alpha, size_t *pieces);
int ref_layer_fp8_piece(const ref_layer *L, size_t p);
void ref_layer_free(ref_layer *L);

/* Fills x [T, H] (cfg dtype) for a layer; token t's values depend only on
 * (seed, t, i). When the layer is skewed, x[t, 0] = 1. */
void ref_fill_x(const ref_layer *L, void *x, int num_tokens, uint64_t seed);

/* Applies the zipf skew to a router buffer [E, H] (host, cfg dtype) in place:
 * what ref_layer_make does after filling it. */
void ref_apply_skew(const moelink_moe_config_t *cfg, void *router, double zipf_alpha);

#endif
