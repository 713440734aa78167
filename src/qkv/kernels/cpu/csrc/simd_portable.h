// The portable SIMD layer: the names isa_contract.h lists, in plain C++ over arrays of 16; the
// compiler vectorises what it can for the baseline ISA. Without FMA every product-sum is a
// multiply then an add: results differ from the AVX paths' in the last bits, but within this
// path the forward and the backward still compute the same scores.

struct V16 { float x[16]; };
struct M16 { uint32_t k; };
struct U16 { uint32_t x[16]; };

#define QKV_LANES for (int i = 0; i < 16; ++i)

#include "microkernel.h"

// a·b + c exactly as gemm's micro-kernel forms it (fused where gemm fuses)
static inline float madd(float a, float b, float c) { return a * b + c; }
static inline V16 v_load(const float* p) { V16 r; QKV_LANES r.x[i] = p[i]; return r; }
static inline void v_store(float* p, V16 a) { QKV_LANES p[i] = a.x[i]; }
static inline void v_stream(float* p, V16 a) { v_store(p, a); }  // no non-temporal stores here
static inline void stream_fence() {}
static constexpr int64_t STREAM_ALIGN = 4;
static inline V16 v_set(float s) { V16 r; QKV_LANES r.x[i] = s; return r; }
static inline V16 v_add(V16 a, V16 b) { V16 r; QKV_LANES r.x[i] = a.x[i] + b.x[i]; return r; }
static inline V16 v_sub(V16 a, V16 b) { V16 r; QKV_LANES r.x[i] = a.x[i] - b.x[i]; return r; }
static inline V16 v_mul(V16 a, V16 b) { V16 r; QKV_LANES r.x[i] = a.x[i] * b.x[i]; return r; }
static inline V16 v_div(V16 a, V16 b) { V16 r; QKV_LANES r.x[i] = a.x[i] / b.x[i]; return r; }
static inline V16 v_fma(V16 a, V16 b, V16 c) {
  V16 r;
  QKV_LANES r.x[i] = a.x[i] * b.x[i] + c.x[i];
  return r;
}
// the second operand wins when either is NaN, as the x86 instructions do
static inline float max1(float a, float b) { return a > b ? a : b; }
static inline V16 v_max(V16 a, V16 b) { V16 r; QKV_LANES r.x[i] = max1(a.x[i], b.x[i]); return r; }
static inline M16 m_bits(uint32_t bits) { return {bits & 0xFFFFu}; }
static inline V16 v_select(M16 m, V16 a, V16 b) {
  V16 r;
  QKV_LANES r.x[i] = ((m.k >> i) & 1u) ? a.x[i] : b.x[i];
  return r;
}
static inline float v_hmax(V16 a) {
  float m = a.x[0];
  for (int i = 1; i < 16; ++i) m = max1(a.x[i], m);
  return m;
}
// whether some lane exceeds b (NaN lanes do not)
static inline bool v_any_gt(V16 a, float b) {
  bool any = false;
  for (int i = 0; i < 16; ++i) any = any || a.x[i] > b;
  return any;
}
static inline float v_hsum(V16 a) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = a.x[i] + a.x[i + 8];
  for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
static inline M16 v_finite(V16 a) {
  uint32_t k = 0;
  QKV_LANES k |= (uint32_t)(a.x[i] - a.x[i] == 0.0f) << i;
  return {k};
}
static inline bool m_all(M16 m) { return m.k == 0xFFFFu; }

static inline V16 v_absdist(int32_t base) {
  V16 r;
  QKV_LANES {
    int64_t d = (int64_t)base - i;
    r.x[i] = (float)(d < 0 ? -d : d);
  }
  return r;
}

static inline float bits_to_f(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

static inline float exp1(float x) {
  const float lo = -87.33654475f;
  if (!(x >= lo)) return x < lo ? 0.0f : x;  // −inf (and anything tiny) → 0, NaN stays NaN
  float xc = x < 88.0f ? x : 88.0f;
  float n = __builtin_nearbyintf(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  float e = q * r + 1.0f;
  return e * bits_to_f((uint32_t)((int32_t)n + 127) << 23);
}
static inline V16 v_exp(V16 x) { V16 r; QKV_LANES r.x[i] = exp1(x.x[i]); return r; }
static inline V16 v_tanh(V16 u) { V16 r; QKV_LANES r.x[i] = (float)__builtin_tanh((double)u.x[i]); return r; }

static inline V16 v_mul_f64(V16 a, double s) {
  V16 r;
  QKV_LANES r.x[i] = (float)((double)a.x[i] * s);
  return r;
}
static inline void add_f64(double* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += (double)x[i];
}

static inline U16 u_load(const uint32_t* p) { U16 r; QKV_LANES r.x[i] = p[i]; return r; }
static inline U16 u_xor(U16 a, uint32_t s) { QKV_LANES a.x[i] ^= s; return a; }
static inline U16 u_mix(U16 a) {
  QKV_LANES {
    uint32_t x = a.x[i];
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x6A09E667u;
    x ^= x >> 16; x *= 0x7FEB352Du; a.x[i] = x ^ (x >> 15);
  }
  return a;
}
static inline M16 u_ge(U16 a, uint32_t t) {
  uint32_t k = 0;
  QKV_LANES k |= (uint32_t)(a.x[i] >= t) << i;
  return {k};
}

static inline int64_t cvt_bf16(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = bits_to_f((uint32_t)s[i] << 16);
  return n;
}
static inline int64_t cvt_f16(const uint16_t*, float*, int64_t) { return 0; }  // caller's scalar path

static inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// C[M×N] = A[M×K] · B[K×N] (microkernel.h): blocks of 4 rows × 16 columns, one float a lane,
// products and sums unfused (madd)
QKV_VECTOR_TRAITS(F32x1, float, float, 1, 0.0f, *p, *p, madd(a, b, c), *p = x);
__attribute__((noinline)) static void gemm(int64_t M, int64_t N, int64_t K, const float* A,
                                           int64_t sam, int64_t sak, const float* B, int64_t ldb,
                                           float* C, int64_t ldc) {
  gemm_blocks<F32x1, 4, 16>(M, N, K, A, sam, sak, B, ldb, C, ldc);
}
#undef QKV_LANES

static inline V16 v_dsub(const double* x, double mul, double s, M16 keep) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.x[i] = (float)((((keep.k >> i) & 1u) ? x[i] * mul : 0.0) - s);
  return r;
}

static void gemm64(int64_t M, int64_t N, int64_t K, const double* A, int64_t sam, int64_t sak,
                   const double* B, int64_t ldb, double* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m) {
    double* c = C + m * ldc;
    for (int64_t n = 0; n < N; ++n) c[n] = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double a = A[m * sam + k * sak];
      const double* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] = c[n] + a * b[n];
    }
  }
}

// P·V's float chains: CHAIN keys, as the scores'
constexpr int64_t PV_CHAIN = CHAIN;

// C = float(scale · Σ_c chain_c), the AVX-512 gemm_chain's conventions with chains of CHAIN
// products (madd, from 0), widened to double, added in order, one rounding.
static void gemm_chain(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                       const float* B, int64_t ldb, float* C, int64_t ldc, double scale,
                       double* D = nullptr, const double* alpha = nullptr) {
  double acc[64];
  float p[64];
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nn = N - n0 < 64 ? N - n0 : 64;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k0 = 0; k0 < K; k0 += CHAIN) {
        const int64_t k1 = K - k0 < CHAIN ? K : k0 + CHAIN;
        for (int64_t n = 0; n < nn; ++n) p[n] = 0.0f;
        for (int64_t k = k0; k < k1; ++k) {
          const float a = A[m * sam + k];
          const float* b = B + k * ldb + n0;
          for (int64_t n = 0; n < nn; ++n) p[n] = madd(a, b[n], p[n]);
        }
        for (int64_t n = 0; n < nn; ++n) acc[n] = k0 == 0 ? (double)p[n] : acc[n] + (double)p[n];
      }
      if (D != nullptr) {  // D = D·α + sum (acc_chains' arithmetic)
        for (int64_t n = 0; n < nn; ++n) D[m * ldc + n0 + n] = D[m * ldc + n0 + n] * alpha[m] + acc[n];
      } else {
        for (int64_t n = 0; n < nn; ++n) C[m * ldc + n0 + n] = (float)(acc[n] * scale);
      }
    }
  }
}

static inline void acc_chains(double* acc, const float* x, int64_t stride, int64_t n_chains,
                              double alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    double s = (double)x[i];
    for (int64_t c = 1; c < n_chains; ++c) s += (double)x[c * stride + i];
    acc[i] = acc[i] * alpha + s;
  }
}

static inline void dot_rows64(const double* q, int64_t ldq, int64_t M, const float* k, int64_t n,
                              float* out, float* out_lo, int64_t lds, double scale) {
  for (int64_t r = 0; r < M; ++r) {
    const double* qr = q + r * ldq;
    double s = 0.0;
    for (int64_t d = 0; d < n; ++d) s = s + qr[d] * (double)k[d];
    const double x = s * scale;
    out[r * lds] = (float)x;
    out_lo[r * lds] = score_lo(x, (float)x);
  }
}
static inline void dot_rows32(const float* q, int64_t ldq, int64_t M, const float* k, int64_t n,
                              float* out, int64_t lds, float scale) {
  for (int64_t r = 0; r < M; ++r) {
    const float* qr = q + r * ldq;
    float s = 0.0f;
    for (int64_t d = 0; d < n; ++d) s = s + qr[d] * k[d];
    out[r * lds] = s * scale;
  }
}

#include "backward_ops.h"
