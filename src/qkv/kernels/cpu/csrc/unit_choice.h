// Which unit runs a problem's products: the path's tile unit (tiles_amx.h, or the dot products
// of tiles_dpbf16.h) or its vector code. Included by kernel.h after the path's tile layer, whose
// constants (TILE_BF16, TILE_F32, TILE_PV_N, TILE_K_MAX) it reads.

// whether this problem's products run on the tile unit (bfloat16 inputs on a path that has it)
static inline bool on_tiles(const Problem& P) { return TILE_BF16 && P.dtype == DT_BF16; }
// whether its backward's products run on the tile unit too (bfloat16: dP, dV, dK and dQ)
static inline bool bwd_on_tiles(const Problem& P) {
  return on_tiles(P) && P.Dp <= TILE_PV_N && P.Dvp <= TILE_PV_N;
}
// whether its precise float32 scores run on the tile unit, in three bfloat16 parts (tiles_amx.h):
// the products gemm_chain would form, same chains of 32 summed in double
static inline bool scores_on_tiles(const Problem& P) {
  return TILE_F32 && P.dtype == DT_F32 && P.precise_scores && !P.dot_scores && P.D <= TILE_K_MAX;
}
