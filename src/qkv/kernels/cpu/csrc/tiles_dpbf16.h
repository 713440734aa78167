// The products of bfloat16 inputs on AVX512-BF16's dot-product instruction (VDPBF16PS: AMD Zen 4
// and Zen 5, Intel Cooper Lake and later), for CPUs without a tile unit: the avx512bf16 path.
// Included by isa_avx512bf16.cpp after simd_avx512.h, inside its namespace. It provides what
// tiles_amx.h provides for bfloat16 inputs (tile_gemm, tile_pv, tile_acc over bf16_pack.h's packed
// operands), with the same operands: Q, K, V, dO as their bfloat16 values, the forward's P
// rounded to bfloat16, the backward's P and dS rounded to bfloat16 too (tiles_amx.h says why).
// Float32 inputs run the avx512 path's arithmetic (TILE_F32 is false).
//
// One instruction multiplies 16 lanes of bfloat16 pairs and adds both products to 16 float
// accumulators: acc[c] += a[2p]·b[2p][c] + a[2p+1]·b[2p+1][c], with an A pair broadcast to
// every lane and a B row of pairs (16 columns). Each element of a product is one float chain
// over K, pair after pair, whatever M, N and the element's place (so the forward and the
// backward form a score alike). Subnormal inputs and results are flushed to zero, as on the
// tile unit.

static constexpr bool TILE_BF16 = true;
static constexpr bool TILE_F32 = false;

#include "bf16_pack.h"

// Register blocking: RB rows (A pairs broadcast) × NT blocks of 16 columns (B rows of pairs)
// in RB·NT accumulators: at most 6 × 4 = 24 of the 32 registers, with NT for B and one for A.
constexpr int DP_ROWS = 6;
constexpr int DP_COLS = 4;

// How a block of the product starts and ends: C = A·B (SET), C = C·α[m] + A·B (SCALE: the
// forward's P·V), C += A·B (ADD: the backward's sums)
enum class DpEnd { SET, SCALE, ADD };

// One product's operands: A blocks (bf16_pack.h; as uint32 pairs, row r at a + 16r, step kk at
// a + kk·a_step), B blocks (column block t at b + t·b_tile, step kk at + kk·b_step), nk steps;
// the result C (ld ldc), with α for SCALE.
struct DpArgs {
  const uint32_t* a;
  int64_t a_step;
  const uint32_t* b;
  int64_t b_tile, b_step, nk;
  float* c;
  int64_t ldc;
  const double* alpha;
};

// rows r0 … r0+RB−1, column blocks t0 … t0+NT−1 of the product
template <int RB, int NT, DpEnd END>
static inline __attribute__((always_inline)) void dp_block(const DpArgs& g, int64_t r0, int64_t t0) {
  __m512 acc[RB][NT];
  for (int r = 0; r < RB; ++r) {
    const float* c = g.c + (r0 + r) * g.ldc + 16 * t0;
    const __m512 al = _mm512_set1_ps(END == DpEnd::SCALE ? (float)g.alpha[r0 + r] : 0.0f);
    for (int t = 0; t < NT; ++t)
      acc[r][t] = END == DpEnd::SCALE ? _mm512_mul_ps(_mm512_loadu_ps(c + 16 * t), al)
                  : END == DpEnd::ADD ? _mm512_loadu_ps(c + 16 * t)
                                      : _mm512_setzero_ps();
  }
  const uint32_t* arow = g.a + r0 * 16;
  const uint32_t* bcol = g.b + t0 * g.b_tile;
  for (int64_t kk = 0; kk < g.nk; ++kk) {
    const uint32_t* a = arow + kk * g.a_step;
    const uint32_t* b = bcol + kk * g.b_step;
    for (int p = 0; p < 16; ++p) {
      __m512bh bv[NT];
      for (int t = 0; t < NT; ++t) bv[t] = (__m512bh)_mm512_loadu_si512(b + t * g.b_tile + p * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * 16 + p]);
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], bv[t], av);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(g.c + (r0 + r) * g.ldc + 16 * (t0 + t), acc[r][t]);
}

// rows r0 … r0+rows−1 (rows ≤ 16) over column blocks 0 … nt−1: DP_ROWS rows and DP_COLS column
// blocks at a time, the rest by narrower blocks
template <int NT, DpEnd END>
static inline void dp_rows(const DpArgs& g, int64_t r0, int64_t rows, int64_t t0) {
  for (int64_t r = r0; r < r0 + rows;) {
    switch (r0 + rows - r < DP_ROWS ? r0 + rows - r : DP_ROWS) {
      case 6: dp_block<6, NT, END>(g, r, t0); r += 6; break;
      case 5: dp_block<5, NT, END>(g, r, t0); r += 5; break;
      case 4: dp_block<4, NT, END>(g, r, t0); r += 4; break;
      case 3: dp_block<3, NT, END>(g, r, t0); r += 3; break;
      case 2: dp_block<2, NT, END>(g, r, t0); r += 2; break;
      default: dp_block<1, NT, END>(g, r, t0); r += 1; break;
    }
  }
}
template <DpEnd END>
static void dp_product(const DpArgs& g, int64_t r0, int64_t rows, int64_t nt) {
  int64_t t = 0;
  for (; t + DP_COLS <= nt; t += DP_COLS) dp_rows<DP_COLS, END>(g, r0, rows, t);
  for (; t < nt; ++t) dp_rows<1, END>(g, r0, rows, t);
}

// The scores' product C[M×N] = A[M×K]·B[K×N] (as tiles_amx.h's tile_gemm: A the rows' blocks
// from tile_pack_rows, or, with apack null, floats (ld lda) packed here; B ld ldb, floats holding
// bfloat16 values, or, with bpairs, its blocks already packed (N ≤ 64); N a multiple of 16).
// False (nothing done) where K > TILE_K_MAX.
static bool tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                      const uint16_t* apack, const float* B, int64_t ldb, const uint32_t* bpairs,
                      float* C, int64_t ldc) {
  if (K > TILE_K_MAX) return false;
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  alignas(64) uint32_t bs[TILE_K_MAX / TILE_K * 4 * 256];
  alignas(64) uint16_t ah[TILE_K_MAX / TILE_K * 512];
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nt = (N - n0) / 16 < 4 ? (N - n0) / 16 : 4;
    const uint32_t* bt = b_blocks(bpairs, B + n0, ldb, K, nt, 4, bs);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t rows = M - m0 < 16 ? M - m0 : 16;
      const uint16_t* a = rows_blocks(A, lda, apack, m0, rows, K, ah);
      const DpArgs g{(const uint32_t*)a, 256, bt, 256, 1024, nk, C + m0 * ldc + n0, ldc, nullptr};
      dp_product<DpEnd::SET>(g, 0, rows, nt);
    }
  }
  return true;
}

// acc[M×N] (float, ld ldc) = acc·alpha[m] + A·B with A (M × K, K ≤ 64) packed by tile_put_p
// and B packed here, or already (bpairs): the forward's P·V for bfloat16 inputs (tiles_amx.h's
// tile_pv). N ≤ TILE_PV_N, a multiple of 16.
static void tile_pv(int64_t M, int64_t N, int64_t K, const uint16_t* ap, const float* B,
                    int64_t ldb, const uint32_t* bpairs, float* acc, int64_t ldc,
                    const double* alpha) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K, ntt = N / 16;
  alignas(64) uint32_t bs[2 * (TILE_PV_N / 16) * 256];
  const uint32_t* bt = b_blocks(bpairs, B, ldb, K, ntt, ntt, bs);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const DpArgs g{(const uint32_t*)(ap + m0 / 16 * 2 * 512), 256, bt, 256, ntt * 256, nk,
                   acc + m0 * ldc, ldc, alpha + m0};
    dp_product<DpEnd::SCALE>(g, 0, M - m0 < 16 ? M - m0 : 16, ntt);
  }
}

// C[m·ldc + n] += Σ_k A[m][k] · B[k][n] for A as A tiles (tile_pack_a's layout) and B as B
// blocks (pack_b_blocks's layout, N/16 blocks a step): one float chain per element over all of
// K, from C's value (the backward's dVᵀ, dKᵀ and dQ, summed in float; tiles_amx.h's tile_acc).
// N a multiple of 16, at most TILE_PV_N.
static void tile_acc(int64_t M, int64_t N, int64_t K, const uint16_t* apack, const uint32_t* bt,
                     float* C, int64_t ldc) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K, ntt = N / 16;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const DpArgs g{(const uint32_t*)(apack + m0 / 16 * nk * 512), 256, bt, 256, ntt * 256, nk,
                   C + m0 * ldc, ldc, nullptr};
    dp_product<DpEnd::ADD>(g, 0, M - m0 < 16 ? M - m0 : 16, ntt);
  }
}

// float32 scores stay on the vector unit
#include "tiles_no_f32.h"
