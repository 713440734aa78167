// The SIMD layer for AVX2 + FMA + F16C: the names isa_contract.h lists, for the avx2 path. V16 is
// a pair of 8-float registers; lane masks are all-ones lanes.

struct V16 { __m256 a, b; };
struct M16 { __m256 a, b; };
struct U16 { __m256i a, b; };

#include "microkernel.h"
QKV_VECTOR_TRAITS(F32x8, float, __m256, 8, _mm256_setzero_ps(), _mm256_loadu_ps(p),
                  _mm256_set1_ps(*p), _mm256_fmadd_ps(a, b, c), _mm256_storeu_ps(p, x));
// the same, broadcasting A's values from their addresses (GCC then steps the row pointers): the
// form the chained products (micro_scores, micro_pv) were tuned in
QKV_VECTOR_TRAITS(F32x8At, float, __m256, 8, _mm256_setzero_ps(), _mm256_loadu_ps(p),
                  _mm256_broadcast_ss(p), _mm256_fmadd_ps(a, b, c), _mm256_storeu_ps(p, x));
QKV_VECTOR_TRAITS(F64x4, double, __m256d, 4, _mm256_setzero_pd(), _mm256_loadu_pd(p),
                  _mm256_set1_pd(*p), _mm256_fmadd_pd(a, b, c), _mm256_storeu_pd(p, x));

// a·b + c exactly as gemm's micro-kernel forms it (fused where gemm fuses)
static inline float madd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float* p, V16 x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
// a non-temporal store of 16 floats to a 32-byte aligned p; stream_fence() orders them
static inline void v_stream(float* p, V16 x) {
  _mm256_stream_ps(p, x.a);
  _mm256_stream_ps(p + 8, x.b);
}
static inline void stream_fence() { _mm_sfence(); }
static constexpr int64_t STREAM_ALIGN = 32;
static inline V16 v_set(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline V16 v_add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline V16 v_sub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline V16 v_mul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V16 v_div(V16 x, V16 y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
static inline V16 v_fma(V16 x, V16 y, V16 z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline V16 v_max(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
static inline M16 m_bits(uint32_t bits) {
  const __m256i lane_a = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lane_b = _mm256_setr_epi32(256, 512, 1024, 2048, 4096, 8192, 16384, 32768);
  const __m256i w = _mm256_set1_epi32((int)bits);
  return {_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(w, lane_a), lane_a)),
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(w, lane_b), lane_b))};
}
static inline V16 v_select(M16 m, V16 x, V16 y) {
  return {_mm256_blendv_ps(y.a, x.a, m.a), _mm256_blendv_ps(y.b, x.b, m.b)};
}
static inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
static inline float v_hmax(V16 x) { return hmax8(_mm256_max_ps(x.a, x.b)); }
// whether some lane exceeds b (NaN lanes do not)
static inline bool v_any_gt(V16 x, float b) {
  const __m256 s = _mm256_set1_ps(b);
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.a, s, _CMP_GT_OQ), _mm256_cmp_ps(x.b, s, _CMP_GT_OQ))) != 0;
}
static inline float v_hsum(V16 x) {
  __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
static inline M16 v_finite(V16 x) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_cmp_ps(_mm256_sub_ps(x.a, x.a), z, _CMP_EQ_OQ),
          _mm256_cmp_ps(_mm256_sub_ps(x.b, x.b), z, _CMP_EQ_OQ)};
}
static inline bool m_all(M16 m) {
  return (_mm256_movemask_ps(m.a) & _mm256_movemask_ps(m.b)) == 0xFF;
}

static inline V16 v_absdist(int32_t base) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i b = _mm256_set1_epi32(base);
  __m256i da = _mm256_abs_epi32(_mm256_sub_epi32(b, iota));
  __m256i db = _mm256_abs_epi32(_mm256_sub_epi32(_mm256_sub_epi32(b, _mm256_set1_epi32(8)), iota));
  return {_mm256_cvtepi32_ps(da), _mm256_cvtepi32_ps(db)};
}

// exp(x) for x ≤ 0 (the softmax's s − m; small positive x from a score's low part also fine),
// 0 below −87.34 (where the float result would be subnormal), NaN for NaN: n = round(x·log2 e) by
// the shifter (1.5·2^23 added in a fused multiply-add: n sits in the low mantissa bits), r = x −
// n·ln 2 in two parts, e^r by a degree-6 minimax polynomial on |r| ≤ ln2/2 (relative error 2e-9
// with exact coefficients, 1.7e-8 with their float roundings: under a third of an ulp), times 2^n
// built in the exponent field.
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f), shift = _mm256_set1_ps(12582912.0f);
  const __m256 ns = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shift);
  const __m256 n = _mm256_sub_ps(ns, shift);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 q = _mm256_set1_ps(1.384364309888782e-3f);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.374155394953883e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1668002190237155e-2f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.16666431262047998f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.49999994208555976f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0000000321650493f));
  const __m256 e = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  // 2^n: n + 127 into the exponent field (the shifter's high bits fall off the shift)
  const __m256i p2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(ns), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), _mm256_mul_ps(e, _mm256_castsi256_ps(p2)));
}
static inline V16 v_exp(V16 x) { return {exp8(x.a), exp8(x.b)}; }

static inline __m256d exp_pd(__m256d x) {
  __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93147180369123816490e-01), x);
  r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.90821492927058770002e-10), r);
  __m256d q = _mm256_set1_pd(1.0 / 6227020800.0);
  static const double c[12] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                               1.0 / 362880.0,    1.0 / 40320.0,    1.0 / 5040.0,
                               1.0 / 720.0,       1.0 / 120.0,      1.0 / 24.0,
                               1.0 / 6.0,         0.5,              1.0};
  for (int i = 0; i < 12; ++i) q = _mm256_fmadd_pd(q, r, _mm256_set1_pd(c[i]));
  __m256d e = _mm256_fmadd_pd(q, r, _mm256_set1_pd(1.0));
  // 2^n, n in [−1022, 1023], in the exponent field
  __m128i ni = _mm256_cvtpd_epi32(n);
  __m256i p2 = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(ni), _mm256_set1_epi64x(1023)), 52);
  return _mm256_mul_pd(e, _mm256_castsi256_pd(p2));
}
static inline __m256d tanh_pd(__m256d u) {
  const __m256d sign = _mm256_set1_pd(-0.0);
  __m256d a = _mm256_andnot_pd(sign, u);
  __m256d ac = _mm256_min_pd(a, _mm256_set1_pd(20.0));
  __m256d e = exp_pd(_mm256_add_pd(ac, ac));
  __m256d big = _mm256_div_pd(_mm256_sub_pd(e, _mm256_set1_pd(1.0)),
                              _mm256_add_pd(e, _mm256_set1_pd(1.0)));
  __m256d a2 = _mm256_mul_pd(a, a);
  __m256d small = _mm256_fmadd_pd(a2, _mm256_set1_pd(2.0 / 15.0), _mm256_set1_pd(-1.0 / 3.0));
  small = _mm256_fmadd_pd(_mm256_mul_pd(small, a2), a, a);
  __m256d t = _mm256_blendv_pd(big, small, _mm256_cmp_pd(a, _mm256_set1_pd(1.0 / 4096.0), _CMP_LT_OQ));
  return _mm256_or_pd(t, _mm256_and_pd(u, sign));
}
static inline __m256 tanh8(__m256 u) {
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(u));
  __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
  return _mm256_set_m128(_mm256_cvtpd_ps(tanh_pd(hi)), _mm256_cvtpd_ps(tanh_pd(lo)));
}
static inline V16 v_tanh(V16 u) { return {tanh8(u.a), tanh8(u.b)}; }

static inline __m256 mul8_f64(__m256 x, __m256d s) {
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(hi, s)), _mm256_cvtpd_ps(_mm256_mul_pd(lo, s)));
}
static inline V16 v_mul_f64(V16 x, double s) {
  const __m256d sd = _mm256_set1_pd(s);
  return {mul8_f64(x.a, sd), mul8_f64(x.b, sd)};
}

static inline void add_f64(double* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 4) {
    __m256d xv = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    _mm256_storeu_pd(acc + i, _mm256_add_pd(_mm256_loadu_pd(acc + i), xv));
  }
}

static inline U16 u_load(const uint32_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))};
}
static inline U16 u_xor(U16 x, uint32_t s) {
  const __m256i sv = _mm256_set1_epi32((int)s);
  return {_mm256_xor_si256(x.a, sv), _mm256_xor_si256(x.b, sv)};
}
static inline __m256i mix8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x6A09E667));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}
static inline U16 u_mix(U16 x) { return {mix8(x.a), mix8(x.b)}; }
// unsigned x ≥ t, by flipping the sign bits and comparing signed
static inline M16 u_ge(U16 x, uint32_t t) {
  const __m256i flip = _mm256_set1_epi32((int)0x80000000u);
  const __m256i tm1 = _mm256_set1_epi32((int)((t - 1u) ^ 0x80000000u));  // x ≥ t ⇔ x > t − 1 (t ≥ 1)
  __m256i a = _mm256_cmpgt_epi32(_mm256_xor_si256(x.a, flip), tm1);
  __m256i b = _mm256_cmpgt_epi32(_mm256_xor_si256(x.b, flip), tm1);
  if (t == 0) a = b = _mm256_set1_epi32(-1);
  return {_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)};
}

static inline int64_t cvt_bf16(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s + i)));
    _mm256_storeu_ps(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  return i;
}
static inline int64_t cvt_f16(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
  return i;
}

static inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}
static inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  transpose8(src, lds, dst, ldd);
  transpose8(src + 8, lds, dst + 8 * ldd, ldd);
  transpose8(src + 8 * lds, lds, dst + 8, ldd);
  transpose8(src + 8 * lds + 8, lds, dst + 8 * ldd + 8, ldd);
}

// C[M×N] = A[M×K] · B[K×N] in float (microkernel.h): blocks of 6 rows × 16 columns
__attribute__((noinline)) static void gemm(int64_t M, int64_t N, int64_t K, const float* A,
                                           int64_t sam, int64_t sak, const float* B, int64_t ldb,
                                           float* C, int64_t ldc) {
  gemm_blocks<F32x8, 6, 2>(M, N, K, A, sam, sak, B, ldb, C, ldc);
}

static inline V16 v_dsub(const double* x, double mul, double s, M16 keep) {
  const __m256d m = _mm256_set1_pd(mul), sd = _mm256_set1_pd(s);
  const int bits = _mm256_movemask_ps(keep.a) | (_mm256_movemask_ps(keep.b) << 8);
  const __m256i lane = _mm256_setr_epi64x(1, 2, 4, 8);
  __m128 r[4];
  for (int q = 0; q < 4; ++q) {
    const __m256i w = _mm256_set1_epi64x((bits >> (4 * q)) & 0xF);
    const __m256d on = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(w, lane), lane));
    const __m256d v = _mm256_and_pd(_mm256_mul_pd(_mm256_loadu_pd(x + 4 * q), m), on);
    r[q] = _mm256_cvtpd_ps(_mm256_sub_pd(v, sd));
  }
  return {_mm256_set_m128(r[1], r[0]), _mm256_set_m128(r[3], r[2])};
}

// C[M×N] = A[M×K] · B[K×N] in double: blocks of 6 rows × 8 columns
__attribute__((noinline)) static void gemm64(int64_t M, int64_t N, int64_t K, const double* A,
                                             int64_t sam, int64_t sak, const double* B,
                                             int64_t ldb, double* C, int64_t ldc) {
  gemm_blocks<F64x4, 6, 2>(M, N, K, A, sam, sak, B, ldb, C, ldc);
}

// P·V's float chains on AVX2: one per tile span (≤ 64 keys), not CHAIN keys (docs/cpu.md,
// Accuracy): each chain's widening and double adds compete with the FMAs on this 16-register ISA.
constexpr int64_t PV_CHAIN = BK;

// the 8 floats of x as two vectors of 4 doubles (exact)
static inline void widen8(__m256 x, __m256d& lo, __m256d& hi) {
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
}

// The scores' float chains on AVX2: 32 products (SCORE_CHAIN), not CHAIN (docs/cpu.md,
// Accuracy): with chains of 16 the widening and double adds after each chain made the scores'
// micro-kernel far costlier than P·V's, with chains of 32 much less so (measured: docs/cpu.md,
// Measurements behind the code).
constexpr int64_t SCORE_CHAIN = 2 * CHAIN;

// C = float(scale · Σ_c chain_c), the conventions of the AVX-512 gemm_chain with chains of
// SCORE_CHAIN fused products from 0, widened to double, added in order, one rounding. MR rows × 16
// columns: 2·MR float chains (12 for MR = 6, enough to cover the FMA latency of two pipes),
// two B vectors and a broadcast in the 16 registers; the double sums of the block live in a
// small array in L1 between chains. One out-of-line copy per row count, its chain loop unrolled
// by 8: inlined copies and a fully unrolled 16-step loop ran slower (code size), a 16-trip
// loop's exit costs a mispredict.
// With D (double, ld ldc) instead of C: D = Σ_c chain_c, neither scaled nor rounded (the
// backward's dP, gemm_dp).
template <int MR>
__attribute__((noinline)) static void micro_scores(int64_t K, const float* A, int64_t sam,
                                                   const float* B, int64_t ldb, float* C,
                                                   int64_t ldc, double scale, double* D = nullptr) {
  alignas(32) double t[MR][16];
  for (int64_t k0 = 0; k0 < K; k0 += SCORE_CHAIN) {
    const int64_t k1 = K - k0 < SCORE_CHAIN ? K : k0 + SCORE_CHAIN;
    __m256 p[MR][2];
    chain_block<F32x8At, MR, 2, true>(k0, k1, A, sam, 1, B, ldb, p);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        __m256d lo, hi;
        widen8(p[m][v], lo, hi);
        double* tv = t[m] + 8 * v;
        if (k0 == 0) {
          _mm256_store_pd(tv, lo);
          _mm256_store_pd(tv + 4, hi);
        } else {
          _mm256_store_pd(tv, _mm256_add_pd(_mm256_load_pd(tv), lo));
          _mm256_store_pd(tv + 4, _mm256_add_pd(_mm256_load_pd(tv + 4), hi));
        }
      }
  }
  if (D) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) _mm256_storeu_pd(D + m * ldc + 4 * v, _mm256_load_pd(t[m] + 4 * v));
    return;
  }
  const __m256d sc = _mm256_set1_pd(scale);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_load_pd(t[m] + 8 * v), sc));
      const __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_load_pd(t[m] + 8 * v + 4), sc));
      _mm256_storeu_ps(C + m * ldc + 8 * v, _mm256_set_m128(hi, lo));
    }
}

// D = D·α + chain, row m: one float chain of K products (A[m·sam + k·sak]), widened and added
// into D straight from the registers (acc_chains' arithmetic for one chain; without alpha,
// α = 1: D + chain). P·V (K ≤ PV_CHAIN) and the backward's dV, dK and dQ (gemm_acc).
template <int MR>
__attribute__((noinline)) static void micro_pv(int64_t K, const float* A, int64_t sam, int64_t sak,
                                               const float* B, int64_t ldb, double* D,
                                               int64_t ldd, const double* alpha) {
  __m256 p[MR][2];
  chain_block<F32x8At, MR, 2, true>(0, K, A, sam, sak, B, ldb, p);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    double* d = D + m * ldd;
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      __m256d lo, hi;
      widen8(p[m][v], lo, hi);
      const __m256d d0 = _mm256_loadu_pd(d + 8 * v), d1 = _mm256_loadu_pd(d + 8 * v + 4);
      if (alpha) {
        const __m256d a = _mm256_set1_pd(alpha[m]);
        _mm256_storeu_pd(d + 8 * v, _mm256_fmadd_pd(d0, a, lo));
        _mm256_storeu_pd(d + 8 * v + 4, _mm256_fmadd_pd(d1, a, hi));
      } else {
        _mm256_storeu_pd(d + 8 * v, _mm256_add_pd(d0, lo));
        _mm256_storeu_pd(d + 8 * v + 4, _mm256_add_pd(d1, hi));
      }
    }
  }
}

// N a multiple of 16 (callers pass 16-key spans, BK or Dvp). With D (double, same ldc) instead
// of C: D = D·alpha[m] + the chain's sum, row m (K ≤ PV_CHAIN: one tile span).
static void gemm_chain(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                       const float* B, int64_t ldb, float* C, int64_t ldc, double scale,
                       double* D = nullptr, const double* alpha = nullptr) {
  for (int64_t n0 = 0; n0 < N; n0 += 16)
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const int64_t mr = M - m0 < 6 ? M - m0 : 6;
      const float* a = A + m0 * sam;
      const float* b = B + n0;
      float* c = C ? C + m0 * ldc + n0 : nullptr;
      double* d = D ? D + m0 * ldc + n0 : nullptr;
      const double* al = alpha ? alpha + m0 : nullptr;
#define QKV_MC(MRR)                                          \
  if (D) micro_pv<MRR>(K, a, sam, 1, b, ldb, d, ldc, al);    \
  else micro_scores<MRR>(K, a, sam, b, ldb, c, ldc, scale);
      switch (mr) {
        case 1: QKV_MC(1) break;
        case 2: QKV_MC(2) break;
        case 3: QKV_MC(3) break;
        case 4: QKV_MC(4) break;
        case 5: QKV_MC(5) break;
        default: QKV_MC(6) break;
      }
#undef QKV_MC
    }
}

// The backward's accumulations: D[m·ldd + n] += Σ_c double(chain_c), chain c the float sum
// (gemm's chain: fused, from 0, in order) of A[m·sam + k·sak]·B[k·ldb + n] over k = 32c …
// 32c + 31 (ACC_CHAIN), each widened and added from the registers in order of c (backward_ops.h's
// gemm_acc with chains of 32). Chains of 32, not CHAIN, as the scores' (SCORE_CHAIN): with 16
// the widening and double adds cost these three products much more than the forward's one-chain
// P·V (measured: docs/cpu.md, Measurements behind the code). `chain` terms per chain (ACC_CHAIN, or
// ONE_CHAIN for 16-bit inputs: one chain per call). N a multiple of 16; tmp unused here.
constexpr int64_t ACC_CHAIN = 2 * CHAIN;
static void gemm_acc(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                     const float* B, int64_t ldb, double* D, int64_t ldd, float*, int64_t chain) {
  for (int64_t n0 = 0; n0 < N; n0 += 16)
    for (int64_t m0 = 0; m0 < M; m0 += 6)
      for (int64_t k0 = 0; k0 < K; k0 += chain) {
        const int64_t mr = M - m0 < 6 ? M - m0 : 6, kc = K - k0 < chain ? K - k0 : chain;
        const float* a = A + m0 * sam + k0 * sak;
        const float* b = B + n0 + k0 * ldb;
        double* d = D + m0 * ldd + n0;
        switch (mr) {
          case 1: micro_pv<1>(kc, a, sam, sak, b, ldb, d, ldd, nullptr); break;
          case 2: micro_pv<2>(kc, a, sam, sak, b, ldb, d, ldd, nullptr); break;
          case 3: micro_pv<3>(kc, a, sam, sak, b, ldb, d, ldd, nullptr); break;
          case 4: micro_pv<4>(kc, a, sam, sak, b, ldb, d, ldd, nullptr); break;
          case 5: micro_pv<5>(kc, a, sam, sak, b, ldb, d, ldd, nullptr); break;
          default: micro_pv<6>(kc, a, sam, sak, b, ldb, d, ldd, nullptr); break;
        }
      }
}

// The backward's dP[M×N] (double, ld ldc) = dO[M×K]·Vᵀ[K×N]: with `exact`, gemm64 over dO and Vᵀ
// in double (a64, ld K; b64, ld ldb): products exact, sums in double; else (a query tile with no
// peaked row, docs/cpu.md, Accuracy) the scores' arithmetic over the float copies (a, ld lda; b,
// ld ldb): float chains of SCORE_CHAIN products summed in double, neither scaled nor rounded, at about
// the float rate where gemm64 runs at half of it. N a multiple of 16.
constexpr bool DP_FLOAT_CHAINS = true;  // gemm_dp has a float form (tiles without a peaked row)
static void gemm_dp(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const double* a64,
                    const float* b, const double* b64, int64_t ldb, double* C, int64_t ldc,
                    bool exact) {
  if (exact) {
    gemm64(M, N, K, a64, K, 1, b64, ldb, C, ldc);
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += 16)
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const int64_t mr = M - m0 < 6 ? M - m0 : 6;
      const float* am = a + m0 * lda;
      double* c = C + m0 * ldc + n0;
      switch (mr) {
        case 1: micro_scores<1>(K, am, lda, b + n0, ldb, nullptr, ldc, 1.0, c); break;
        case 2: micro_scores<2>(K, am, lda, b + n0, ldb, nullptr, ldc, 1.0, c); break;
        case 3: micro_scores<3>(K, am, lda, b + n0, ldb, nullptr, ldc, 1.0, c); break;
        case 4: micro_scores<4>(K, am, lda, b + n0, ldb, nullptr, ldc, 1.0, c); break;
        case 5: micro_scores<5>(K, am, lda, b + n0, ldb, nullptr, ldc, 1.0, c); break;
        default: micro_scores<6>(K, am, lda, b + n0, ldb, nullptr, ldc, 1.0, c); break;
      }
    }
}

static inline void acc_chains(double* acc, const float* x, int64_t stride, int64_t n_chains,
                              double alpha, int64_t n) {
  const __m256d a = _mm256_set1_pd(alpha);
  for (int64_t i = 0; i < n; i += 4) {
    __m256d s = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    for (int64_t c = 1; c < n_chains; ++c)
      s = _mm256_add_pd(s, _mm256_cvtps_pd(_mm_loadu_ps(x + c * stride + i)));
    _mm256_storeu_pd(acc + i, _mm256_fmadd_pd(_mm256_loadu_pd(acc + i), a, s));
  }
}

static inline double hsum4d(__m256d x) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
// Decoding's precise scores, NR rows at a time: each score sums q·k in double over d, in two
// lanes of 4 (d mod 8 < 4 and ≥ 4) added at the end, then the tail; the rows share each widened
// chunk of k. NR a template argument, so the 2·NR sums stay in registers (with a runtime row
// count GCC kept them on the stack: a store and a load per product).
template <int NR>
static inline void dot_rows64_n(const double* q, int64_t ldq, const float* k, int64_t n,
                                float* out, float* out_lo, int64_t lds, double scale) {
  const int64_t n8 = n & ~int64_t(7);
  __m256d a[NR][2];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) a[r][0] = a[r][1] = _mm256_setzero_pd();
  for (int64_t d = 0; d < n8; d += 8) {
    const __m256d k0 = _mm256_cvtps_pd(_mm_loadu_ps(k + d));
    const __m256d k1 = _mm256_cvtps_pd(_mm_loadu_ps(k + d + 4));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const double* qr = q + r * ldq + d;
      a[r][0] = _mm256_fmadd_pd(_mm256_loadu_pd(qr), k0, a[r][0]);
      a[r][1] = _mm256_fmadd_pd(_mm256_loadu_pd(qr + 4), k1, a[r][1]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const double* qr = q + r * ldq;
    double s = hsum4d(_mm256_add_pd(a[r][0], a[r][1]));
    for (int64_t d = n8; d < n; ++d) s = __builtin_fma(qr[d], (double)k[d], s);
    const double x = s * scale;
    out[r * lds] = (float)x;
    out_lo[r * lds] = score_lo(x, (float)x);
  }
}
// out = float(scale · q·k), out_lo its low part (score_lo)
static inline void dot_rows64(const double* q, int64_t ldq, int64_t M, const float* k, int64_t n,
                              float* out, float* out_lo, int64_t lds, double scale) {
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const double* qr = q + r0 * ldq;
    float *o = out + r0 * lds, *ol = out_lo + r0 * lds;
    switch (M - r0 < 4 ? M - r0 : 4) {
      case 1: dot_rows64_n<1>(qr, ldq, k, n, o, ol, lds, scale); break;
      case 2: dot_rows64_n<2>(qr, ldq, k, n, o, ol, lds, scale); break;
      case 3: dot_rows64_n<3>(qr, ldq, k, n, o, ol, lds, scale); break;
      default: dot_rows64_n<4>(qr, ldq, k, n, o, ol, lds, scale); break;
    }
  }
}
static inline void dot_rows32(const float* q, int64_t ldq, int64_t M, const float* k, int64_t n,
                              float* out, int64_t lds, float scale) {
  const int64_t n16 = n & ~int64_t(15);
  for (int64_t r = 0; r < M; ++r) {
    const float* qr = q + r * ldq;
    V16 acc = v_set(0.0f);
    for (int64_t d = 0; d < n16; d += 16) acc = v_fma(v_load(qr + d), v_load(k + d), acc);
    float s = v_hsum(acc);
    for (int64_t d = n16; d < n; ++d) s = __builtin_fmaf(qr[d], k[d], s);
    out[r * lds] = s * scale;
  }
}
