// The tile unit (Intel AMX, BF16) for the products of bfloat16 inputs. Included by isa_amx.cpp
// after simd_avx512.h, inside its namespace; kernel.h reads TILE_BF16, tile_gemm (the scores),
// tile_pack_rows, tile_put_p and tile_pv (the forward's P·V). Without this file (every other ISA) kernel.h's stand-ins say "no tiles" and the float micro-kernels
// run every product.
//
// A tile product C += A·B takes A as 16 rows × 32 bfloat16 and B as 16 rows of 16 bfloat16
// pairs (B's rows 2p and 2p + 1 interleaved, the "VNNI" layout) and sums in float32: each
// product of two bfloat16 is exact in float32, the sums round as float sums do. The operands
// are the kernel's float copies of bfloat16 data (Q, K, V: exact in bfloat16) and, for a
// weight matrix such as P (float32, not bfloat16), two bfloat16 parts hi + lo with
// hi = bf16(x), lo = bf16(x − hi): 16 bits of x's 24, so a weight carries a rounding of
// 2⁻¹⁷ of itself where one bfloat16 would carry 2⁻⁹ (the size of the output's own rounding).
// Subnormal inputs and results are flushed to zero by the unit (below 1.2e-38 in magnitude).

#define QKV_TILE_BF16 1
static constexpr bool TILE_BF16 = true;

// K per tile step and the most K one call takes (longer products use the float kernels)
constexpr int64_t TILE_K = 32;
constexpr int64_t TILE_K_MAX = 256;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows × 64 bytes: C tiles 0–3 (16 × 16 float), A tiles 4 and 6 (16 × 32
// bfloat16: hi and lo), B tile 5 (16 pairs × 16)
static inline void tiles_on() {
  TileConfig c;
  __builtin_memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// 16 floats → 16 bfloat16, round to nearest even (the unit's own conversion)
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

// The scores' product C[M×N] = A[M×K]·B[K×N] (C ld ldc; B ld ldb, floats holding bfloat16
// values; A the rows' tiles from tile_pack_rows, or, with apack null, floats (ld lda) packed
// here). N a multiple of 16. Each element is the unit's float sum over K in steps of 32, the
// same whatever M, N and the element's place. False (nothing done) where K > TILE_K_MAX.
static bool tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                      const uint16_t* apack, const float* B, int64_t ldb, float* C, int64_t ldc) {
  if (K > TILE_K_MAX) return false;
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  alignas(64) uint32_t bt[TILE_K_MAX / TILE_K * 4 * 256];
  alignas(64) uint16_t ah[TILE_K_MAX / TILE_K * 512];
  alignas(64) float cs[16 * 64];
  tiles_on();
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nt = (N - n0) / 16 < 4 ? (N - n0) / 16 : 4;
    for (int64_t kk = 0; kk < nk; ++kk)
      for (int64_t t = 0; t < nt; ++t)
        pack_b(B + kk * TILE_K * ldb + n0 + 16 * t, ldb, K - kk * TILE_K < TILE_K ? K - kk * TILE_K : TILE_K,
               bt + (kk * 4 + t) * 256);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t rows = M - m0 < 16 ? M - m0 : 16;
      for (int64_t kk = 0; kk < nk && !apack; ++kk)
        pack_a(A + m0 * lda + kk * TILE_K, lda, rows, K - kk * TILE_K < TILE_K ? K - kk * TILE_K : TILE_K,
               ah + kk * 512, 1.0f);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kk = 0; kk < nk; ++kk) {
        _tile_loadd(4, apack ? apack + (m0 / 16 * nk + kk) * 512 : ah + kk * 512, 64);
#define QKV_TILE_STEP(T)                         \
  if (nt > T) {                                  \
    _tile_loadd(5, bt + (kk * 4 + T) * 256, 64); \
    _tile_dpbf16ps(T, 4, 5);                     \
  }
        QKV_TILE_STEP(0)
        QKV_TILE_STEP(1)
        QKV_TILE_STEP(2)
        QKV_TILE_STEP(3)
#undef QKV_TILE_STEP
      }
      // 16 rows straight into C; a last block of fewer rows through cs
      float* c = rows == 16 ? C + m0 * ldc + n0 : cs;
      const int64_t ld = rows == 16 ? ldc * 4 : 256;
      _tile_stored(0, c, ld);
      if (nt > 1) _tile_stored(1, c + 16, ld);
      if (nt > 2) _tile_stored(2, c + 32, ld);
      if (nt > 3) _tile_stored(3, c + 48, ld);
      for (int64_t r = 0; r < rows && rows < 16; ++r)
        for (int64_t x = 0; x < 16 * nt; x += 16)
          _mm512_storeu_ps(C + (m0 + r) * ldc + n0 + x, _mm512_loadu_ps(cs + r * 64 + x));
    }
  }
  _tile_release();
  return true;
}

// P (16 floats: keys 16q … 16q+15 of row R) as the A tiles tile_pv reads, in two parts:
// row block R/16, key step q/2, at hi/lo + (R/16 · 2 + q/2) · 512
static inline void tile_put_p(V16 x, uint16_t* hi, uint16_t* lo, int64_t R, int64_t q) {
  const int64_t at = (R / 16 * 2 + q / 2) * 512 + (R % 16) * 32 + 16 * (q % 2);
  const __m256i h = bf16_bits(x.v);
  _mm256_storeu_si256((__m256i*)(hi + at), h);
  _mm256_storeu_si256((__m256i*)(lo + at), bf16_bits(_mm512_sub_ps(x.v, f32_of_bf16(h))));
}

// acc[M×N] (float, ld ldc, rows padded to a multiple of 16) = acc·alpha[m] + A·B with A (M × K,
// K ≤ 64) in two parts packed by tile_put_p (P·V of the forward for bfloat16 inputs): acc is loaded into the C tiles, the products
// add to it there, and it is stored back; rows whose α is 1 (the row's maximum did not move)
// are not touched by the vector unit at all. K ≤ 64, N ≤ TILE_PV_N and a multiple of 16.
constexpr int64_t TILE_PV_N = 256;
static void tile_pv(int64_t M, int64_t N, int64_t K, const uint16_t* ahi, const uint16_t* alo,
                    const float* B, int64_t ldb, float* acc, int64_t ldc, const double* alpha) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K, ntt = N / 16;
  alignas(64) uint32_t bt[2 * (TILE_PV_N / 16) * 256];
  tiles_on();
  for (int64_t kk = 0; kk < nk; ++kk)
    for (int64_t t = 0; t < ntt; ++t)
      pack_b(B + kk * TILE_K * ldb + 16 * t, ldb, K - kk * TILE_K < TILE_K ? K - kk * TILE_K : TILE_K,
             bt + (kk * ntt + t) * 256);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    for (int64_t r = 0; r < rows; ++r) {
      if (alpha[m0 + r] == 1.0) continue;
      const __m512 a = _mm512_set1_ps((float)alpha[m0 + r]);
      float* c = acc + (m0 + r) * ldc;
      for (int64_t x = 0; x < N; x += 16) _mm512_storeu_ps(c + x, _mm512_mul_ps(_mm512_loadu_ps(c + x), a));
    }
    for (int64_t t0 = 0; t0 < ntt; t0 += 4) {
      const int64_t nt = ntt - t0 < 4 ? ntt - t0 : 4;
      float* c = acc + m0 * ldc + 16 * t0;
#define QKV_TILE_LOAD(T) \
  if (nt > T) _tile_loadd(T, c + 16 * T, ldc * 4);
      QKV_TILE_LOAD(0)
      QKV_TILE_LOAD(1)
      QKV_TILE_LOAD(2)
      QKV_TILE_LOAD(3)
#undef QKV_TILE_LOAD
      for (int64_t kk = 0; kk < nk; ++kk) {
        _tile_loadd(4, ahi + (m0 / 16 * 2 + kk) * 512, 64);
        _tile_loadd(6, alo + (m0 / 16 * 2 + kk) * 512, 64);
#define QKV_TILE_STEP(T)                                    \
  if (nt > T) {                                             \
    _tile_loadd(5, bt + (kk * ntt + t0 + T) * 256, 64);     \
    _tile_dpbf16ps(T, 4, 5);                                \
    _tile_dpbf16ps(T, 6, 5);                                \
  }
        QKV_TILE_STEP(0)
        QKV_TILE_STEP(1)
        QKV_TILE_STEP(2)
        QKV_TILE_STEP(3)
#undef QKV_TILE_STEP
      }
#define QKV_TILE_STORE(T) \
  if (nt > T) _tile_stored(T, c + 16 * T, ldc * 4);
      QKV_TILE_STORE(0)
      QKV_TILE_STORE(1)
      QKV_TILE_STORE(2)
      QKV_TILE_STORE(3)
#undef QKV_TILE_STORE
    }
  }
  _tile_release();
}
