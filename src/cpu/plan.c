/* Plan: a counting sort of the (token, slot) pairs by expert, its inverse and
 * the tile schedule. Sequential: O(T*k + E), small next to the GEMMs, and the
 * order it produces is the definition of the permuted layout. */
#include "cpu/cpu.h"

#include <string.h>

void ml_cpu_build_plan(const int32_t *ids, int num_tokens, int top_k, int num_experts,
                       int tile_rows, const moelink_plan_t *plan) {
  const int pairs = num_tokens * top_k, E = num_experts;
  int32_t *off = plan->expert_offsets;
  memset(off, 0, sizeof(int32_t) * ((size_t)E + 1));
  for (int p = 0; p < pairs; ++p)
    if (ids[p] >= 0 && ids[p] < E) ++off[ids[p] + 1];
  for (int e = 0; e < E; ++e) off[e + 1] += off[e];

  /* The tile array (>= 3*E ints) serves as the per-expert cursors until the
   * tiles are written. */
  int32_t *cursor = plan->tiles;
  memcpy(cursor, off, sizeof(int32_t) * (size_t)E);
  for (int p = 0; p < pairs; ++p) {
    const int e = ids[p];
    if (e >= 0 && e < E) {
      const int r = cursor[e]++;
      plan->sorted_pairs[r] = p;
      plan->pair_rows[p] = r;
    } else {
      plan->pair_rows[p] = -1;
    }
  }
  for (int r = off[E]; r < pairs; ++r) plan->sorted_pairs[r] = -1;

  int nt = 0;
  for (int e = 0; e < E; ++e)
    for (int r0 = off[e]; r0 < off[e + 1]; r0 += tile_rows) {
      const int rows = off[e + 1] - r0 < tile_rows ? off[e + 1] - r0 : tile_rows;
      plan->tiles[3 * nt] = e;
      plan->tiles[3 * nt + 1] = r0;
      plan->tiles[3 * nt + 2] = rows;
      ++nt;
    }
  for (int i = 3 * nt; i < 3 * plan->max_tiles; ++i) plan->tiles[i] = -1;
  plan->num_tiles[0] = nt;
}

moelink_status_t ml_cpu_check_plan(const moelink_plan_t *plan, int check_rows) {
  const int E = plan->num_experts, pairs = plan->num_tokens * plan->top_k;
  const int32_t *off = plan->expert_offsets;
  if (off[0] != 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "plan_buffer: expert_offsets[0] is %d, not 0",
                   (int)off[0]);
  for (int e = 0; e < E; ++e)
    if (off[e + 1] < off[e] || off[e + 1] > pairs)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "plan_buffer: expert_offsets[%d] = %d is not in [%d, %d]: not a plan for "
                     "%d tokens", e + 1, (int)off[e + 1], (int)off[e], pairs, plan->num_tokens);
  const int rows = off[E];
  for (int r = 0; r < rows; ++r)
    if (plan->sorted_pairs[r] < 0 || plan->sorted_pairs[r] >= pairs)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "plan_buffer: sorted_pairs[%d] = %d is not in [0, %d)", r,
                     (int)plan->sorted_pairs[r], pairs);
  if (check_rows)
    for (int p = 0; p < pairs; ++p)
      if (plan->pair_rows[p] < -1 || plan->pair_rows[p] >= rows)
        return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                       "plan_buffer: pair_rows[%d] = %d is not in [-1, %d)", p,
                       (int)plan->pair_rows[p], rows);
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_plan(moelink_moe_t moe, const int32_t *ids, int num_tokens,
                             void *plan_buffer, void *stream) {
  (void)stream;
  const moelink_moe_config_t *c = &moe->cfg;
  moelink_plan_t plan;
  ML_TRY(moelink_plan_view(plan_buffer, num_tokens, c->top_k, c->num_experts, moe->tile_rows,
                           &plan));
  ml_cpu_build_plan(ids, num_tokens, c->top_k, c->num_experts, moe->tile_rows, &plan);
  return MOELINK_SUCCESS;
}
