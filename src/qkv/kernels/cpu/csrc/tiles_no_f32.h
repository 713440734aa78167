// The float32 part of isa_contract.h's tile layer for a path whose float32 scores stay on the
// vector unit (TILE_F32 false: kernel.h never calls these): included by tiles_none.h and
// tiles_dpbf16.h.

// float32 scores in three bfloat16 parts
static inline int64_t tile_a3_elems(int64_t, int64_t) { return 0; }
static inline void tile_pack_rows3(int64_t, int64_t, const float*, int64_t, uint16_t*, int8_t*,
                                   float) {}
static inline bool tile_scale_folds(float) { return false; }
static inline int64_t tile_b3_elems(int64_t) { return 0; }
static inline uint64_t tile_pack_keys3(int64_t, const float*, int64_t, uint32_t*) { return 0; }
static inline void tile_chain3(int64_t, int64_t, int64_t, const uint16_t*, const uint32_t*,
                               int64_t, float*, int64_t, double, bool) {}
static inline void tile_chain3_f64(int64_t, int64_t, const uint16_t*, const uint32_t*, double*,
                                   int64_t) {}
