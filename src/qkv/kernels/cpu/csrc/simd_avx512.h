// The SIMD layer for AVX-512 (F, BW, DQ, VL): the names isa_contract.h lists, for the avx512
// and amx paths (isa_avx512.cpp, isa_amx.cpp include it inside their namespace, after a target
// pragma).
//
// V16 is one 16-float register, M16 a 16-bit lane mask, U16 16 uint32 lanes.

struct V16 { __m512 v; };
struct M16 { __mmask16 k; };
struct U16 { __m512i v; };

#include "microkernel.h"
QKV_VECTOR_TRAITS(F32x16, float, __m512, 16, _mm512_setzero_ps(), _mm512_loadu_ps(p),
                  _mm512_set1_ps(*p), _mm512_fmadd_ps(a, b, c), _mm512_storeu_ps(p, x));
QKV_VECTOR_TRAITS(F64x8, double, __m512d, 8, _mm512_setzero_pd(), _mm512_loadu_pd(p),
                  _mm512_set1_pd(*p), _mm512_fmadd_pd(a, b, c), _mm512_storeu_pd(p, x));

// a·b + c exactly as gemm's micro-kernel forms it (fused where gemm fuses)
static inline float madd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void v_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
// a non-temporal store of 16 floats to a 64-byte aligned p; stream_fence() orders them
static inline void v_stream(float* p, V16 a) { _mm512_stream_ps(p, a.v); }
static inline void stream_fence() { _mm_sfence(); }
static constexpr int64_t STREAM_ALIGN = 64;
static inline V16 v_set(float s) { return {_mm512_set1_ps(s)}; }
static inline V16 v_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 v_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 v_div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// max(a, b) with NaN in b propagated (the second operand wins when either is NaN)
static inline V16 v_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline M16 m_bits(uint32_t bits) { return {(__mmask16)bits}; }
static inline V16 v_select(M16 m, V16 a, V16 b) { return {_mm512_mask_blend_ps(m.k, b.v, a.v)}; }
static inline float v_hmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
// whether some lane exceeds b (NaN lanes do not)
static inline bool v_any_gt(V16 a, float b) {
  return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(b), _CMP_GT_OQ) != 0;
}
static inline float v_hsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
// lanes equal to themselves minus themselves are finite
static inline M16 v_finite(V16 a) {
  return {_mm512_cmp_ps_mask(_mm512_sub_ps(a.v, a.v), _mm512_setzero_ps(), _CMP_EQ_OQ)};
}
static inline bool m_all(M16 m) { return m.k == 0xFFFF; }

// float(|base − lane|) for lanes 0..15 (ALiBi's distance; base fits in int32)
static inline V16 v_absdist(int32_t base) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i d = _mm512_sub_epi32(_mm512_set1_epi32(base), iota);
  return {_mm512_cvtepi32_ps(_mm512_abs_epi32(d))};
}

// exp(x) for x ≤ 0 (the softmax's s − m; small positive x from a score's low part also fine),
// 0 below −87.34 (where the float result would be subnormal), NaN for NaN: the AVX2 path's
// exp8 (simd_avx2.h) on 16 lanes, the same bits: n = round(x·log2 e) by the shifter (1.5·2^23
// added in a fused multiply-add), r = x − n·ln 2 in two parts, e^r by the degree-6 minimax
// polynomial, times 2^n (vscalefps: the same correctly rounded product as exp8's multiply).
static inline V16 v_exp(V16 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654475f), shift = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x.v, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x.v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(1.384364309888782e-3f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.374155394953883e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1668002190237155e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.16666431262047998f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.49999994208555976f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0000000321650493f));
  const __m512 e = _mm512_scalef_ps(_mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f)), n);
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, lo, _CMP_NLT_UQ), e)};
}

// e^x in double for 8 lanes, |x| ≤ 700: Taylor series to r^13 after reduction by ln2.
static inline __m512d exp_pd(__m512d x) {
  __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);
  r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
  __m512d q = _mm512_set1_pd(1.0 / 6227020800.0);
  static const double c[12] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                               1.0 / 362880.0,    1.0 / 40320.0,    1.0 / 5040.0,
                               1.0 / 720.0,       1.0 / 120.0,      1.0 / 24.0,
                               1.0 / 6.0,         0.5,              1.0};
  for (int i = 0; i < 12; ++i) q = _mm512_fmadd_pd(q, r, _mm512_set1_pd(c[i]));
  __m512d e = _mm512_fmadd_pd(q, r, _mm512_set1_pd(1.0));
  return _mm512_scalef_pd(e, n);
}

// tanh of 8 doubles: (e^{2a} − 1)/(e^{2a} + 1) for a = |u| ≥ 2^-12 (a > 20 gives 1), its series
// below, sign restored.
static inline __m512d tanh_pd(__m512d u) {
  const __m512d sign = _mm512_set1_pd(-0.0);
  __m512d a = _mm512_andnot_pd(sign, u);
  __m512d ac = _mm512_min_pd(a, _mm512_set1_pd(20.0));
  __m512d e = exp_pd(_mm512_add_pd(ac, ac));
  __m512d big = _mm512_div_pd(_mm512_sub_pd(e, _mm512_set1_pd(1.0)),
                              _mm512_add_pd(e, _mm512_set1_pd(1.0)));
  __m512d a2 = _mm512_mul_pd(a, a);
  __m512d small = _mm512_fmadd_pd(a2, _mm512_set1_pd(2.0 / 15.0), _mm512_set1_pd(-1.0 / 3.0));
  small = _mm512_fmadd_pd(_mm512_mul_pd(small, a2), a, a);
  __mmask8 is_small = _mm512_cmp_pd_mask(a, _mm512_set1_pd(1.0 / 4096.0), _CMP_LT_OQ);
  __m512d t = _mm512_mask_blend_pd(is_small, big, small);
  return _mm512_or_pd(t, _mm512_and_pd(u, sign));
}

// tanh(u), computed in double and rounded once to float
static inline V16 v_tanh(V16 u) {
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(u.v));
  __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(u.v, 1));
  __m256 rl = _mm512_cvtpd_ps(tanh_pd(lo)), rh = _mm512_cvtpd_ps(tanh_pd(hi));
  return {_mm512_insertf32x8(_mm512_castps256_ps512(rl), rh, 1)};
}

// float(double(x) · s) and float(double(x) − s): one rounding each
static inline V16 v_mul_f64(V16 x, double s) {
  __m512d sd = _mm512_set1_pd(s);
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x.v));
  __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x.v, 1));
  __m256 rl = _mm512_cvtpd_ps(_mm512_mul_pd(lo, sd)), rh = _mm512_cvtpd_ps(_mm512_mul_pd(hi, sd));
  return {_mm512_insertf32x8(_mm512_castps256_ps512(rl), rh, 1)};
}

// acc[0..n) += x (double), n a multiple of 16
static inline void add_f64(double* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    __m512 xv = _mm512_loadu_ps(x + i);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(xv));
    __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(xv, 1));
    _mm512_storeu_pd(acc + i, _mm512_add_pd(_mm512_loadu_pd(acc + i), lo));
    _mm512_storeu_pd(acc + i + 8, _mm512_add_pd(_mm512_loadu_pd(acc + i + 8), hi));
  }
}

// the dropout hash on 16 lanes
static inline U16 u_load(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
static inline U16 u_xor(U16 a, uint32_t s) { return {_mm512_xor_si512(a.v, _mm512_set1_epi32((int)s))}; }
static inline U16 u_mix(U16 a) {
  __m512i x = a.v;
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x6A09E667));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  return {_mm512_xor_si512(x, _mm512_srli_epi32(x, 15))};
}
static inline M16 u_ge(U16 a, uint32_t t) {
  return {_mm512_cmpge_epu32_mask(a.v, _mm512_set1_epi32((int)t))};
}

// n values of a bf16 / fp16 row to float (n ≥ 16: the tail is converted by the caller)
static inline int64_t cvt_bf16(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s + i)));
    _mm512_storeu_ps(d + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  return i;
}
static inline int64_t cvt_f16(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
  return i;
}

// dst[c][r] = src[r][c] for a 16×16 block
static inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD));
  }
}

// C[M×N] = A[M×K] · B[K×N] in float (microkernel.h): blocks of 6 rows × 64 columns
__attribute__((noinline)) static void gemm(int64_t M, int64_t N, int64_t K, const float* A,
                                           int64_t sam, int64_t sak, const float* B, int64_t ldb,
                                           float* C, int64_t ldc) {
  gemm_blocks<F32x16, 6, 4>(M, N, K, A, sam, sak, B, ldb, C, ldc);
}

// float((keep ? x·mul : 0) − s) for 16 doubles x: one rounding (the backward's dP − Δ)
static inline V16 v_dsub(const double* x, double mul, double s, M16 keep) {
  const __m512d m = _mm512_set1_pd(mul), sd = _mm512_set1_pd(s);
  __m512d lo = _mm512_maskz_mul_pd((__mmask8)(keep.k & 0xFF), _mm512_loadu_pd(x), m);
  __m512d hi = _mm512_maskz_mul_pd((__mmask8)(keep.k >> 8), _mm512_loadu_pd(x + 8), m);
  __m256 rl = _mm512_cvtpd_ps(_mm512_sub_pd(lo, sd)), rh = _mm512_cvtpd_ps(_mm512_sub_pd(hi, sd));
  return {_mm512_insertf32x8(_mm512_castps256_ps512(rl), rh, 1)};
}

// C[M×N] = A[M×K] · B[K×N] in double, N a multiple of 8; conventions of gemm. Used where fp32
// products must be summed without rounding (products of floats are exact in double).
__attribute__((noinline)) static void gemm64(int64_t M, int64_t N, int64_t K, const double* A,
                                             int64_t sam, int64_t sak, const double* B,
                                             int64_t ldb, double* C, int64_t ldc) {
  gemm_blocks<F64x8, 6, 4>(M, N, K, A, sam, sak, B, ldb, C, ldc);
}

// The chains as the AVX2 path forms them (docs/cpu.md, Accuracy), so both give the same bits:
// scores (and the backward's float dP) in chains of SCORE_CHAIN products, P·V in one chain per
// tile span (≤ 64 keys), dQ, dK and dV in chains of ACC_CHAIN. Each chain's widening and double
// adds cost FP slots the FMAs would use: with chains of 16 they took a large share of the
// scores' micro-kernel, and on a CPU that splits 512-bit operations in two (Zen 4) this path ran
// slower than the AVX2 one (measured: docs/cpu.md, Measurements behind the code).
constexpr int64_t SCORE_CHAIN = 2 * CHAIN;
constexpr int64_t PV_CHAIN = BK;
constexpr int64_t ACC_CHAIN = 2 * CHAIN;

// C = float(scale · Σ_c chain_c) for C[M×N] = A[M×K]·B[K×N], A read as A[m·sam + k], N a
// multiple of 16: chain c is the sequential fused sum, from 0, of the products k = 32c … 32c+31
// (SCORE_CHAIN, as gemm forms it), widened exactly to double; the chains are added in order in
// double and the sum rounded once. The same (m, n) gets the same bits from any call. With D
// (double, same ldc) instead of C: D = Σ_c chain_c, neither scaled nor rounded (the backward's
// dP, gemm_dp). Four rows × 32 columns: 16 double sums, 8 float chains, 2 B vectors and a
// broadcast fit the 32 registers.
template <int MR, int NV>
static inline void micro_chain(int64_t K, const float* A, int64_t sam, const float* B, int64_t ldb,
                               float* C, int64_t ldc, double scale, double* D) {
  __m512d acc[MR][2 * NV];
  for (int64_t k0 = 0; k0 < K; k0 += SCORE_CHAIN) {
    const int64_t k1 = K - k0 < SCORE_CHAIN ? K : k0 + SCORE_CHAIN;
    __m512 p[MR][NV];
    chain_block<F32x16, MR, NV>(k0, k1, A, sam, 1, B, ldb, p);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(p[m][v]));
        const __m512d hi = _mm512_cvtps_pd(
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p[m][v]), 1)));
        acc[m][2 * v] = k0 == 0 ? lo : _mm512_add_pd(acc[m][2 * v], lo);
        acc[m][2 * v + 1] = k0 == 0 ? hi : _mm512_add_pd(acc[m][2 * v + 1], hi);
      }
  }
  if (D != nullptr) {
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < 2 * NV; ++v) _mm512_storeu_pd(D + m * ldc + 8 * v, acc[m][v]);
    return;
  }
  const __m512d sc = _mm512_set1_pd(scale);
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(acc[m][2 * v], sc));
      const __m256 hi = _mm512_cvtpd_ps(_mm512_mul_pd(acc[m][2 * v + 1], sc));
      _mm512_storeu_ps(C + m * ldc + 16 * v,
                       _mm512_castpd_ps(_mm512_insertf64x4(
                           _mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1)));
    }
}

// D = D·α + chain, row m: one float chain of K products (A[m·sam + k·sak], fused, from 0, in
// order: gemm's chain), widened and added into D straight from the registers (acc_chains'
// arithmetic for one chain; without alpha, α = 1: D + chain). P·V (K ≤ PV_CHAIN) and the
// backward's dV, dK and dQ (gemm_acc). Six rows × 64 columns: 24 float chains, 4 B vectors and
// a broadcast in the 32 registers.
template <int MR, int NV>
static inline void micro_pv(int64_t K, const float* A, int64_t sam, int64_t sak, const float* B,
                            int64_t ldb, double* D, int64_t ldd, const double* alpha) {
  __m512 p[MR][NV];
  chain_block<F32x16, MR, NV>(0, K, A, sam, sak, B, ldb, p);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    double* d = D + m * ldd;
    const __m512d am = _mm512_set1_pd(alpha ? alpha[m] : 1.0);  // D·1 + x is D + x exactly
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(p[m][v]));
      const __m512d hi = _mm512_cvtps_pd(
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p[m][v]), 1)));
      double* d0 = d + 16 * v;
      _mm512_storeu_pd(d0, _mm512_fmadd_pd(_mm512_loadu_pd(d0), am, lo));
      _mm512_storeu_pd(d0 + 8, _mm512_fmadd_pd(_mm512_loadu_pd(d0 + 8), am, hi));
    }
  }
}

// micro_chain over M rows (blocks of 4) and 32-column blocks of N (N a multiple of 16): C, or D
// where C is null
static void chain_blocks(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                         const float* B, int64_t ldb, float* C, double* D, int64_t ldc,
                         double scale) {
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const bool wide = N - n0 >= 32;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* a = A + m0 * sam;
      float* c = C ? C + m0 * ldc + n0 : nullptr;
      double* d = C ? nullptr : D + m0 * ldc + n0;
      const int64_t mr = M - m0 < 4 ? M - m0 : 4;
#define QKV_MC(MRR)                                                             \
  if (wide) micro_chain<MRR, 2>(K, a, sam, B + n0, ldb, c, ldc, scale, d);      \
  else micro_chain<MRR, 1>(K, a, sam, B + n0, ldb, c, ldc, scale, d);
      switch (mr) {
        case 1: QKV_MC(1) break;
        case 2: QKV_MC(2) break;
        case 3: QKV_MC(3) break;
        default: QKV_MC(4) break;
      }
#undef QKV_MC
    }
  }
}

// micro_pv over M rows (blocks of 6) and 64-column blocks of N (N a multiple of 16), K ≤ the
// caller's chain
static void pv_blocks(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                      const float* B, int64_t ldb, double* D, int64_t ldd, const double* alpha) {
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nv = (N - n0) / 16 < 4 ? (N - n0) / 16 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const int64_t mr = M - m0 < 6 ? M - m0 : 6;
      const float* a = A + m0 * sam;
      const float* b = B + n0;
      double* d = D + m0 * ldd + n0;
      const double* al = alpha ? alpha + m0 : nullptr;
#define QKV_PV(NVV)                                                      \
  switch (mr) {                                                          \
    case 1: micro_pv<1, NVV>(K, a, sam, sak, b, ldb, d, ldd, al); break;   \
    case 2: micro_pv<2, NVV>(K, a, sam, sak, b, ldb, d, ldd, al); break;   \
    case 3: micro_pv<3, NVV>(K, a, sam, sak, b, ldb, d, ldd, al); break;   \
    case 4: micro_pv<4, NVV>(K, a, sam, sak, b, ldb, d, ldd, al); break;   \
    case 5: micro_pv<5, NVV>(K, a, sam, sak, b, ldb, d, ldd, al); break;   \
    default: micro_pv<6, NVV>(K, a, sam, sak, b, ldb, d, ldd, al); break; \
  }
      switch (nv) {
        case 1: QKV_PV(1) break;
        case 2: QKV_PV(2) break;
        case 3: QKV_PV(3) break;
        default: QKV_PV(4) break;
      }
#undef QKV_PV
    }
  }
}

// The scores (micro_chain). With D (double, same ldc) instead of C: D = D·alpha[m] + the chain's
// sum, row m (P·V: K ≤ PV_CHAIN, one tile span; micro_pv).
static void gemm_chain(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                       const float* B, int64_t ldb, float* C, int64_t ldc, double scale,
                       double* D = nullptr, const double* alpha = nullptr) {
  if (D)
    pv_blocks(M, N, K, A, sam, 1, B, ldb, D, ldc, alpha);
  else
    chain_blocks(M, N, K, A, sam, B, ldb, C, nullptr, ldc, scale);
}

// The backward's accumulations: D[m·ldd + n] += Σ_c double(chain_c), chain c the float sum
// (gemm's chain: fused, from 0, in order) of A[m·sam + k·sak]·B[k·ldb + n] over k = 32c …
// 32c + 31 (ACC_CHAIN; `chain` terms, ONE_CHAIN for 16-bit inputs: one chain per call), each
// widened and added from the registers in order of c. N a multiple of 16; tmp unused here.
static void gemm_acc(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                     const float* B, int64_t ldb, double* D, int64_t ldd, float*, int64_t chain) {
  for (int64_t k0 = 0; k0 < K; k0 += chain)
    pv_blocks(M, N, K - k0 < chain ? K - k0 : chain, A + k0 * sak, sam, sak,
              B + k0 * ldb, ldb, D, ldd, nullptr);
}

// The backward's dP[M×N] (double, ld ldc) = dO[M×K]·Vᵀ[K×N]: with `exact`, gemm64 over dO and Vᵀ
// in double (a64, ld K; b64, ld ldb): products exact, sums in double; else (a query tile with no
// peaked row, docs/cpu.md, Accuracy) the scores' arithmetic over the float copies (a, ld lda; b,
// ld ldb): float chains of SCORE_CHAIN products summed in double, neither scaled nor rounded.
// N a multiple of 16.
constexpr bool DP_FLOAT_CHAINS = true;  // gemm_dp has a float form (tiles without a peaked row)
static void gemm_dp(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const double* a64,
                    const float* b, const double* b64, int64_t ldb, double* C, int64_t ldc,
                    bool exact) {
  if (exact) {
    gemm64(M, N, K, a64, K, 1, b64, ldb, C, ldc);
    return;
  }
  chain_blocks(M, N, K, a, lda, b, ldb, nullptr, C, ldc, 1.0);
}

// acc[0..n) = acc·alpha + Σ_c x[c·stride + i] for n_chains ≤ 4 float partials, in double
static inline void acc_chains(double* acc, const float* x, int64_t stride, int64_t n_chains,
                              double alpha, int64_t n) {
  const __m512d a = _mm512_set1_pd(alpha);
  for (int64_t i = 0; i < n; i += 8) {
    __m512d s = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    for (int64_t c = 1; c < n_chains; ++c)
      s = _mm512_add_pd(s, _mm512_cvtps_pd(_mm256_loadu_ps(x + c * stride + i)));
    _mm512_storeu_pd(acc + i, _mm512_fmadd_pd(_mm512_loadu_pd(acc + i), a, s));
  }
}

// out[r·lds] = float(scale · Σ_d q[r][d]·k[d]) for rows r < M, out_lo its low part (score_lo):
// the scores of few query rows against one key row (decoding; rows whose scores the kernel
// forms exactly). Sums run in 8 double lanes over d, then the lanes in a fixed tree (the AVX2
// path's order); tails past a multiple of 8 are summed after, in order. NR rows at a time, NR a
// template argument so the sums stay in registers (with a runtime row count GCC kept them on
// the stack: a store and a load per product). float: 16 float lanes likewise.
template <int NR>
static inline void dot_rows64_n(const double* q, int64_t ldq, const float* k, int64_t n,
                                float* out, float* out_lo, int64_t lds, double scale) {
  const int64_t n8 = n & ~int64_t(7);
  __m512d acc[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_pd();
  for (int64_t d = 0; d < n8; d += 8) {
    const __m512d kd = _mm512_cvtps_pd(_mm256_loadu_ps(k + d));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_pd(_mm512_loadu_pd(q + r * ldq + d), kd, acc[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const double* qr = q + r * ldq;
    double s = _mm512_reduce_add_pd(acc[r]);
    for (int64_t d = n8; d < n; ++d) s = __builtin_fma(qr[d], (double)k[d], s);
    const double x = s * scale;
    out[r * lds] = (float)x;
    out_lo[r * lds] = score_lo(x, (float)x);
  }
}
static inline void dot_rows64(const double* q, int64_t ldq, int64_t M, const float* k, int64_t n,
                              float* out, float* out_lo, int64_t lds, double scale) {
  for (int64_t r0 = 0; r0 < M; r0 += 4) {  // four rows share each widened chunk of k
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
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n16; d += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(k + d), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (int64_t d = n16; d < n; ++d) s = __builtin_fmaf(qr[d], k[d], s);
    out[r * lds] = s * scale;
  }
}

