// FlashAttention-2, forward and backward, over the kept tiles of a block layout.
//
// Included by each isa_*.cpp (isa_unit.h) inside its own namespace, after that ISA's SIMD and
// tile layers, so the same source becomes one kernel per instruction set: it is written against
// the names isa_contract.h lists. No torch types and no std templates here: every
// function has internal linkage or lives in the ISA's namespace.
//
// Tiles are bq query rows × 64 keys. The forward runs one item per (b, kv head, query tile[,
// split of its kept tiles]); its rows are the tile's rows of all G query heads that share the kv
// head, so each K/V tile is read and packed once per group. Per kept tile:
//
//     S = Q Kᵀ · scale           tile_scores: float chains of 32 products (16 portable) summed
//                                in double (fp32; on the amx path the chains are tile products
//                                of three bfloat16 parts per value, tiles_amx.h)
//     t = mods(S)                ALiBi / softcap in float, masked to −inf outside the bits
//     m' = max(m, rowmax t);  P = exp(t − m');  l = l·α + rowsum P;  α = e^(m − m') in double
//     acc = acc·α + P V          P V in one float chain per tile (16 keys portable) summed in double,
//                                acc in double
//
// and at the end out = acc / l, with (m, l) saved for the backward and lse = m + log l returned.
//
// The backward runs one item per (b, kv head, chunk of key-tile columns). Per column j it packs
// K_j, V_j once and, for every kept query tile i and query head g of the group, recomputes
//
//     S, t                       the forward's own tile_scores and row_scores: the same bits
//     P = float(exp(t − m) · (1/l))          (the division and the product in double)
//     dP = dO Vᵀ in double (exact sums of float products), Δ = rowsum(dO ∘ O) − dlse summed
//     the same way (query tiles holding a peaked row: Σ P·dP / Σ P − dlse from a row pass
//     before, delta_item);  dS = P ∘ float(dP − Δ)
//     dV_j += Pᵀ dO;  dK_j += dSᵀ Q;  dQ_i += dS K_j
//
// each product in float chains of 32 terms (portable: CHAIN, 16; exactly, in double, for small
// gradients: exact_sums in ops.cpp) summed in double, within and across tiles.
// dQ tiles live in a small pool while the chunk's columns reach them (see BwdPlan). Where the
// whole group's live dQ tiles would not stay in cache (GQA over long rows), an item walks its
// chunk once per few heads of the group, keeping dK_j and dV_j of every column between passes.

#include "isa_contract.h"

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// 64-byte-aligned memory for `bytes` (rounded up to a whole 64: aligned_alloc wants a multiple of
// the alignment, and at least one line, so that a size of 0, D = 0, is a real block)
static inline void* alloc64(int64_t bytes) {
  return aligned_alloc(64, (size_t)((imax(bytes, 1) + 63) & ~int64_t(63)));
}
static const float NEG_INF = -__builtin_inff();

// Whether a row of one tile's scores (BK of them) holds a NaN: a NaN in q or k, which the
// row maxima pass over (max(NaN, x) is x), asked only where the row would otherwise be empty.
static inline bool has_nan(const float* row) {
  bool nan = false;
  for (int64_t j = 0; j < BK; ++j) nan = nan || row[j] != row[j];
  return nan;
}
static const uint32_t GOLDEN = 0x61C88647u;

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

// ------------------------------------------------------------------------- scalar conversions

static inline float f32_of_bits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
static inline float half_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-08f;  // m · 2^-24, exact
    return sign ? -f : f;
  }
  if (e == 31) return f32_of_bits(sign | 0x7F800000u | (m << 13));
  return f32_of_bits(sign | ((e + 112u) << 23) | (m << 13));
}
// float → IEEE half, round to nearest even
static inline uint16_t f32_to_half(float f) {
  const uint32_t x = bits_of_f32(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // ≥ 65520 rounds to inf
  if (ax < 0x38800000u) {                                    // below 2^-14: a subnormal half
    const float q = __builtin_nearbyintf(f32_of_bits(ax) * 16777216.0f);  // units of 2^-24
    return (uint16_t)(sign | (uint32_t)q);
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3FFu);
  const uint32_t rest = ax & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return (uint16_t)(sign | h);
}
// float → bfloat16, round to nearest even (NaN stays NaN)
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of_f32(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline int64_t elem_size(int32_t dt) { return dt == DT_F32 ? 4 : 2; }

static inline const void* row_of(const View& x, int32_t dt, int64_t b, int64_t h, int64_t n) {
  return (const char*)x.data + (b * x.sb + h * x.sh + n * x.sn) * elem_size(dt);
}

// n values of a row in dtype → float, zero-filled up to npad (n = 0: src may be null, the data
// pointer of an empty tensor, which memcpy must not be given even for no bytes)
static inline void load_row(const void* src, int32_t dt, int64_t n, int64_t npad, float* dst) {
  if (dt == DT_F32) {
    if (n > 0) __builtin_memcpy(dst, src, (size_t)n * 4);
  } else {
    const uint16_t* s = (const uint16_t*)src;
    if (dt == DT_BF16) {
      for (int64_t i = cvt_bf16(s, dst, n); i < n; ++i) dst[i] = f32_of_bits((uint32_t)s[i] << 16);
    } else {
      for (int64_t i = cvt_f16(s, dst, n); i < n; ++i) dst[i] = half_to_f32(s[i]);
    }
  }
  for (int64_t i = n; i < npad; ++i) dst[i] = 0.0f;
}

static inline void store_row(void* dst, int32_t dt, const float* x, int64_t n) {
  if (dt == DT_F32) {
    if (n > 0) __builtin_memcpy(dst, x, (size_t)n * 4);
  } else if (dt == DT_BF16) {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
  } else {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_half(x[i]);
  }
}

// non-finite entries → 0 (the backward reads masked-out garbage as 0, as the tiled backend does)
static inline void sanitize_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!(x[i] - x[i] == 0.0f)) x[i] = 0.0f;
}

// whether every x[r·ld + i], r < rows, i < n16 (a multiple of 16), is finite: x − x is +0 for a
// finite x and NaN otherwise, and NaN survives the sums (four, so the adds overlap); one test at
// the end, not one per vector (decoding checks each V tile it streams)
static inline bool rows_finite(const float* x, int64_t rows, int64_t ld, int64_t n16) {
  V16 z0 = v_set(0.0f), z1 = z0, z2 = z0, z3 = z0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    int64_t i = 0;
    for (; i + 64 <= n16; i += 64) {
      const V16 a = v_load(xr + i), b = v_load(xr + i + 16);
      const V16 c = v_load(xr + i + 32), d = v_load(xr + i + 48);
      z0 = v_add(z0, v_sub(a, a));
      z1 = v_add(z1, v_sub(b, b));
      z2 = v_add(z2, v_sub(c, c));
      z3 = v_add(z3, v_sub(d, d));
    }
    for (; i < n16; i += 16) {
      const V16 a = v_load(xr + i);
      z0 = v_add(z0, v_sub(a, a));
    }
  }
  return m_all(v_finite(v_add(v_add(z0, z1), v_add(z2, z3))));
}

// ------------------------------------------------------------------------- dropout (qkv.dropout)

static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x6A09E667u;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  return x ^ (x >> 15);
}
static inline uint32_t drop_row_hash(const Drop& d, int64_t bh, int64_t row) {
  const uint32_t head = mix32((uint32_t)((uint64_t)bh * GOLDEN + d.s0));
  return mix32(head ^ (uint32_t)((uint64_t)row * GOLDEN));
}
static inline void drop_col_hash(const Drop& d, int64_t c0, uint32_t* out) {
  for (int64_t c = 0; c < BK; ++c) out[c] = mix32((uint32_t)((uint64_t)(c0 + c) * GOLDEN) ^ d.s1);
}
// which of 16 consecutive keys survive dropout in a row
static inline M16 drop_keep(const Drop& d, uint32_t row_hash, const uint32_t* col_hash) {
  if (d.threshold > 0xFFFFFFFFull) return m_bits(0);
  return u_ge(u_mix(u_xor(u_load(col_hash), row_hash)), (uint32_t)d.threshold);
}

// ------------------------------------------------------------------------- scores of a tile row

// t = mods(s) for scaled scores s of keys c0 … c0+63 of a row at position qpos, −inf where `allowed` has no
// bit. With dfac, also dt/dx (softcap: 1 − tanh², else 1). The forward and the backward both
// call this on the same gemm output, so they see the same t.
static inline void row_scores(const Mods& md, float slope, int64_t qpos, int64_t c0,
                              uint64_t allowed, const float* s, float* t, float* dfac) {
  const bool cap = md.cap != 0.0f;
  if (!cap && slope == 0.0f && allowed == ~0ull && s == t) return;  // t = s already
  for (int64_t q = 0; q < 4; ++q) {
    V16 x = v_load(s + 16 * q);
    V16 bias = v_set(0.0f);
    if (slope != 0.0f) bias = v_mul(v_set(slope), v_absdist((int32_t)(qpos - c0 - 16 * q)));
    if (slope != 0.0f && !md.alibi_after_cap) x = v_sub(x, bias);
    if (cap) {
      const V16 th = v_tanh(v_div(x, v_set(md.cap)));
      x = v_mul(th, v_set(md.cap));
      if (dfac) v_store(dfac + 16 * q, v_sub(v_set(1.0f), v_mul(th, th)));
    }
    if (slope != 0.0f && md.alibi_after_cap) x = v_sub(x, bias);
    const uint32_t w = (uint32_t)(allowed >> (16 * q)) & 0xFFFFu;
    if (w != 0xFFFFu) x = v_select(m_bits(w), x, v_set(NEG_INF));
    v_store(t + 16 * q, x);
  }
}

// C = A·B where a zero in A never multiplies B (B may hold NaN/inf where A is 0). Each element
// is the same chain of operations as gemm's (a skipped term a·b + c with a = 0 is c), so on
// finite data both give the same bits.
static void gemm_zero_safe(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                           int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    for (int64_t n = 0; n < N; ++n) c[n] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[m * sam + k * sak];
      if (a == 0.0f) continue;
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] = madd(a, b[n], c[n]);
    }
  }
}

// D[m·ldd + n] += Σ_k A[m·sam + k·sak] · B[k·ldb + n] with every product (of two floats: exact)
// and every sum in double: the backward's accumulations of small gradients (exact_sums in
// ops.cpp), in place of gemm_acc's float chains.
static void gemm_acc_f64(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                         int64_t sak, const float* B, int64_t ldb, double* D, int64_t ldd) {
  for (int64_t m = 0; m < M; ++m) {
    double* d = D + m * ldd;
    for (int64_t k = 0; k < K; ++k) {
      const double a = (double)A[m * sam + k * sak];
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) d[n] += a * (double)b[n];
    }
  }
}

// ------------------------------------------------------------------------- per-worker buffers

// The backward walks key columns outer: the three-part split (tile_pack_rows3) of a query tile's
// rows is made at the tile's first column of a chunk, in an entry of such a cache, and read by
// the others. Each entry's state is a PartsState (PARTS_EMPTY is 0: a zeroed state is empty).
enum PartsState : int8_t { PARTS_EMPTY = 0, PARTS_PACKED = 1, PARTS_PACKED_BAD_ROW = 2 };
struct PartsCache {
  uint16_t* parts;  // entry e at parts + e · (its elements)
  int8_t* bad;      // entry e's rows the split cannot carry, at bad + e · bq
  int8_t* state;    // entry e's PartsState
};

struct Buf {
  char* base;
  float *q, *kr, *kt, *vr, *vt, *s, *p, *ds, *dfac, *o, *dO, *tmp;
  float* slo;  // the scores' low parts (score_lo; finite: zeroed here, written finite)
  float *mrow, *slope;
  int64_t *qpos, *bitoff;
  uint32_t *rowh, *colh;
  double *l, *alpha, *delta, *inv_l, *acc, *dk64, *dv64;
  double *vt64, *dO64, *dp64;  // backward: Vᵀ, dO and dP in double (dP's sums are exact)
  double* q64;  // precise scores (float32 inputs): Q in double (decoding, exact rows)
  double* qn;   // precise scores: |q| of each row (exact_rows)
  double kmax;  // precise scores: the largest |k| of the packed key tile (exact_rows)
  int8_t* exact;  // per row: this tile's scores formed exactly, with their low parts in slo
  double* pool;  // backward: live dQ tiles
  int64_t pool_cap;
  double* dkv;   // backward, passes of a few heads: dK_j and dV_j of each column of the chunk
  int64_t dkv_cap;
  PartsCache qc, dc;  // backward, float32 on the tiles: Q's rows' parts (the scores) and dO's
                      // (dP = dO Vᵀ), per pool slot and head of the group
  int64_t parts_cap;  // entries of each
  uint32_t* vb3;  // backward, float32 on the tiles: the V tile's parts (tile_pack_keys3), dP's
  uint64_t vbad;  // … its keys the split cannot carry (the tile's dP then on AVX-512)
  int32_t *slot_of, *free_slots;
  int64_t slot_cap;
  int8_t *glo, *ghi;  // forward: the first and last 16-key chunk each group of 16 rows computes
  float* ktc;         // forward: KT_SLOTS packed key tiles (w.kt points at one of them)
  int64_t* ktag;      // forward: which key tile each slot holds, −1 none
  double* kmaxc;      // forward: each slot's key_norm_max
  float* accf;        // tile unit, bfloat16: the forward's P·V accumulator (rows padded to 16)
  uint16_t* pa;       // tile unit, bfloat16: the forward's P as A tiles (tile_put_p)
  uint16_t* qa;       // tile unit: the forward item's Q rows as A tiles (tile_pack_rows; float32:
                      // three parts, tile_pack_rows3)
  bool qa_on;         // qa holds the rows of w.q
  int8_t* qbad;       // tile unit, float32: rows of qa the split cannot carry (gemm_chain forms them)
  bool qbad_any;      // … some row of the forward's item
  int64_t kt0;        // forward, the call's key-tile store: the tile slot 0's kt holds, or −1
  uint32_t* kb;       // tile unit, float32: the packed key tile's three parts (tile_pack_keys3;
                      // the forward's in its slot of kbc)
  uint64_t kbad;      // … its keys the split cannot carry (gemm_chain forms them)
  uint32_t* kbc;      // forward: each kept key-tile slot's parts
  uint64_t* kbadc;    // forward: each slot's kbad
  bool qa_scaled;     // … times the scale (a power of two)
  float* lv;          // tile unit, bfloat16: the forward's row sums l, 16 lanes a row
  uint16_t* ta;       // tile unit, bfloat16 backward: Pᵀ, dSᵀ or dS as A tiles (tile_pack_a)
  uint32_t* tb;       // … the other operand as B tiles (tile_acc)
};

static inline char* carve(char*& cur, int64_t bytes) {
  char* p = cur;
  cur += (bytes + 63) & ~int64_t(63);
  return p;
}

// rows: most rows a tile step handles (forward G·bq, backward bq)
static bool buf_alloc(Buf& w, const Problem& P, int64_t rows) {
  const int64_t Dp = P.Dp, Dvp = P.Dvp, Dm = imax(Dp, Dvp), R = imax(rows, 1);
  int64_t bytes = 0;
  const int64_t floats[] = {R * Dp, BK * Dp, Dp * BK, BK * Dvp, Dvp * BK, R * BK, R * BK, R * BK,
                            R * BK, R * BK, imax(4 * R, BK) * Dm, P.lay.bq * Dvp + 16, Dm + 16, R, R};
  for (int64_t f : floats) bytes += (f * 4 + 63) & ~int64_t(63);
  bytes += 2 * ((R * 8 + 63) & ~int64_t(63)) + 2 * ((R * 4 + 63) & ~int64_t(63)) + 256;
  bytes += 4 * ((R + 63) & ~int64_t(63));
  const int64_t qa_elems = on_tiles(P) ? tile_a_elems(R, P.D) : scores_on_tiles(P) ? tile_a3_elems(R, P.D) : 0;
  const int64_t kb_elems = scores_on_tiles(P) ? tile_b3_elems(P.D) : 0;
  bytes += (kb_elems * 4 + 63) & ~int64_t(63);
  const int64_t vb_elems = scores_on_tiles(P) && P.Dv <= TILE_K_MAX ? tile_b3_elems(P.Dv) : 0;
  bytes += (vb_elems * 4 + 63) & ~int64_t(63);
  bytes += (qa_elems * 2 + 63) & ~int64_t(63);
  const int64_t accf_elems = on_tiles(P) ? (R + 15) / 16 * 16 * Dvp : 0;
  bytes += (accf_elems * 4 + 63) & ~int64_t(63);
  const int64_t lv_elems = on_tiles(P) ? R * 16 : 0;
  bytes += (lv_elems * 4 + 63) & ~int64_t(63);
  const int64_t bqa = (R + 31) / 32 * 32;  // the backward's tile rows (bq), to a whole step
  const int64_t ta_elems = bwd_on_tiles(P) ? 2 * 512 * imax(4 * (bqa / 32), bqa / 16 * 2) : 0;
  const int64_t tb_elems = bwd_on_tiles(P) ? imax(bqa / 32, 2) * (imax(Dp, Dvp) / 16) * 256 : 0;
  bytes += ((ta_elems * 2 + 63) & ~int64_t(63)) + ((tb_elems * 4 + 63) & ~int64_t(63));
  const int64_t pa_elems = on_tiles(P) ? (R + 15) / 16 * 16 * BK : 0;
  bytes += (pa_elems * 2 + 63) & ~int64_t(63);
  const int64_t doubles[] = {R, R, R, R, R * Dm, BK * Dp, BK * Dvp, Dvp * BK, R * Dvp, R * BK, R * Dp, R};
  for (int64_t d : doubles) bytes += (d * 8 + 63) & ~int64_t(63);
  w.base = (char*)alloc64(bytes);
  if (!w.base) return false;
  char* cur = w.base;
  w.q = (float*)carve(cur, R * Dp * 4);
  w.kr = (float*)carve(cur, BK * Dp * 4);
  w.kt = (float*)carve(cur, Dp * BK * 4);
  w.vr = (float*)carve(cur, BK * Dvp * 4);
  w.vt = (float*)carve(cur, Dvp * BK * 4);
  w.s = (float*)carve(cur, R * BK * 4);
  w.slo = (float*)carve(cur, R * BK * 4);
  __builtin_memset(w.slo, 0, (size_t)(R * BK) * 4);
  w.p = (float*)carve(cur, R * BK * 4);
  w.ds = (float*)carve(cur, R * BK * 4);
  w.dfac = (float*)carve(cur, R * BK * 4);
  w.o = (float*)carve(cur, imax(4 * R, BK) * Dm * 4);
  w.dO = (float*)carve(cur, (P.lay.bq * Dvp + 16) * 4);
  w.tmp = (float*)carve(cur, (Dm + 16) * 4);
  w.mrow = (float*)carve(cur, R * 4);
  w.slope = (float*)carve(cur, R * 4);
  w.qpos = (int64_t*)carve(cur, R * 8);
  w.bitoff = (int64_t*)carve(cur, R * 8);
  w.rowh = (uint32_t*)carve(cur, R * 4);
  w.colh = (uint32_t*)carve(cur, BK * 4);
  w.l = (double*)carve(cur, R * 8);
  w.alpha = (double*)carve(cur, R * 8);
  w.delta = (double*)carve(cur, R * 8);
  w.inv_l = (double*)carve(cur, R * 8);
  w.acc = (double*)carve(cur, R * Dm * 8);
  w.dk64 = (double*)carve(cur, BK * Dp * 8);
  w.dv64 = (double*)carve(cur, BK * Dvp * 8);
  w.vt64 = (double*)carve(cur, Dvp * BK * 8);
  w.dO64 = (double*)carve(cur, R * Dvp * 8);
  w.dp64 = (double*)carve(cur, R * BK * 8);
  w.q64 = (double*)carve(cur, R * Dp * 8);
  w.qn = (double*)carve(cur, R * 8);
  w.exact = (int8_t*)carve(cur, R);
  __builtin_memset(w.exact, 0, (size_t)R);
  w.glo = (int8_t*)carve(cur, R);
  w.ghi = (int8_t*)carve(cur, R);
  w.qa = (uint16_t*)carve(cur, qa_elems * 2);
  w.kb = (uint32_t*)carve(cur, kb_elems * 4);  // the backward's; the forward's point into kbc
  w.kbad = 0;
  w.vb3 = vb_elems ? (uint32_t*)carve(cur, vb_elems * 4) : nullptr;
  w.vbad = ~0ull;
  w.qbad = (int8_t*)carve(cur, R);
  w.accf = (float*)carve(cur, accf_elems * 4);
  w.lv = (float*)carve(cur, lv_elems * 4);
  w.ta = (uint16_t*)carve(cur, ta_elems * 2);
  w.tb = (uint32_t*)carve(cur, tb_elems * 4);
  w.pa = (uint16_t*)carve(cur, pa_elems * 2);
  w.qa_on = w.qa_scaled = false;
  w.pool = nullptr;
  w.pool_cap = 0;
  w.dkv = nullptr;
  w.dkv_cap = 0;
  w.qc = w.dc = PartsCache{nullptr, nullptr, nullptr};
  w.parts_cap = 0;
  w.slot_of = w.free_slots = nullptr;
  w.slot_cap = 0;
  w.ktc = nullptr;
  w.ktag = nullptr;
  w.kmaxc = nullptr;
  w.kbc = nullptr;
  w.kbadc = nullptr;
  return true;
}

static void parts_free(PartsCache& c) {
  free(c.parts);
  free(c.bad);
  free(c.state);
  c = PartsCache{nullptr, nullptr, nullptr};
}

// room for n entries of `elems` parts each (rows of bq); false when out of memory
static bool parts_alloc(PartsCache& c, int64_t n, int64_t elems, int64_t bq) {
  parts_free(c);
  c.parts = (uint16_t*)alloc64(n * elems * 2 + 64);
  c.bad = (int8_t*)malloc((size_t)(n * bq));
  c.state = (int8_t*)malloc((size_t)n);
  return c.parts && c.bad && c.state;
}

// entry e's parts of the nr rows x (K values, ld ldx) times scale, packed at its first use;
// its state (PARTS_PACKED, or PARTS_PACKED_BAD_ROW with a row the split cannot carry)
static int8_t parts_of(PartsCache& c, int64_t e, int64_t elems, int64_t bq, int64_t nr, int64_t K,
                       const float* x, int64_t ldx, float scale) {
  if (c.state[e] == PARTS_EMPTY) {
    tile_pack_rows3(nr, K, x, ldx, c.parts + e * elems, c.bad + e * bq, scale);
    c.state[e] = __builtin_memchr(c.bad + e * bq, 1, (size_t)nr) ? PARTS_PACKED_BAD_ROW : PARTS_PACKED;
  }
  return c.state[e];
}

static void buf_free(Buf& w) {
  free(w.base);
  free(w.pool);
  free(w.dkv);
  parts_free(w.qc);
  parts_free(w.dc);
  free(w.slot_of);
  free(w.free_slots);
  free(w.ktc);
  free(w.ktag);
  free(w.kmaxc);
  free(w.kbc);
  free(w.kbadc);
}

// ------------------------------------------------------------------------- packing

// K rows c0 … c0+kw−1 of (b, hkv) → kr (64 × Dp, zero rows past kw) and kt = krᵀ (Dp × 64).
// Without `need_kr` (the forward), a whole float32 tile is transposed from the tensor itself.
static void pack_k(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw, Buf& w,
                   bool sanitize, bool need_kr) {
  const int64_t Dp = P.Dp;
  if (!need_kr && !sanitize && P.dtype == DT_F32 && kw == BK && P.D == Dp) {
    const float* src = (const float*)row_of(P.k, P.dtype, b, hkv, c0);
    for (int64_t d0 = 0; d0 < Dp; d0 += 16)
      for (int64_t j0 = 0; j0 < BK; j0 += 16)
        transpose16(src + j0 * P.k.sn + d0, P.k.sn, w.kt + d0 * BK + j0, BK);
    return;
  }
  for (int64_t j = 0; j < kw; ++j) {
    float* dst = w.kr + j * Dp;
    load_row(row_of(P.k, P.dtype, b, hkv, c0 + j), P.dtype, P.D, Dp, dst);
    if (sanitize) sanitize_row(dst, P.D);
  }
  for (int64_t j = kw; j < BK; ++j)
    for (int64_t d = 0; d < Dp; ++d) w.kr[j * Dp + d] = 0.0f;
  for (int64_t d0 = 0; d0 < Dp; d0 += 16)
    for (int64_t j0 = 0; j0 < BK; j0 += 16) transpose16(w.kr + j0 * Dp + d0, Dp, w.kt + d0 * BK + j0, BK);
}

// V rows → vr (kw × Dvp, zero-padded columns); with transpose also vt = vrᵀ (Dvp × 64)
static void pack_v(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw, Buf& w,
                   bool sanitize, bool transpose) {
  const int64_t Dvp = P.Dvp;
  for (int64_t j = 0; j < kw; ++j) {
    float* dst = w.vr + j * Dvp;
    load_row(row_of(P.v, P.dtype, b, hkv, c0 + j), P.dtype, P.Dv, Dvp, dst);
    if (sanitize) sanitize_row(dst, P.Dv);
  }
  if (!transpose) return;
  for (int64_t j = kw; j < BK; ++j)
    for (int64_t d = 0; d < Dvp; ++d) w.vr[j * Dvp + d] = 0.0f;
  for (int64_t d0 = 0; d0 < Dvp; d0 += 16)
    for (int64_t j0 = 0; j0 < BK; j0 += 16) transpose16(w.vr + j0 * Dvp + d0, Dvp, w.vt + d0 * BK + j0, BK);
}

// Decoding (float32, K and V read in place) streams each K/V row once with little work per
// byte; the scores' loop asks for K rows this far ahead and for the V row of the same key, which
// the P·V reads next (docs/cpu.md, "Decoding", gives what it changed).
constexpr int64_t PREFETCH_ROWS = 48;

// s[M × N] (ld BK) = round(q · kt · scale) for rows R0 … R0+M−1 of w.q and key columns 16·lo …
// 16·lo + N − 1 of the packed transposed key tile w.kt, into the same places of w.s: every score
// the same bits whatever M, N and lo (each product promises it). Float32 scores on the tile unit
// (scores_on_tiles) take the rows' parts from w.qa (packed once per forward item, else here) and
// the key tile's from w.kb; rows and keys the split cannot carry get gemm_chain's bits instead.
static void block_scores(const Problem& P, Buf& w, int64_t R0, int64_t M, int64_t lo, int64_t N) {
  const int64_t Dp = P.Dp;
  const float* q = w.q + R0 * Dp;
  const float* kt = w.kt + 16 * lo;
  float* s = w.s + R0 * BK + 16 * lo;
  if (P.precise_scores) {
    if (!scores_on_tiles(P)) {
      gemm_chain(M, N, P.D, q, Dp, kt, BK, s, BK, P.mods.scale64);
      return;
    }
    const bool folded = tile_scale_folds(P.mods.scale);
    if (!w.qa_on) tile_pack_rows3(M, P.D, q, Dp, w.qa, w.qbad + R0, folded ? P.mods.scale : 1.0f);
    tile_chain3(M, N, P.D, w.qa_on ? w.qa + tile_a3_elems(R0, P.D) : w.qa, w.kb, lo, s, BK,
                P.mods.scale64, folded);
    for (int64_t r = 0; r < M; ++r)
      if (w.qbad[R0 + r]) gemm_chain(1, N, P.D, q + r * Dp, Dp, kt, BK, s + r * BK, BK, P.mods.scale64);
    const uint64_t cols = (w.kbad >> (16 * lo)) & (N == BK ? ~0ull : ((1ull << N) - 1));
    for (int64_t c0 = 0; c0 < N; c0 += 16) {
      const uint64_t u = (cols >> c0) & 0xFFFFull;
      if (!u) continue;
      gemm_chain(M, 16, P.D, q, Dp, kt + c0, BK, w.o, 16, P.mods.scale64);
      for (int64_t c = 0; c < 16; ++c)
        if (u >> c & 1)
          for (int64_t r = 0; r < M; ++r) s[r * BK + c0 + c] = w.o[r * 16 + c];
    }
    return;
  }
  const uint16_t* qa = w.qa_on ? w.qa + tile_a_elems(R0, P.D) : nullptr;
  const bool tiles = on_tiles(P) && tile_gemm(M, N, P.D, q, Dp, qa, kt, BK, s, BK);
  if (!tiles) gemm(M, N, P.D, q, Dp, 1, kt, BK, s, BK);
  if (tiles && w.qa_scaled) return;  // the rows came scaled by a power of two: the same bits
  const V16 scale = v_set(P.mods.scale);
  for (int64_t R = 0; R < M; ++R)
    for (int64_t x = 0; x < N; x += 16) v_store(s + R * BK + x, v_mul(v_load(s + R * BK + x), scale));
}

// Scores of rows q (float, ldq) against the packed key tile: s = round(q·k · scale). For float32
// inputs at torch's default matmul precision (P.precise_scores; else one float gemm) the
// products are summed in float chains of SCORE_CHAIN (32; portable: CHAIN, 16) terms and the
// chains in double (gemm_chain), so a score carries the roundings of 32-term (16-term) sums where the
// float32 reference's carries its whole dot product's D (the same design as P·V's chains); for
// 16-bit inputs, whose outputs round to 16 bits, float sums suffice.
//
// Decoding (Nq·G ≤ 16 rows) takes the dot-product form instead: each score is summed over d in
// SIMD lanes straight from the key rows `krows` (no transposed tile; precise: products in
// double lanes, q64). Which form runs depends on the problem only, so the forward and the
// backward still compute the same bits.
static void tile_scores(const Problem& P, int64_t M, const float* q, const double* q64, int64_t ldq,
                        const float* krows, int64_t ldk, int64_t kw, Buf& w,
                        const float* vpre = nullptr, int64_t ldvp = 0) {
  if (P.dot_scores) {
    for (int64_t j = 0; j < kw; ++j) {
      if (vpre) {  // never faults, also past the last row
        const char* kn = (const char*)(krows + (j + PREFETCH_ROWS) * ldk);
        const char* vn = (const char*)(vpre + j * ldvp);
        for (int64_t x = 0; x < P.D * 4; x += 64) __builtin_prefetch(kn + x);
        for (int64_t x = 0; x < P.Dv * 4; x += 64) __builtin_prefetch(vn + x);
      }
      if (P.precise_scores)
        dot_rows64(q64, ldq, M, krows + j * ldk, P.D, w.s + j, w.slo + j, BK, P.mods.scale64);
      else
        dot_rows32(q, ldq, M, krows + j * ldk, P.D, w.s + j, BK, P.mods.scale);
    }
    for (int64_t R = 0; R < M; ++R)
      for (int64_t j = kw; j < BK; ++j) w.s[R * BK + j] = w.slo[R * BK + j] = 0.0f;
    return;
  }
  block_scores(P, w, 0, M, 0, BK);
}

// exp(s − m) for scores 16q … 16q+15 of a row. With the scores' low parts (lorow: the row of
// w.slo, where the problem uses them; null unless P.score_lo): x = (s − m) + s_lo, rounded to
// float, and exp(x) · (1 + r) with r that rounding, exactly (s − m is exact near the row's
// maximum and |s_lo| ≤ half an ulp of s, so r = s_lo − (x − (s − m))): a weight then carries
// about a float rounding of itself, not one of its logit (x ≈ 10 rounds by 5e-7). r is 0 where
// it is not finite (masked scores, −inf). Low parts of 2 or more (scores beyond 2²⁵, whose float
// spacing is 4 or more) are read as 0: there e^(s_lo) at the row's maximum would overflow the
// weights (found with keys scaled by 1e10), and scores that far apart make the row one-hot with or
// without them (a low part times 2¹²⁷ is finite below 2).
static inline V16 exp_scores(const float* srow, const float* lorow, int64_t q, V16 mv) {
  const V16 d = v_sub(v_load(srow + 16 * q), mv);
  if (!lorow) return v_exp(d);
  V16 lo = v_load(lorow + 16 * q);
  lo = v_select(v_finite(v_mul(lo, v_set(0x1p127f))), lo, v_set(0.0f));
  const V16 x = v_add(d, lo);
  V16 r = v_sub(lo, v_sub(x, d));
  r = v_select(v_finite(r), r, v_set(0.0f));
  const V16 e = v_exp(x);
  return v_fma(e, r, e);
}

// load row n of q (b, h) into q[·] and, for precise scores, its norm *qn (and q64[·] for
// decoding's dot products)
// |q| of a row of Dp floats
static inline double row_norm(const Problem& P, const float* q) {
  V16 ss = v_set(0.0f);
  for (int64_t d = 0; d < P.Dp; d += 16) ss = v_fma(v_load(q + d), v_load(q + d), ss);
  return __builtin_sqrt((double)v_hsum(ss));
}

static inline void load_q(const Problem& P, int64_t b, int64_t h, int64_t n, float* q, double* q64,
                          double* qn) {
  load_row(row_of(P.q, P.dtype, b, h, n), P.dtype, P.D, P.Dp, q);
  if (!P.precise_scores) return;
  if (P.dot_scores)
    for (int64_t d = 0; d < P.Dp; ++d) q64[d] = (double)q[d];
  *qn = row_norm(P, q);
}

// Precise scores whose products are large lose, in the float chains, more than the float32
// reference loses in its own sums: at |q|·|k|·scale in the hundreds (logits of that size) the
// chains' roundings (of partial sums of that size) move a weight P by more than the rule
// allows, and dS = P ∘ (dP − Δ) amplifies them in peaked rows (docs/cpu.md, Accuracy). Rows
// with |q| · max_j |k_j| · scale above this bound get the tile's scores formed exactly
// instead: each a dot product in double (dot_rows64), kept as its float rounding and low part.
// Random normal q, k (|q|·|k|·scale ≈ 10 at D = 64) stay far below it.
constexpr double EXACT_BOUND = 32.0;

// the largest |k_j| of a packed key tile kt (Dp × BK, columns j < kw), non-finite entries
// read as 0 (as the backward's sanitized copy holds them): the same value from both passes
static double key_norm_max(const Problem& P, const float* kt, int64_t kw) {
  const V16 zero = v_set(0.0f);
  V16 acc[4] = {zero, zero, zero, zero};
  for (int64_t d = 0; d < P.D; ++d)
    for (int64_t q = 0; q < 4; ++q) {
      const V16 x = v_load(kt + d * BK + 16 * q);
      acc[q] = v_add(acc[q], v_select(v_finite(x), v_mul(x, x), zero));
    }
  float sq[BK];
  for (int64_t q = 0; q < 4; ++q) v_store(sq + 16 * q, acc[q]);
  float mx = 0.0f;
  for (int64_t j = 0; j < kw; ++j) mx = sq[j] > mx ? sq[j] : mx;
  return __builtin_sqrt((double)mx);
}

// After a tile's scores of M rows (w.q, w.qn: the rows and their norms; w.kmax: the key tile's):
// mark the rows whose scores are formed exactly (every row when decoding: its dot products are
// exact; see EXACT_BOUND otherwise) and form those rows' scores from the key rows krows (ld ldk)
// with their low parts. The forward and the backward mark the same rows (the same q, and K
// read alike).
static void exact_rows(const Problem& P, int64_t M, const float* krows, int64_t ldk, int64_t kw,
                       Buf& w) {
  if (!P.precise_scores) return;
  if (P.dot_scores) {
    for (int64_t r = 0; r < M; ++r) w.exact[r] = 1;
    return;
  }
  const double bound = EXACT_BOUND / (w.kmax * P.mods.scale64);
  for (int64_t r = 0; r < M; ++r) {
    w.exact[r] = w.qn[r] > bound;
    if (w.exact[r])
      for (int64_t d = 0; d < P.Dp; ++d) w.q64[r * P.Dp + d] = (double)w.q[r * P.Dp + d];
  }
  for (int64_t r0 = 0; r0 < M;) {
    if (!w.exact[r0]) {
      ++r0;
      continue;
    }
    int64_t r1 = r0 + 1;
    while (r1 < M && w.exact[r1]) ++r1;
    for (int64_t j = 0; j < kw; ++j)
      dot_rows64(w.q64 + r0 * P.Dp, P.Dp, r1 - r0, krows + j * ldk, P.D, w.s + r0 * BK + j,
                 w.slo + r0 * BK + j, BK, P.mods.scale64);
    r0 = r1;
  }
}

// row r's low parts of its scores where exp_scores reads them (exact rows, no modifiers), or null
static inline const float* lo_row(const Problem& P, const Buf& w, int64_t r) {
  return P.score_lo && w.exact[r] ? w.slo + r * BK : nullptr;
}

// ------------------------------------------------------------------------- forward

// Write rows r0 … r0+nr−1 of all heads of (b, hkv): out = acc / l, and the saved (m, l) and lse.
static void finish_rows(const Problem& P, int64_t b, int64_t hkv, int64_t r0, int64_t nr,
                        const float* mrow, const double* l, const double* acc, int64_t ldacc,
                        float* tmp) {
  for (int64_t g = 0; g < P.G; ++g) {
    const int64_t h = hkv * P.G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t R = g * nr + r, idx = (b * P.H + h) * P.Nq + r0 + r;
      const double lr = l[R];
      if (lr == 0.0) {
        for (int64_t d = 0; d < P.Dv; ++d) tmp[d] = 0.0f;
        P.m[idx] = NEG_INF;
        P.l[idx] = 0.0;
        P.lse[idx] = NEG_INF;
      } else {
        const double* a = acc + R * ldacc;
        for (int64_t d = 0; d < P.Dv; ++d) tmp[d] = (float)(a[d] / lr);
        P.m[idx] = mrow[R];
        P.l[idx] = lr;
        P.lse[idx] = (float)((double)mrow[R] + __builtin_log(lr));
      }
      void* dst = (void*)row_of(P.out, P.dtype, b, h, r0 + r);
      if (P.stream_out && (uintptr_t)dst % STREAM_ALIGN == 0) {
        for (int64_t d = 0; d < P.Dv; d += 16) v_stream((float*)dst + d, v_load(tmp + d));
      } else {
        store_row(dst, P.dtype, tmp, P.Dv);
      }
    }
  }
}

// whether V tile j of (b, hkv) is all finite: computed by the first item that reads it, then
// remembered for the call (a benign race: every writer stores the same value)
static inline bool tile_v_finite(const Problem& P, const FwdPlan& F, int64_t b, int64_t hkv,
                                 int64_t j, const float* vb, int64_t kw, int64_t ldv) {
  int8_t* flag = F.v_finite + (b * P.Hkv + hkv) * P.lay.nkb + j;
  int8_t known = __atomic_load_n(flag, __ATOMIC_RELAXED);
  if (known == V_TILE_UNKNOWN) {
    known = rows_finite(vb, kw, ldv, P.Dvp) ? V_TILE_FINITE : V_TILE_NONFINITE;
    __atomic_store_n(flag, known, __ATOMIC_RELAXED);
  }
  return known == V_TILE_FINITE;
}

// The spans of 16-key chunks that the rows of a PARTIAL tile attend, per group of 16 rows, into
// w.glo / w.ghi (lo > hi: none): the group size, 16, or M when every group spans every chunk
static int64_t group_spans(const Problem& P, int64_t code, uint64_t edge, int64_t n_chains,
                           int64_t M, Buf& w) {
  const Layout& L = P.lay;
  const uint64_t* bits = L.bits + code * (L.bm * L.hm * L.bq);
  bool narrow = false;
  for (int64_t R0 = 0, gi = 0; R0 < M; R0 += 16, ++gi) {
    uint64_t u = 0;
    for (int64_t R = R0; R < imin(M, R0 + 16); ++R) u |= bits[w.bitoff[R]];
    u &= edge;
    w.glo[gi] = u ? (int8_t)(__builtin_ctzll(u) / 16) : (int8_t)1;
    w.ghi[gi] = u ? (int8_t)((63 - __builtin_clzll(u)) / 16) : (int8_t)0;
    narrow = narrow || w.glo[gi] != 0 || w.ghi[gi] != n_chains - 1;
  }
  return narrow ? 16 : M;
}

// The forward's items of one (b, kv head) come in order of their query tiles (plan_forward), so
// a worker's next item reads most of the key tiles its last one read (a band: all but a few).
// Each worker keeps its last packed key tiles, slot j mod KT_SLOTS, and packs a tile only when
// its slot holds another: the same bits, a transposition (and a key_norm_max) saved per hit.
constexpr int64_t KT_SLOTS = 16;

static bool ktc_alloc(Buf& w, const Problem& P) {
  w.ktc = (float*)alloc64(KT_SLOTS * P.Dp * BK * 4);
  w.ktag = (int64_t*)malloc(KT_SLOTS * 8);
  w.kmaxc = (double*)malloc(KT_SLOTS * 8);
  if (!w.ktc || !w.ktag || !w.kmaxc) return false;
  if (scores_on_tiles(P)) {
    w.kbc = (uint32_t*)alloc64(KT_SLOTS * tile_b3_elems(P.D) * 4);
    w.kbadc = (uint64_t*)malloc(KT_SLOTS * 8);
    if (!w.kbc || !w.kbadc) return false;
  }
  for (int64_t s = 0; s < KT_SLOTS; ++s) w.ktag[s] = -1;
  w.kt0 = -1;
  return true;
}

// The call-wide parts of the key tiles (FwdPlan.kparts), where the rows of tiles are on average
// longer than a worker's slots (dense, causal): there every item packed every key tile of its
// row afresh (the transposition, the norms and the split: 7–9% of the dense forward's samples);
// with the store each tile is packed once per call. Up to KSHARE_MAX_BYTES (dense N = 4096,
// H = 8, D = 64: 12 MiB), so that long sparse rows (the Longformer's memory) are not charged.
constexpr int64_t KSHARE_MAX_BYTES = int64_t(64) << 20;
static int64_t fwd_share_elems(const Problem& P) {
  if (!scores_on_tiles(P) || P.D != P.Dp) return 0;
  const Layout& L = P.lay;
  const int64_t elems = P.B * P.Hkv * L.nkb * tile_b3_elems(P.D);
  const bool long_rows = L.row_ptr[L.nqb] > KT_SLOTS * L.nqb;
  return long_rows && elems * 4 <= KSHARE_MAX_BYTES ? elems : 0;
}

// Point w.kt at key tile j of (b, hkv), packed, and set w.kmax (precise scores). With `need_kr`
// (exact rows read the tile's rows from w.kr) the tile is packed afresh and its slot not kept.
// Without `keep` (an item whose row spans more tiles than the slots: walked in order, each tile
// would leave its slot before the next item came back to it) every tile is packed into slot 0,
// which stays in L1, instead of cycling through 16 slots' 256 KB (dense N = 4096: 0.97 of the
// forward's time, pairs of calls, 2 cores, Zen 3); with the call's store (F.kparts) the first
// item to reach a tile packs its parts there and the others read them (w.kt, then, holds the
// tile only where gemm_chain needs it: keys or rows the split cannot carry).
// key tile j (rows c0 …) into w.kt, its largest key norm into *kmax and its three parts (scores
// on the tiles) into parts; the keys the split cannot carry into *kbad
static void pack_key_tile(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw, Buf& w,
                          uint32_t* parts, double* kmax, uint64_t* kbad) {
  pack_k(P, b, hkv, c0, kw, w, false, false);
  *kmax = P.precise_scores ? key_norm_max(P, w.kt, kw) : 0.0;
  if (scores_on_tiles(P)) *kbad = tile_pack_keys3(P.D, w.kt, BK, parts);
}

static void fwd_key_tile(const Problem& P, const FwdPlan& F, int64_t b, int64_t hkv, int64_t j,
                         int64_t c0, int64_t kw, bool need_kr, Buf& w, bool keep = true) {
  const int64_t tag = (b * P.Hkv + hkv) * P.lay.nkb + j, slot = keep ? j % KT_SLOTS : 0;
  w.kt = w.ktc + slot * P.Dp * BK;
  if (F.kparts && !keep && !need_kr && kw == BK) {
    int32_t* state = F.kstate + tag;
    int32_t st = __atomic_load_n(state, __ATOMIC_ACQUIRE), idle = KEY_TILE_IDLE;
    uint32_t* parts = F.kparts + tag * tile_b3_elems(P.D);
    // slot 0's kt, rewritten here, no longer matches its parts: w.kt0 names the tile it holds
    if (st == KEY_TILE_IDLE && __atomic_compare_exchange_n(state, &idle, KEY_TILE_PACKING, false,
                                                           __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      pack_key_tile(P, b, hkv, c0, kw, w, parts, F.kmaxv + tag, F.kbadv + tag);
      w.ktag[slot] = -1;
      w.kt0 = tag;
      __atomic_store_n(state, KEY_TILE_READY, __ATOMIC_RELEASE);
      st = KEY_TILE_READY;
    }
    if (st == KEY_TILE_READY) {  // (another item packing it: this one packs its own below)
      w.kb = parts;
      w.kbad = F.kbadv[tag];
      w.kmax = F.kmaxv[tag];
      if ((w.kbad || w.qbad_any) && w.kt0 != tag) {
        pack_k(P, b, hkv, c0, kw, w, false, false);
        w.ktag[slot] = -1;
        w.kt0 = tag;
      }
      return;
    }
  }
  if (slot == 0) w.kt0 = -1;
  if (w.ktag[slot] != tag) {
    pack_key_tile(P, b, hkv, c0, kw, w, scores_on_tiles(P) ? w.kbc + slot * tile_b3_elems(P.D) : nullptr,
                  w.kmaxc + slot, scores_on_tiles(P) ? w.kbadc + slot : nullptr);
    w.ktag[slot] = need_kr || !keep ? -1 : tag;
  }
  w.kmax = w.kmaxc[slot];
  if (scores_on_tiles(P)) {
    w.kb = w.kbc + slot * tile_b3_elems(P.D);
    w.kbad = w.kbadc[slot];
  }
}

static void fwd_item(const Problem& P, const FwdPlan& F, const FwdItem& it, Buf& w) {
  const Layout& L = P.lay;
  const int64_t G = P.G, bq = L.bq, b = it.b, hkv = it.hkv, i = it.i;
  const int64_t r0 = tile_r0(P, i), nr = tile_nr(P, i), M = G * nr;
  const int64_t Dp = P.Dp, Dvp = P.Dvp, code_stride = L.bm * L.hm * bq;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hkv * G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t R = g * nr + r;
      load_q(P, b, h, r0 + r, w.q + R * Dp, w.q64 + R * Dp, w.qn + R);
      w.mrow[R] = NEG_INF;
      w.l[R] = 0.0;
      w.slope[R] = P.mods.slopes ? P.mods.slopes[h] : 0.0f;
      w.qpos[R] = r0 + r + P.Nk - P.Nq;
      w.bitoff[R] = ((L.bm > 1 ? b : 0) * L.hm + (L.hm > 1 ? h : 0)) * bq + r;
      if (P.drop.on) w.rowh[R] = drop_row_hash(P.drop, b * P.H + h, r0 + r);
    }
  }
  // the tile unit reads the item's Q rows as A tiles for every key tile: packed once here
  w.qa_on = (on_tiles(P) && !P.dot_scores && P.D <= TILE_K_MAX) || scores_on_tiles(P);
  // (bfloat16: scaled, where the scale is a power of two: q·k·2ᵉ rounds as (q·k)·2ᵉ does)
  int scale_exp = 0;
  w.qa_scaled = on_tiles(P) && w.qa_on && __builtin_frexpf(P.mods.scale, &scale_exp) == 0.5f;
  w.qbad_any = false;
  if (scores_on_tiles(P)) {
    tile_pack_rows3(M, P.D, w.q, Dp, w.qa, w.qbad, tile_scale_folds(P.mods.scale) ? P.mods.scale : 1.0f);
    for (int64_t R = 0; R < M; ++R) w.qbad_any = w.qbad_any || w.qbad[R];
  }
  else if (w.qa_on)
    tile_pack_rows(M, P.D, w.q, Dp, w.qa, w.qa_scaled ? P.mods.scale : 1.0f);
  __builtin_memset(w.acc, 0, (size_t)(M * Dvp) * 8);
  // bfloat16 on the tile unit: P·V adds into a float accumulator held by the tiles (its sums
  // of ≤ 4096 keys round at 2⁻²⁴ per add, far below the output's bfloat16 rounding), moved to
  // acc at the end or at the first key tile whose V is not all finite
  bool tiles_pv = on_tiles(P) && Dvp <= TILE_PV_N;
  if (tiles_pv) __builtin_memset(w.accf, 0, (size_t)((M + 15) / 16 * 16 * Dvp) * 4);
  auto accf_to_acc = [&] {
    for (int64_t x = 0; x < M * Dvp; ++x) w.acc[x] = (double)w.accf[x];
  };
  // bfloat16 on the tile unit: each row's l kept in 16 float lanes (l = l·α + P's lanes, no
  // horizontal sum per tile; float sums round at 2⁻²⁴, far below the output's rounding), summed
  // in double at the end
  if (on_tiles(P)) __builtin_memset(w.lv, 0, (size_t)(M * 16) * 4);
  const V16 keep_scale = v_set(P.drop.keep_scale), zero = v_set(0.0f);
  for (int64_t e = it.e0; e < it.e1; ++e) {
    const int64_t j = L.col_idx[e], code = L.code[e], c0 = tile_c0(P, j), kw = tile_kw(P, j);
    const uint64_t edge = kw == BK ? ~0ull : ((1ull << kw) - 1);
    const float* krows = w.kr;
    int64_t ldk = Dp;
    if (!P.dot_scores) {
      const bool whole = P.dtype == DT_F32 && kw == BK && P.D == Dp;  // kt from the tensor, no kr
      fwd_key_tile(P, F, b, hkv, j, c0, kw, !whole && P.precise_scores, w, it.e1 - it.e0 <= KT_SLOTS);
      if (whole) {
        krows = (const float*)row_of(P.k, P.dtype, b, hkv, c0);
        ldk = P.k.sn;
      }
    } else if (P.dtype == DT_F32) {
      krows = (const float*)row_of(P.k, P.dtype, b, hkv, c0);
      ldk = P.k.sn;
    } else {
      for (int64_t jj = 0; jj < kw; ++jj)
        load_row(row_of(P.k, P.dtype, b, hkv, c0 + jj), P.dtype, P.D, Dp, w.kr + jj * Dp);
    }
    const float* vb;
    int64_t ldv;
    if (P.dtype == DT_F32 && P.Dv == Dvp && kw == BK) {
      vb = (const float*)row_of(P.v, P.dtype, b, hkv, c0);
      ldv = P.v.sn;
    } else {
      pack_v(P, b, hkv, c0, kw, w, false, false);
      vb = w.vr;
      ldv = Dvp;
    }
    if (P.drop.on) drop_col_hash(P.drop, c0, w.colh);
    const bool stream = P.dot_scores && P.dtype == DT_F32 && vb != w.vr;  // K, V read in place
    // Rows in groups of 16 (PARTIAL tiles): a group computes only the span of 16-key chunks that
    // some row of it may attend (the corner of a band or a segment); the other scores are never
    // read (the bits select −inf there) and the other chunks' P·V terms would be exact zeros.
    const int64_t n_chains = (kw + 15) / 16;
    const int64_t gs = code != TILE_FULL && !P.dot_scores ? group_spans(P, code, edge, n_chains, M, w) : M;
    if (gs == M) {
      w.glo[0] = 0;
      w.ghi[0] = (int8_t)(n_chains - 1);
      tile_scores(P, M, w.q, w.q64, Dp, krows, ldk, kw, w, stream ? vb : nullptr, ldv);
    } else {
      for (int64_t R0 = 0; R0 < M; R0 += gs) {
        const int64_t lo = w.glo[R0 / gs], hi = w.ghi[R0 / gs];
        if (lo <= hi)
          block_scores(P, w, R0, imin(gs, M - R0), lo, 16 * (hi - lo + 1));
      }
    }
    exact_rows(P, M, krows, ldk, kw, w);
    const bool v_finite = tile_v_finite(P, F, b, hkv, j, vb, kw, ldv), tiles_p = tiles_pv && v_finite;
    // P (keys 16q … 16q+31, q even) as the tiles read it (rounded to bfloat16) or as floats
    auto put_p = [&](int64_t R, int64_t q, V16 x0, V16 x1) {
      if (tiles_p) {
        tile_put_p(x0, x1, w.pa, R, q);
      } else {
        v_store(w.p + R * BK + 16 * q, x0);
        v_store(w.p + R * BK + 16 * q + 16, x1);
      }
    };
    for (int64_t R = 0; R < M; ++R) {
      float* srow = w.s + R * BK;
      const float* lorow = lo_row(P, w, R);
      const uint64_t allowed = code == TILE_FULL ? edge : L.bits[code * code_stride + w.bitoff[R]];
      w.alpha[R] = 1.0;
      if (allowed == 0) {
        put_p(R, 0, zero, zero);
        put_p(R, 2, zero, zero);
        continue;
      }
      row_scores(P.mods, w.slope[R], w.qpos[R], c0, allowed, srow, srow, nullptr);
      V16 mx = v_max(v_max(v_load(srow), v_load(srow + 16)), v_max(v_load(srow + 32), v_load(srow + 48)));
      // the row's maximum moves only where some score exceeds it: the horizontal maximum is
      // formed only then (after a row's first tiles, rarely)
      const float mold = w.mrow[R];
      float mnew = mold;
      if (v_any_gt(mx, mold)) {
        const float tmax = v_hmax(mx);
        mnew = tmax > mold ? tmax : mold;
      }
      if (mnew == NEG_INF) {
        // nothing above −inf: an empty row so far, unless an allowed score is NaN (a NaN in
        // q or k, which the maxima above pass over): that row is NaN, as in the formula
        if (!has_nan(srow)) {
          put_p(R, 0, zero, zero);
          put_p(R, 2, zero, zero);
          continue;
        }
        mnew = __builtin_nanf("");
      }
      const V16 mv = v_set(mnew);
      V16 sum = zero, ev[4];
      for (int64_t q = 0; q < 4; ++q) {
        ev[q] = exp_scores(srow, lorow, q, mv);
        sum = v_add(sum, ev[q]);
        if (P.drop.on)
          ev[q] = v_select(drop_keep(P.drop, w.rowh[R], w.colh + 16 * q), v_mul(ev[q], keep_scale), zero);
      }
      put_p(R, 0, ev[0], ev[1]);
      put_p(R, 2, ev[2], ev[3]);
      const double alpha =
          mold == mnew ? 1.0 : (mold == NEG_INF ? 0.0 : __builtin_exp((double)mold - (double)mnew));
      if (on_tiles(P)) {
        const V16 lr = v_load(w.lv + 16 * R);
        v_store(w.lv + 16 * R, alpha == 1.0 ? v_add(lr, sum) : v_fma(lr, v_set((float)alpha), sum));
      } else {
        w.l[R] = w.l[R] * alpha + (double)v_hsum(sum);
      }
      w.mrow[R] = mnew;
      w.alpha[R] = alpha;
    }
    // P V in float chains of PV_CHAIN keys (a whole tile; 16 portable), summed in double
    if (tiles_p) {  // the tiles add P V over the whole tile (P = 0 outside the groups' spans)
      tile_pv(M, Dvp, kw, w.pa, vb, ldv, w.accf, Dvp, w.alpha);
      continue;
    }
    if (tiles_pv) {  // from here on the float kernels, which skip P = 0 exactly
      accf_to_acc();
      tiles_pv = false;
    }
    for (int64_t R0 = 0; R0 < M; R0 += gs) {
      const int64_t gm = imin(gs, M - R0), lo = w.glo[R0 / gs], hi = w.ghi[R0 / gs];
      if (lo > hi) continue;  // no row of the group attends here: acc unchanged (α = 1)
      const int64_t k0 = 16 * lo, k1 = imin(kw, 16 * (hi + 1));
      if (v_finite) {  // the micro-kernel adds the chains' sum straight into acc
        gemm_chain(gm, Dvp, k1 - k0, w.p + R0 * BK + k0, BK, vb + k0 * ldv, ldv, nullptr, Dvp,
                   0.0, w.acc + R0 * Dvp, w.alpha + R0);
        continue;
      }
      int64_t nc = 0;  // the same chains, from the same first key, in w.o
      for (int64_t c0 = k0; c0 < k1; c0 += PV_CHAIN, ++nc)
        gemm_zero_safe(gm, Dvp, imin(PV_CHAIN, k1 - c0), w.p + R0 * BK + c0, BK, 1, vb + c0 * ldv,
                       ldv, w.o + nc * M * Dvp + R0 * Dvp, Dvp);
      for (int64_t R = R0; R < R0 + gm; ++R)
        acc_chains(w.acc + R * Dvp, w.o + R * Dvp, M * Dvp, nc, w.alpha[R], Dvp);
    }
  }
  if (tiles_pv) accf_to_acc();
  if (on_tiles(P))
    for (int64_t R = 0; R < M; ++R) {
      double l = 0.0;
      for (int64_t x = 0; x < 16; ++x) l += (double)w.lv[16 * R + x];
      w.l[R] = l;
    }
  const int64_t key = (b * P.Hkv + hkv) * L.nqb + i;
  const int32_t nsplit = F.nsplit[key];
  if (nsplit <= 1) {
    finish_rows(P, b, hkv, r0, nr, w.mrow, w.l, w.acc, Dvp, w.tmp);
    return;
  }
  // one split of a long row of tiles: store the partial (m, l, acc); the last split to finish
  // merges all of them in split order
  const int64_t slot = F.part_base[key] + it.split, mm = F.mmax;
  __builtin_memcpy(F.part_m + slot * mm, w.mrow, (size_t)M * 4);
  __builtin_memcpy(F.part_l + slot * mm, w.l, (size_t)M * 8);
  __builtin_memcpy(F.part_acc + slot * mm * Dvp, w.acc, (size_t)(M * Dvp) * 8);
  if (__atomic_fetch_add(&F.done[key], 1, __ATOMIC_ACQ_REL) + 1 != nsplit) return;
  const int64_t first = F.part_base[key];
  for (int64_t R = 0; R < M; ++R) {
    float mstar = NEG_INF;
    for (int64_t s = 0; s < nsplit; ++s) {
      const float ms = F.part_m[(first + s) * mm + R];
      mstar = ms > mstar || ms != ms ? ms : mstar;  // a NaN row max (see above) is kept
      if (mstar != mstar) break;
    }
    double lsum = 0.0;
    double* acc = w.acc + R * Dvp;
    for (int64_t d = 0; d < Dvp; ++d) acc[d] = 0.0;
    if (mstar != NEG_INF) {
      for (int64_t s = 0; s < nsplit; ++s) {
        const float ms = F.part_m[(first + s) * mm + R];
        if (ms == NEG_INF) continue;
        const double wgt = __builtin_exp((double)ms - (double)mstar);
        lsum += F.part_l[(first + s) * mm + R] * wgt;
        const double* pa = F.part_acc + ((first + s) * mm + R) * Dvp;
        for (int64_t d = 0; d < Dvp; ++d) acc[d] += pa[d] * wgt;
      }
    }
    w.mrow[R] = mstar;
    w.l[R] = lsum;
  }
  finish_rows(P, b, hkv, r0, nr, w.mrow, w.l, w.acc, Dvp, w.tmp);
}

static void forward_worker(const Problem& P, const FwdPlan& F, ItemQueue* items, int32_t* error) {
  Buf w;
  if (!buf_alloc(w, P, F.mmax)) {
    __atomic_store_n(error, 1, __ATOMIC_RELAXED);
    return;
  }
  if (!P.dot_scores && !ktc_alloc(w, P)) {
    __atomic_store_n(error, 1, __ATOMIC_RELAXED);
    buf_free(w);
    return;
  }
  for (const int me = queue_join(*items);;) {
    const int64_t k = queue_take(*items, me);
    if (k < 0) break;
    fwd_item(P, F, F.items[k], w);
  }
  if (P.stream_out) stream_fence();  // the output's non-temporal stores, before the call returns
  buf_free(w);
}

// ------------------------------------------------------------------------- backward

static void write_dq(const Problem& P, int64_t b, int64_t hkv, int64_t g0, int64_t g1, int64_t r0,
                     int64_t nr, const double* acc, float* tmp) {
  const int64_t bq = P.lay.bq, Dp = P.Dp;
  const double scale = P.mods.scale64;
  const int64_t es = elem_size(P.dtype);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t h = hkv * P.G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const double* a = acc + ((g - g0) * bq + r) * Dp;
      for (int64_t d = 0; d < P.D; ++d) tmp[d] = (float)(a[d] * scale);
      store_row((char*)P.dq + (((b * P.H + h) * P.Nq + r0 + r) * P.D) * es, P.dtype, tmp, P.D);
    }
  }
}

// the dQ of heads g0 … g1 − 1 of touched entry t is complete for this chunk: write it, or store
// it as this chunk's partial and, if it is the last one (of every chunk and pass), sum all
// partials in chunk order and write that
static void flush_dq(const Problem& P, const BwdPlan& Bp, int64_t b, int64_t hkv, int64_t t,
                     int64_t g0, int64_t g1, const double* acc, Buf& w) {
  const int64_t bq = P.lay.bq, i = Bp.t_tile[t], r0 = tile_r0(P, i), nr = tile_nr(P, i);
  const int64_t head = bq * P.Dp, tile = P.G * head;
  if (Bp.t_slot[t] < 0) {
    write_dq(P, b, hkv, g0, g1, r0, nr, acc, w.tmp);
    return;
  }
  double* dst = Bp.store + ((Bp.t_slot[t] * P.B + b) * P.Hkv + hkv) * tile;
  __builtin_memcpy(dst + g0 * head, acc, (size_t)((g1 - g0) * head) * 8);
  const int64_t key = (b * P.Hkv + hkv) * P.lay.nqb + i;
  const int64_t passes = (P.G + Bp.heads - 1) / Bp.heads;
  const int64_t n = (Bp.q_ptr[i + 1] - Bp.q_ptr[i]) * passes;
  if (__atomic_fetch_add(&Bp.done[key], 1, __ATOMIC_ACQ_REL) + 1 != n) return;
  double* sum = w.acc;
  __builtin_memset(sum, 0, (size_t)tile * 8);
  for (int64_t s = Bp.q_ptr[i]; s < Bp.q_ptr[i + 1]; ++s) {
    const double* part = Bp.store + ((Bp.q_slots[s] * P.B + b) * P.Hkv + hkv) * tile;
    for (int64_t x = 0; x < tile; ++x) sum[x] += part[x];
  }
  write_dq(P, b, hkv, 0, P.G, r0, nr, sum, w.tmp);
}

// K_j, V_j of (b, hkv) as the backward reads them: rows and transposed (Vᵀ in double only where
// dP needs it, dp_operands), and the dropout hashes of their columns.
static inline void bwd_pack(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw,
                            Buf& w) {
  pack_k(P, b, hkv, c0, kw, w, true, true);
  pack_v(P, b, hkv, c0, kw, w, true, true);
  if (P.precise_scores && !P.dot_scores) w.kmax = key_norm_max(P, w.kt, kw);
  if (scores_on_tiles(P)) w.kbad = tile_pack_keys3(P.D, w.kt, BK, w.kb);
  if (w.vb3) w.vbad = tile_pack_keys3(P.Dv, w.vt, BK, w.vb3);
  if (P.drop.on) drop_col_hash(P.drop, c0, w.colh);
}

// Row r of a tile, query row r0 + r of head h, as the backward reads it: q, dO (in double only
// where dP needs it, dp_operands), 1/l, m, the ALiBi slope, the position, the mask-bit offset,
// the dropout hash. The column pass (bwd_item) and the row pass (delta_item) both load rows with
// it, so the row pass recomputes P and dP from the very same inputs.
static inline void bwd_row(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t r, Buf& w,
                           bool rows_in_place = false) {
  const Layout& L = P.lay;
  const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
  if (rows_in_place) {  // w.q and w.dO point at the tensors' rows: the norm only
    w.qn[r] = row_norm(P, w.q + r * P.Dp);
  } else {
    load_q(P, b, h, r0 + r, w.q + r * P.Dp, w.q64 + r * P.Dp, w.qn + r);
    load_row(row_of(P.dout, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.dO + r * P.Dvp);
  }
  const double lr = P.l[idx];
  w.inv_l[r] = lr > 0.0 ? 1.0 / lr : 0.0;
  w.mrow[r] = P.m[idx];
  w.slope[r] = P.mods.slopes ? P.mods.slopes[h] : 0.0f;
  w.qpos[r] = r0 + r + P.Nk - P.Nq;
  w.bitoff[r] = ((L.bm > 1 ? b : 0) * L.hm + (L.hm > 1 ? h : 0)) * L.bq + r;
  if (P.drop.on) w.rowh[r] = drop_row_hash(P.drop, b * P.H + h, r0 + r);
}

// dP's operands in double, where gemm_dp takes its exact form (`exact`: a query tile holding a
// peaked row; every tile where the ISA has no float form, DP_FLOAT_CHAINS): the packed column's
// Vᵀ once per column (vt_ready) and the nr dO rows of the tile.
static inline void dp_operands(const Problem& P, int64_t nr, bool& vt_ready, Buf& w) {
  if (!vt_ready) {
    for (int64_t x = 0; x < P.Dv * BK; ++x) w.vt64[x] = (double)w.vt[x];
    vt_ready = true;
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t d = 0; d < P.Dv; ++d) w.dO64[r * P.Dv + d] = (double)w.dO[r * P.Dvp + d];
}

// The backward's float chains for dQ, dK and dV: ACC_CHAIN terms for float32 inputs (docs/cpu.md,
// Accuracy: one float sum over a tile's rows broke the rule); for 16-bit inputs, whose gradients
// round to 16 bits, one chain per tile (≤ 256 terms, a float rounding of ≤ 256·2⁻²⁴ against
// bf16's 2⁻⁹), summed in double across tiles, as their scores and P·V are plain float sums.
constexpr int64_t ONE_CHAIN = int64_t(1) << 40;

static bool bwd_item(const Problem& P, const BwdPlan& Bp, const BwdItem& it, Buf& w) {
  const Layout& L = P.lay;
  const int64_t acc_chain = P.dtype == DT_F32 ? ACC_CHAIN : ONE_CHAIN;
  const int64_t G = P.G, bq = L.bq, b = it.b, hkv = it.hkv, c = it.c;
  const int64_t Dp = P.Dp, Dvp = P.Dvp, code_stride = L.bm * L.hm * bq;
  const int64_t j0 = Bp.chunk_j[c], j1 = Bp.chunk_j[c + 1], t0 = Bp.chunk_t[c], t1 = Bp.chunk_t[c + 1];
  // heads g0 … g1 − 1 per pass over the chunk; dK_j, dV_j of its columns kept between passes
  const int64_t gs = Bp.heads, tile = gs * bq * Dp, live = Bp.chunk_live[c];
  const int64_t kvs = BK * (Dp + Dvp), kv_need = gs < G ? (j1 - j0) * kvs : 0;
  if (kv_need > w.dkv_cap) {
    free(w.dkv);
    w.dkv = (double*)alloc64(kv_need * 8 + 64);
    w.dkv_cap = w.dkv ? kv_need : 0;
    if (!w.dkv) return false;
  }
  const int64_t pool_need = imax(live * tile, 1);  // D = 0: a tile of no doubles, a real pool
  if (pool_need > w.pool_cap) {
    free(w.pool);
    w.pool = (double*)alloc64(pool_need * 8 + 64);
    w.pool_cap = w.pool ? pool_need : 0;
    if (!w.pool) return false;
  }
  const int64_t qpe = scores_on_tiles(P) ? tile_a3_elems(bq, P.D) : 0;  // one entry's parts
  const int64_t dpe = w.vb3 ? tile_a3_elems(bq, P.Dv) : 0;               // … of dO's rows
  if (qpe && live * gs > w.parts_cap) {
    const bool ok = parts_alloc(w.qc, live * gs, qpe, bq) && parts_alloc(w.dc, live * gs, imax(dpe, 1), bq);
    w.parts_cap = ok ? live * gs : 0;
    if (!ok) return false;
  }
  if (imax(t1 - t0, live) > w.slot_cap) {
    free(w.slot_of);
    free(w.free_slots);
    w.slot_cap = imax(t1 - t0, live);
    w.slot_of = (int32_t*)malloc((size_t)w.slot_cap * 4);
    w.free_slots = (int32_t*)malloc((size_t)w.slot_cap * 4);
    if (!w.slot_of || !w.free_slots) {
      w.slot_cap = 0;
      return false;
    }
  }
  const double scale = P.mods.scale64;
  const bool cap = P.mods.cap != 0.0f;
  const V16 keep_scale = v_set(P.drop.keep_scale), zero = v_set(0.0f);
  const double drop_mul = P.drop.on ? (double)P.drop.keep_scale : 1.0;
  const int64_t es = elem_size(P.dtype);
  bool vt_ready = false;
  float* const qbuf = w.q;
  float* const dobuf = w.dO;
  const bool rows_in_place = P.dtype == DT_F32 && P.precise_scores && !P.dot_scores &&
                             P.D == P.Dp && P.Dv == P.Dvp && P.q.sn == P.Dp && P.dout.sn == P.Dvp;
  for (int64_t g0 = 0; g0 < G; g0 += gs) {
  const int64_t g1 = imin(G, g0 + gs);
  int64_t n_free = live;
  for (int64_t s = 0; s < live; ++s) w.free_slots[s] = (int32_t)(live - 1 - s);
  int64_t next_first = t0, next_flush = 0;
  for (int64_t j = j0; j < j1; ++j) {
    while (next_first < t1 && Bp.t_first[next_first] == j) {
      const int32_t s = w.free_slots[--n_free];
      w.slot_of[next_first - t0] = s;
      __builtin_memset(w.pool + s * tile, 0, (size_t)tile * 8);
      if (qpe) {
        __builtin_memset(w.qc.state + s * gs, PARTS_EMPTY, (size_t)gs);
        __builtin_memset(w.dc.state + s * gs, PARTS_EMPTY, (size_t)gs);
      }
      ++next_first;
    }
    const int64_t e0 = L.col_ptr[j], e1 = L.col_ptr[j + 1];
    const int64_t c0 = tile_c0(P, j), kw = tile_kw(P, j);
    const uint64_t edge = kw == BK ? ~0ull : ((1ull << kw) - 1);
    double* const dk64 = gs < G ? w.dkv + (j - j0) * kvs : w.dk64;
    double* const dv64 = gs < G ? dk64 + BK * Dp : w.dv64;
    if (e1 > e0) {
      bwd_pack(P, b, hkv, c0, kw, w);
      vt_ready = false;
      if (g0 == 0) {
        __builtin_memset(dk64, 0, (size_t)(BK * Dp) * 8);
        __builtin_memset(dv64, 0, (size_t)(BK * Dvp) * 8);
      }
    }
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = L.row_idx[e], code = L.code_t[e], r0 = tile_r0(P, i), nr = tile_nr(P, i);
      const bool exact = P.peaked[(b * P.Hkv + hkv) * L.nqb + i];  // dP exact (gemm_dp)
      double* qacc = w.pool + w.slot_of[Bp.local[e]] * tile;
      // float32 rows of Q and dO as the products read them (ld Dp, Dvp) already: read in place,
      // not copied per (column, query tile); not the last query tile, so that reads a vector
      // past a tile's last row stay inside the tensor
      const bool in_place = rows_in_place && i + 1 < L.nqb;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t h = hkv * G + g;
        w.q = in_place ? (float*)row_of(P.q, P.dtype, b, h, r0) : qbuf;
        w.dO = in_place ? (float*)row_of(P.dout, P.dtype, b, h, r0) : dobuf;
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
          bwd_row(P, b, h, r0, r, w, in_place);
          w.delta[r] = P.delta[idx];  // the row pass's Δ (delta_item)
        }
        const int64_t ci = qpe ? w.slot_of[Bp.local[e]] * gs + g - g0 : 0;  // the caches' entry
        if (qpe) {  // the rows' parts, for the scores
          parts_of(w.qc, ci, qpe, bq, nr, P.D, w.q, Dp, tile_scale_folds(P.mods.scale) ? P.mods.scale : 1.0f);
          w.qa = w.qc.parts + ci * qpe;
          w.qbad = w.qc.bad + ci * bq;
          w.qa_on = true;
        }
        tile_scores(P, nr, w.q, w.q64, Dp, w.kr, Dp, kw, w);
        exact_rows(P, nr, w.kr, Dp, kw, w);
        if (exact || !DP_FLOAT_CHAINS) dp_operands(P, nr, vt_ready, w);
        // float32 on the tiles: dO Vᵀ as the scores are formed (dO's rows' parts against the V
        // tile's), gemm_dp's float chains, unless the split cannot carry some value of either;
        // bfloat16: dO Vᵀ on the tiles (one float chain over Dv, widened); else gemm_dp
        if (!exact && dpe && w.vbad == 0 && parts_of(w.dc, ci, dpe, bq, nr, P.Dv, w.dO, Dvp, 1.0f) == PARTS_PACKED) {
          tile_chain3_f64(nr, P.Dv, w.dc.parts + ci * dpe, w.vb3, w.dp64, BK);
        } else if (!exact && bwd_on_tiles(P) && tile_gemm(nr, BK, P.Dv, w.dO, Dvp, nullptr, w.vt, BK, w.o, BK)) {
          for (int64_t x = 0; x < nr * BK; ++x) w.dp64[x] = (double)w.o[x];
        } else {
          gemm_dp(nr, BK, P.Dv, w.dO, Dvp, w.dO64, w.vt, w.vt64, BK, w.dp64, BK, exact);
        }
        for (int64_t r = 0; r < nr; ++r) {
          float* srow = w.s + r * BK;
          const float* lorow = lo_row(P, w, r);
          float* prow = w.p + r * BK;
          float* dsrow = w.ds + r * BK;
          float* frow = w.dfac + r * BK;
          const uint64_t allowed = code == TILE_FULL ? edge : L.bits[code * code_stride + w.bitoff[r]];
          if (allowed == 0 || w.inv_l[r] == 0.0) {
            for (int64_t q = 0; q < 4; ++q) {
              v_store(prow + 16 * q, zero);
              v_store(dsrow + 16 * q, zero);
            }
            continue;
          }
          row_scores(P.mods, w.slope[r], w.qpos[r], c0, allowed, srow, srow, cap ? frow : nullptr);
          const V16 mv = v_set(w.mrow[r]);
          const double inv = w.inv_l[r], delta = w.delta[r];
          for (int64_t q = 0; q < 4; ++q) {
            const V16 p = v_mul_f64(exp_scores(srow, lorow, q, mv), inv);
            V16 pd = p;
            M16 keep = m_bits(0xFFFFu);
            if (P.drop.on) {
              keep = drop_keep(P.drop, w.rowh[r], w.colh + 16 * q);
              pd = v_select(keep, v_mul(p, keep_scale), zero);
            }
            V16 ds = v_mul(p, v_dsub(w.dp64 + r * BK + 16 * q, drop_mul, delta, keep));
            if (cap) ds = v_mul(ds, v_load(frow + 16 * q));
            v_store(prow + 16 * q, pd);
            v_store(dsrow + 16 * q, ds);
          }
        }
        if (P.exact_dkv) {
          gemm_acc_f64(kw, Dvp, nr, w.p, 1, BK, w.dO, Dvp, dv64, Dvp);
          gemm_acc_f64(kw, Dp, nr, w.ds, 1, BK, w.q, Dp, dk64, Dp);
        } else if (bwd_on_tiles(P)) {  // Pᵀ and dSᵀ in two parts (keys ≥ kw: P = dS = 0)
          tile_pack_a(BK, nr, w.p, BK, true, 2, w.ta);
          tile_acc(BK, Dvp, nr, w.ta, 2, w.dO, Dvp, w.tb, dv64, Dvp);
          tile_pack_a(BK, nr, w.ds, BK, true, 2, w.ta);
          tile_acc(BK, Dp, nr, w.ta, 2, w.q, Dp, w.tb, dk64, Dp);
        } else {
          gemm_acc(kw, Dvp, nr, w.p, 1, BK, w.dO, Dvp, dv64, Dvp, w.o, acc_chain);
          gemm_acc(kw, Dp, nr, w.ds, 1, BK, w.q, Dp, dk64, Dp, w.o, acc_chain);
        }
        if (P.exact_dq) {
          gemm_acc_f64(nr, Dp, kw, w.ds, BK, 1, w.kr, Dp, qacc + (g - g0) * bq * Dp, Dp);
        } else if (bwd_on_tiles(P)) {
          tile_pack_a(nr, BK, w.ds, BK, false, 2, w.ta);
          tile_acc(nr, Dp, BK, w.ta, 2, w.kr, Dp, w.tb, qacc + (g - g0) * bq * Dp, Dp);
        } else {
          gemm_acc(nr, Dp, kw, w.ds, BK, 1, w.kr, Dp, qacc + (g - g0) * bq * Dp, Dp, w.o, acc_chain);
        }
      }
    }
    if (e1 > e0 && g1 == G) {
      for (int64_t jj = 0; jj < kw; ++jj) {
        const int64_t row = (b * P.Hkv + hkv) * P.Nk + c0 + jj;
        for (int64_t d = 0; d < P.D; ++d) w.tmp[d] = (float)(dk64[jj * Dp + d] * scale);
        store_row((char*)P.dk + row * P.D * es, P.dtype, w.tmp, P.D);
        for (int64_t d = 0; d < P.Dv; ++d) w.tmp[d] = (float)dv64[jj * Dvp + d];
        store_row((char*)P.dv + row * P.Dv * es, P.dtype, w.tmp, P.Dv);
      }
    }
    while (next_flush < t1 - t0) {
      const int64_t t = t0 + Bp.t_flush[t0 + next_flush];
      if (Bp.t_last[t] != j) break;
      const int32_t s = w.slot_of[t - t0];
      flush_dq(P, Bp, b, hkv, t, g0, g1, w.pool + s * tile, w);
      w.free_slots[n_free++] = s;
      ++next_flush;
    }
  }
  }
  w.q = qbuf;
  w.dO = dobuf;
  return true;
}

// The backward's row pass: Δ of every row, once. For query tiles holding a peaked row:
// Δ_i = Σ_j P_ij dP̃_ij / Σ_j P_ij − dlse_i over the kept tiles of query tile i, where P and dP̃
// (dP, dropped and rescaled) are computed exactly as bwd_item computes them (same packing, same
// instructions: the same bits).
// dS = P ∘ (dP̃ − Δ) then sums to zero over each row up to the rounding of P, as the softmax's
// gradient does. Δ = dO·O from the saved output carries the rounding of O (to its dtype, and of
// the forward's P, which are not the backward's bits); dP̃_j − Δ is of the order of
// (1 − max_j P_ij)·|dP̃|, so that rounding is amplified by 1 / (1 − max P): harmless while the
// largest weight 1/l is at most PEAKED, all of a peaked row's gradient beyond it. Rows of the
// other tiles get Δ = dO·O − dlse (no pass over their tiles), once here rather than once per
// key column in bwd_item.
static const double PEAKED = 0.5;

static void delta_item(const Problem& P, int64_t b, int64_t hkv, int64_t i, Buf& w) {
  const Layout& L = P.lay;
  const int64_t G = P.G, bq = L.bq, r0 = tile_r0(P, i), nr = tile_nr(P, i);
  bool peaked = false;
  for (int64_t g = 0; g < G && !peaked; ++g)
    for (int64_t r = 0; r < nr && !peaked; ++r) {
      const double lr = P.l[(b * P.H + hkv * G + g) * P.Nq + r0 + r];
      peaked = lr > 0.0 && lr * PEAKED < 1.0;  // largest weight 1/l > PEAKED
    }
  P.peaked[(b * P.Hkv + hkv) * L.nqb + i] = peaked;
  if (!peaked) {  // Δ = dO·O − dlse, the products exact in double, summed in order
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t h = hkv * G + g, idx = (b * P.H + h) * P.Nq + r0 + r;
        load_row(row_of(P.dout, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.dO);
        load_row(row_of(P.out, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.tmp);
        double delta = 0.0;
        for (int64_t d = 0; d < P.Dv; ++d) delta = delta + (double)w.dO[d] * (double)w.tmp[d];
        if (P.dlse) delta -= (double)P.dlse[idx];
        P.delta[idx] = delta;
      }
    return;
  }
  const int64_t Dp = P.Dp, code_stride = L.bm * L.hm * bq;
  const V16 one = v_set(1.0f), zero = v_set(0.0f);
  const double drop_mul = P.drop.on ? (double)P.drop.keep_scale : 1.0;
  double* sp = w.l;       // Σ_j P_ij, per row of the G heads
  double* spd = w.alpha;  // Σ_j P_ij dP̃_ij
  for (int64_t R = 0; R < G * nr; ++R) sp[R] = spd[R] = 0.0;
  for (int64_t e = L.row_ptr[i]; e < L.row_ptr[i + 1]; ++e) {
    const int64_t j = L.col_idx[e], code = L.code[e], c0 = tile_c0(P, j), kw = tile_kw(P, j);
    const uint64_t edge = kw == BK ? ~0ull : ((1ull << kw) - 1);
    bwd_pack(P, b, hkv, c0, kw, w);
    bool vt_ready = false;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = hkv * G + g;
      for (int64_t r = 0; r < nr; ++r) bwd_row(P, b, h, r0, r, w);
      tile_scores(P, nr, w.q, w.q64, Dp, w.kr, Dp, kw, w);
      exact_rows(P, nr, w.kr, Dp, kw, w);
      dp_operands(P, nr, vt_ready, w);
      gemm_dp(nr, BK, P.Dv, w.dO, P.Dvp, w.dO64, w.vt, w.vt64, BK, w.dp64, BK, true);
      for (int64_t r = 0; r < nr; ++r) {
        float* srow = w.s + r * BK;
        const float* lorow = lo_row(P, w, r);
        float* prow = w.p + r * BK;
        float* krow = w.ds + r * BK;  // 1 where the weight is kept (dropout), else 0
        const uint64_t allowed = code == TILE_FULL ? edge : L.bits[code * code_stride + w.bitoff[r]];
        if (allowed == 0 || w.inv_l[r] == 0.0) continue;
        row_scores(P.mods, w.slope[r], w.qpos[r], c0, allowed, srow, srow, nullptr);
        const V16 mv = v_set(w.mrow[r]);
        const double inv = w.inv_l[r];
        for (int64_t q = 0; q < 4; ++q) {
          const V16 p = v_mul_f64(exp_scores(srow, lorow, q, mv), inv);
          M16 keep = m_bits(0xFFFFu);
          if (P.drop.on) keep = drop_keep(P.drop, w.rowh[r], w.colh + 16 * q);
          v_store(prow + 16 * q, p);
          v_store(krow + 16 * q, v_select(keep, one, zero));
        }
        double a = 0.0, c = 0.0;
        const double* dprow = w.dp64 + r * BK;
        for (int64_t x = 0; x < BK; ++x) {
          const double px = (double)prow[x];
          a += px;
          if (krow[x] != 0.0f) c += px * (dprow[x] * drop_mul);
        }
        sp[g * nr + r] += a;
        spd[g * nr + r] += c;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hkv * G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
      const double a = sp[g * nr + r];
      double d = a > 0.0 ? spd[g * nr + r] / a : 0.0;
      if (P.dlse) d -= (double)P.dlse[idx];
      P.delta[idx] = d;
    }
  }
}

static void delta_worker(const Problem& P, ItemQueue* items, int32_t* error) {
  Buf w;
  if (!buf_alloc(w, P, imax(P.lay.bq, P.G * P.lay.bq))) {
    __atomic_store_n(error, 1, __ATOMIC_RELAXED);
    return;
  }
  for (const int me = queue_join(*items);;) {
    const int64_t k = queue_take(*items, me);
    if (k < 0) break;
    const int64_t i = k % P.lay.nqb, bh = k / P.lay.nqb;
    delta_item(P, bh / P.Hkv, bh % P.Hkv, i, w);
  }
  buf_free(w);
}

static void backward_worker(const Problem& P, const BwdPlan& Bp, ItemQueue* items, int32_t* error) {
  Buf w;
  if (!buf_alloc(w, P, imax(P.lay.bq, P.G * P.lay.bq))) {
    __atomic_store_n(error, 1, __ATOMIC_RELAXED);
    return;
  }
  for (const int me = queue_join(*items);;) {
    const int64_t k = queue_take(*items, me);
    if (k < 0) break;
    if (!bwd_item(P, Bp, Bp.items[k], w)) {
      __atomic_store_n(error, 1, __ATOMIC_RELAXED);
      break;
    }
  }
  buf_free(w);
}
