/* The shared expert: one dense SwiGLU MLP over all tokens, run as extra work
 * items in the routed experts' phases, optionally scaled by
 * sigmoid(x . w_g) per token. FP8 (cfg.fp8_shared): its weight blocks are
 * dequantized as the routed experts' are (experts.c) and it reads the
 * quantize-dequantized rows the caller made (ml_cpu_run_ffn: sh_xq, then
 * sh_h in place). */
#include "core/fp8.h"
#include "cpu/cpu.h"

#include <math.h>

int ml_cpu_shared_gu_items(const moelink_moe_config_t *cfg, const ml_cpu_blocks *b) {
  return cfg->shared_inter > 0 ? (cfg->shared_inter + b->sgu_cols - 1) / b->sgu_cols : 0;
}

int ml_cpu_shared_down_items(const moelink_moe_config_t *cfg, const ml_cpu_blocks *b) {
  return cfg->shared_inter > 0 ? (cfg->hidden + b->sdown_cols - 1) / b->sdown_cols : 0;
}

void ml_cpu_shared_gate_token(moelink_moe_t moe, const float *x32, int t) {
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const int H = moe->cfg.hidden;
  const float *xr = x32 + (size_t)t * H;
  float dot = 0.0f;
  for (int i = 0; i < H; ++i) dot += xr[i] * ws->sh_gw[i];
  ws->sh_gate[t] = 1.0f / (1.0f + expf(-dot));
}

void ml_cpu_shared_gu_item(moelink_moe_t moe, const float *x32, int num_tokens, int item, int tid) {
  const moelink_moe_config_t *c = &moe->cfg;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const int H = c->hidden, Is = c->shared_inter, cols = ws->blk.sgu_cols;
  const int c0 = item * cols, nc = Is - c0 < cols ? Is - c0 : cols;
  float *conv = ml_cpu_conv(ws, tid);
  const float *wg, *wu;
  if (c->fp8_shared) {
    const uint8_t *w8 = (const uint8_t *)moe->w.shared_gate_up;
    wg = ml_cpu_fp8_weight_rows(w8, moe->w.shared_gate_up_scale, (size_t)c0, nc, H, conv);
    wu = ml_cpu_fp8_weight_rows(w8, moe->w.shared_gate_up_scale, (size_t)Is + c0, nc, H,
                                conv + (size_t)nc * H);
    x32 = ws->sh_xq;
  } else {
    wg = ml_cpu_weight_rows(c->dtype, moe->w.shared_gate_up, (size_t)c0, nc, H, conv);
    wu = ml_cpu_weight_rows(c->dtype, moe->w.shared_gate_up, (size_t)Is + c0, nc, H,
                            conv + (size_t)nc * H);
  }
  ml_cpu_swiglu_block(x32, H, num_tokens, H, wg, wu, nc, ws->sh_h + c0, Is, ws->blk.row_chunk,
                      ml_cpu_tmp(ws, tid));
}

void ml_cpu_shared_down_item(moelink_moe_t moe, int num_tokens, int item, int tid) {
  const moelink_moe_config_t *c = &moe->cfg;
  ml_cpu_moe *ws = ml_cpu_ws(moe);
  const int H = c->hidden, Is = c->shared_inter, cols = ws->blk.sdown_cols;
  const int c0 = item * cols, nc = H - c0 < cols ? H - c0 : cols;
  const float *wd = c->fp8_shared ? ml_cpu_fp8_weight_rows((const uint8_t *)moe->w.shared_down,
                                                           moe->w.shared_down_scale, (size_t)c0, nc,
                                                           Is, ml_cpu_conv(ws, tid))
                                  : ml_cpu_weight_rows(c->dtype, moe->w.shared_down, (size_t)c0, nc,
                                                       Is, ml_cpu_conv(ws, tid));
  ml_cpu_down_block(ws->sh_h, Is, num_tokens, Is, wd, nc, ws->sh_out + c0, H,
                    c->shared_gate ? ws->sh_gate : NULL, NULL, ws->blk.row_chunk,
                    ml_cpu_tmp(ws, tid));
}
