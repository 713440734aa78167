// The core's own limits, for the benchmarks' efficiency figures: one thread's rate of float32
// fused multiply-adds (AVX-512, else AVX2) and of AVX512-BF16's bfloat16 dot products, each in a
// loop over 16 independent register accumulators (no memory traffic, nothing the compiler can
// merge), and of AMX's bfloat16 tile multiply (TDPBF16PS over four independent accumulator
// tiles from register-resident A and B tiles), run for about `seconds`. GFLOP/s counts a
// multiply-add as 2 FLOP (a dot-product instruction: 16 lanes × 2 pairs × 2 = 64; a tile
// multiply: 16 × 16 × 32 × 2 = 16384); 0 where the CPU (or the OS) lacks the instructions.
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace qkv_cpu {
namespace {

#define QKV_PEAK_ALL(M) \
  M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)

// A probe: 16 accumulators of type VEC, started apart (seed · i, so none merges with another),
// each stepped by STEP (one instruction of `flops` FLOP) in rounds of 2¹⁶ until `seconds` pass;
// their sum goes to *sink (so none is dropped). Returns GFLOP/s.
#define QKV_PEAK_PROBE(NAME, TARGET, VEC, SET1, STEP, FLOPS)                              \
  __attribute__((target(TARGET))) double NAME(double seconds, float seed, float* sink) {  \
    QKV_PEAK_ALL(QKV_PEAK_INIT_##VEC)                                                     \
    int64_t n = 0;                                                                         \
    const auto t0 = std::chrono::steady_clock::now();                                      \
    double t = 0;                                                                          \
    do {                                                                                   \
      for (int r = 0; r < 65536; ++r) { QKV_PEAK_ALL(STEP) }                               \
      n += 65536;                                                                          \
      t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();    \
    } while (t < seconds);                                                                 \
    VEC s = SET1(0.0f);                                                                    \
    QKV_PEAK_ALL(QKV_PEAK_SUM)                                                             \
    *sink = s[0];                                                                          \
    return (double)n * 16 * FLOPS / t / 1e9;                                               \
  }
#define QKV_PEAK_INIT___m512(i) __m512 a##i = _mm512_set1_ps(seed * (float)(i));
#define QKV_PEAK_INIT___m256(i) __m256 a##i = _mm256_set1_ps(seed * (float)(i));
#define QKV_PEAK_SUM(i) s = s + a##i;

#define QKV_DP(i) a##i = _mm512_dpbf16_ps(a##i, (__m512bh)_mm512_set1_epi32(0x3f803f80), \
                                          (__m512bh)_mm512_set1_epi32(0x30003000));
#define QKV_FMA16(i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(1e-9f), a##i);
#define QKV_FMA8(i) a##i = _mm256_fmadd_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(1e-9f), a##i);
QKV_PEAK_PROBE(dp_bf16, "avx512f,avx512bf16", __m512, _mm512_set1_ps, QKV_DP, 64)
QKV_PEAK_PROBE(fma_avx512, "avx512f", __m512, _mm512_set1_ps, QKV_FMA16, 32)
QKV_PEAK_PROBE(fma_avx2, "avx2,fma", __m256, _mm256_set1_ps, QKV_FMA8, 16)

// AMX-TILE and AMX-BF16 (CPUID leaf 7) and the OS's leave to use the tile state (Linux:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), as the kernel asks it)
bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
#if defined(__linux__)
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
  return false;
#endif
}

// palette 1, tiles 0–7 of 16 rows × 64 bytes
struct alignas(64) PeakTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// TDPBF16PS into C tiles 0–3 from A tiles 4, 5 and B tiles 6, 7 (every tile 16 rows × 64
// bytes), loaded once: four independent chains, in rounds of 4096 until `seconds` pass
__attribute__((target("amx-tile,amx-bf16"))) double amx_bf16(double seconds, float* sink) {
  const PeakTileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3f80;  // 1.0
    b[i] = 0x3000;  // 2⁻³¹
  }
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  int64_t n = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double t = 0;
  do {
    for (int r = 0; r < 4096; ++r) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    n += 4 * 4096;
    t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (t < seconds);
  _tile_stored(0, c, 64);
  _tile_release();
  *sink = c[0];
  return (double)n * 16384 / t / 1e9;
}

double peak_gflops(const std::string& kind, double seconds) {
  TORCH_CHECK(kind == "fma_f32" || kind == "dp_bf16" || kind == "amx_bf16",
              "qkv_cpu: peak_gflops takes fma_f32, dp_bf16 or amx_bf16, got '", kind, "'");
  float sink = 0;
  __builtin_cpu_init();
  const bool avx512f = __builtin_cpu_supports("avx512f");
  if (kind == "amx_bf16") return amx_usable() ? amx_bf16(seconds, &sink) : 0.0;
  if (kind == "dp_bf16") return avx512f && __builtin_cpu_supports("avx512bf16") ? dp_bf16(seconds, 1.0f, &sink) : 0.0;
  if (avx512f) return fma_avx512(seconds, 1.0f, &sink);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return fma_avx2(seconds, 1.0f, &sink);
  return 0.0;
}

}  // namespace
}  // namespace qkv_cpu

#else  // no probes off x86-64

namespace qkv_cpu {
namespace {
double peak_gflops(const std::string&, double) { return 0.0; }
}  // namespace
}  // namespace qkv_cpu

#endif

TORCH_LIBRARY_FRAGMENT(qkv_cpu, m) {
  m.def("peak_gflops(str kind, float seconds) -> float", &qkv_cpu::peak_gflops);
}
