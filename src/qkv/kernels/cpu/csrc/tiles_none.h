// The tile layer of a path without a tile unit (avx512, avx2, portable): every name of
// isa_contract.h's tile part, saying "no tiles". TILE_BF16 and TILE_F32 are false, so kernel.h
// never calls the functions (on_tiles, bwd_on_tiles and scores_on_tiles are false) and the float
// micro-kernels run every product; they exist so that the kernel compiles unchanged, and do
// nothing. tiles_amx.h is the path with a tile unit.

static constexpr bool TILE_BF16 = false;
constexpr int64_t TILE_K_MAX = 0;
constexpr int64_t TILE_PV_N = 0;
static constexpr bool TILE_F32 = false;

// bfloat16 products
static inline bool tile_gemm(int64_t, int64_t, int64_t, const float*, int64_t, const uint16_t*,
                             const float*, int64_t, const uint32_t*, float*, int64_t) {
  return false;
}
static inline int64_t tile_b_elems(int64_t, int64_t) { return 0; }
static inline void pack_b_blocks(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*) {}
static inline int64_t tile_a_elems(int64_t, int64_t) { return 0; }
static inline void tile_pack_rows(int64_t, int64_t, const float*, int64_t, uint16_t*, float) {}
static inline void tile_put_p(V16, V16, uint16_t*, int64_t, int64_t) {}
static inline void tile_put_pair(const V16*, const V16*, int64_t, uint32_t*) {}
static inline void tile_pv(int64_t, int64_t, int64_t, const uint16_t*, const float*, int64_t,
                           const uint32_t*, float*, int64_t, const double*) {}
static inline void tile_pack_a(int64_t, int64_t, const float*, int64_t, uint16_t*) {}
static inline void tile_acc(int64_t, int64_t, int64_t, const uint16_t*, const uint32_t*, float*,
                            int64_t) {}

#include "tiles_no_f32.h"
