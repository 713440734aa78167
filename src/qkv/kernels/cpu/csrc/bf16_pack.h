// The bfloat16 operands of a path that multiplies bfloat16 pairs (tiles_amx.h's tile unit,
// tiles_dpbf16.h's dot-product instruction): both read the same packed layouts, written here.
// Included by those tile layers, inside the path's namespace, after simd_avx512.h; needs
// AVX512-BF16 (the conversions) and AVX-512 F/BW.
//
// An A block is 16 rows × 32 bfloat16 (512 elements; row r at +32r: its 16 pairs of k); a B block
// is 16 rows of 16 pairs (256 uint32: row p holds (y[2p][c], y[2p+1][c]) for 16 columns c, the
// "VNNI" layout). A product of two bfloat16 is exact in float32; the sums round as float sums do.

// K per step (one A block's columns) and the most K one scores' product takes (longer ones use
// the float kernels); the widest row (P·V's Dv, the backward's D and Dv) a bfloat16 product takes
constexpr int64_t TILE_K = 32;
constexpr int64_t TILE_K_MAX = 256;
constexpr int64_t TILE_PV_N = 256;

// 16 floats → 16 bfloat16, round to nearest even (AVX512-BF16's conversion)
static inline __m256i bf16_bits(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 f32_of_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __mmask16 first_n(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// A rows r < rows of x (ld lda), columns 0 … kn−1 (kn ≤ 32), times scale, as one A tile
// (16 × 32 bfloat16, zero past rows and kn)
static inline void pack_a(const float* x, int64_t lda, int64_t rows, int64_t kn, uint16_t* dst,
                          float scale) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t h = 0; h < 2; ++h) {
      const __mmask16 m = r < rows ? first_n(kn - 16 * h) : (__mmask16)0;
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + r * lda + 16 * h), _mm512_set1_ps(scale));
      _mm256_storeu_si256((__m256i*)(dst + r * 32 + 16 * h), bf16_bits(v));
    }
}

// B rows k < kn (kn ≤ 32) of y (ld ldb), columns n0 … n0+15, as one B tile: row p holds the
// pairs (y[2p][c], y[2p+1][c]) of 16 columns c, zero past kn
static inline void pack_b(const float* y, int64_t ldb, int64_t kn, uint32_t* dst) {
  for (int64_t p = 0; p < 16; ++p) {
    const __m512 e = 2 * p < kn ? _mm512_loadu_ps(y + 2 * p * ldb) : _mm512_setzero_ps();
    const __m512 o = 2 * p + 1 < kn ? _mm512_loadu_ps(y + (2 * p + 1) * ldb) : _mm512_setzero_ps();
    const __m512i lo16 = _mm512_cvtepu16_epi32(bf16_bits(e));
    const __m512i hi16 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(o)), 16);
    _mm512_storeu_si512(dst + p * 16, _mm512_or_si512(lo16, hi16));
  }
}

// The K rows of y (ld ldb) over column blocks 0 … nt−1 as B blocks: step kk, block t at
// bt + (kk · per_step + t) · 256 (tile_b_elems(K, per_step) uint32 in all). The forward packs a
// key tile's K and V this way once per call where several items read the tile (packing.h).
static inline int64_t tile_b_elems(int64_t K, int64_t per_step) {
  return (K + TILE_K - 1) / TILE_K * per_step * 256;
}
static inline void pack_b_blocks(const float* y, int64_t ldb, int64_t K, int64_t nt, int64_t per_step,
                                 uint32_t* bt) {
  for (int64_t kk = 0; kk * TILE_K < K; ++kk)
    for (int64_t t = 0; t < nt; ++t)
      pack_b(y + kk * TILE_K * ldb + 16 * t, ldb, K - kk * TILE_K < TILE_K ? K - kk * TILE_K : TILE_K,
             bt + (kk * per_step + t) * 256);
}
// A product's B blocks: `given` (packed already, the forward's store), or y's packed into scratch
static inline const uint32_t* b_blocks(const uint32_t* given, const float* y, int64_t ldb,
                                       int64_t K, int64_t nt, int64_t per_step, uint32_t* scratch) {
  if (given) return given;
  pack_b_blocks(y, ldb, K, nt, per_step, scratch);
  return scratch;
}

// Rows of A (M × K, ld lda), times scale (a power of two: exact), as the A tiles tile_gemm
// reads: row block m0/16, step kk at dst + (m0/16 · nk + kk) · 512, nk = ⌈K/32⌉ (tile_a_elems)
static inline int64_t tile_a_elems(int64_t M, int64_t K) {
  return (M + 15) / 16 * ((K + TILE_K - 1) / TILE_K) * 512;
}
static void tile_pack_rows(int64_t M, int64_t K, const float* A, int64_t lda, uint16_t* dst,
                           float scale) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  for (int64_t m0 = 0; m0 < M; m0 += 16)
    for (int64_t kk = 0; kk < nk; ++kk)
      pack_a(A + m0 * lda + kk * TILE_K, lda, M - m0 < 16 ? M - m0 : 16,
             K - kk * TILE_K < TILE_K ? K - kk * TILE_K : TILE_K, dst + (m0 / 16 * nk + kk) * 512,
             scale);
}

// The A blocks of rows m0 … m0 + rows − 1 (rows ≤ 16) of a K-deep product: apack's (packed by
// tile_pack_rows), or, with apack null, the rows of A (floats, ld lda) packed into ah here
static inline const uint16_t* rows_blocks(const float* A, int64_t lda, const uint16_t* apack,
                                          int64_t m0, int64_t rows, int64_t K, uint16_t* ah) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  if (apack) return apack + m0 / 16 * nk * 512;
  for (int64_t kk = 0; kk < nk; ++kk)
    pack_a(A + m0 * lda + kk * TILE_K, lda, rows, K - kk * TILE_K < TILE_K ? K - kk * TILE_K : TILE_K,
           ah + kk * 512, 1.0f);
  return ah;
}

// P (32 floats x0, x1: keys 16q … 16q+31 of row R, q even) as the A tiles tile_pv reads,
// rounded to bfloat16 (to nearest even), row block R/16, key step q/2, at
// a + (R/16 · 2 + q/2) · 512
static inline void tile_put_p(V16 x0, V16 x1, uint16_t* a, int64_t R, int64_t q) {
  _mm512_storeu_si512(a + (R / 16 * 2 + q / 2) * 512 + (R % 16) * 32, (__m512i)_mm512_cvtne2ps_pbh(x1.v, x0.v));
}

// Rows r and r + 1 (r even) of 64 keys (x, y: 4 vectors each; y zeros past the last row), rounded
// to bfloat16, as the B blocks of a product over rows (pack_b_blocks's layout, 4 blocks of 16 keys
// a step of 32 rows): step r/32, pair row (r % 32)/2 of each block holds (x[c], y[c]) for its
// 16 keys c. The backward writes P and dS this way as it forms them (dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS).
static inline void tile_put_pair(const V16* x, const V16* y, int64_t r, uint32_t* bt) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  uint32_t* d = bt + r / 32 * 4 * 256 + (r % 32) / 2 * 16;
  for (int t = 0; t < 4; ++t)
    _mm512_storeu_si512(d + t * 256, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(y[t].v, x[t].v)));
}

// The A tiles of Xᵀ for X of K rows × M columns (ld ldx), rounded to bfloat16: A[m][k] = X[k][m],
// row block m/16, step kk at dst + (m/16 · nk + kk) · 512, nk = ⌈K/32⌉; zero past K. M a multiple
// of 16. (The backward's Qᵀ and dOᵀ: dKᵀ += Qᵀ dS, dVᵀ += dOᵀ P.)
static void tile_pack_a(int64_t M, int64_t K, const float* X, int64_t ldx, uint16_t* dst) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  alignas(64) float t[32 * 16];  // rows m, 32 values of k
  for (int64_t m0 = 0; m0 < M; m0 += 16)
    for (int64_t kk = 0; kk < nk; ++kk) {
      uint16_t* d = dst + (m0 / 16 * nk + kk) * 512;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t kb = kk * TILE_K + 16 * h;
        alignas(64) float blk[16 * 16];
        for (int64_t r = 0; r < 16; ++r)
          _mm512_store_ps(blk + 16 * r, kb + r < K ? _mm512_loadu_ps(X + (kb + r) * ldx + m0) : _mm512_setzero_ps());
        transpose16(blk, 16, t + 16 * h, 32);
      }
      for (int64_t m = 0; m < 16; ++m)
        _mm512_storeu_si512(d + 32 * m, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(t + 32 * m + 16), _mm512_load_ps(t + 32 * m)));
    }
}

