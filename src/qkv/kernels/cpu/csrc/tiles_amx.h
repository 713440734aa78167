// The tile unit (Intel AMX, BF16) for the products of bfloat16 inputs and for the scores of
// float32 ones. Included by isa_amx.cpp after simd_avx512.h, inside its namespace; kernel.h reads
// TILE_BF16, tile_gemm (the scores), tile_pack_rows, tile_put_p and tile_pv (the forward's P·V),
// and for float32 TILE_F32, tile_pack_rows3, tile_pack_keys3 and tile_chain3 (the scores, in
// three bfloat16 parts per value; below): the tile part of isa_contract.h. The avx512bf16 path
// has tiles_dpbf16.h (the same bfloat16 products on the vector unit's dot-product instruction,
// no float32 ones); every other ISA has tiles_none.h, whose stand-ins say "no tiles". The packed
// operands both read are bf16_pack.h's.
//
// A tile product C += A·B takes A as 16 rows × 32 bfloat16 and B as 16 rows of 16 bfloat16
// pairs (B's rows 2p and 2p + 1 interleaved, the "VNNI" layout) and sums in float32: each
// product of two bfloat16 is exact in float32, the sums round as float sums do. The operands
// are the kernel's float copies of bfloat16 data (Q, K, V: exact in bfloat16) and, for the
// forward's weights P (float32), P rounded to bfloat16 (a weight carries a rounding of at most
// 2⁻⁹ of itself, the size of the output's own rounding; FlashAttention and torch's CPU kernel
// round P the same way), and the backward's P and dS rounded to bfloat16 likewise, as
// FlashAttention's backward rounds them (their gradients hold the error-ratio rule: docs/cpu.md).
// Subnormal inputs and results are flushed to zero by the unit (below 1.2e-38 in magnitude).

static constexpr bool TILE_BF16 = true;

#include "bf16_pack.h"

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

// The C tiles 0–3, holding nt (1 … 4) blocks of 16 columns: zeroed; loaded from and stored to
// c + 16·t (ld bytes a row); C tile t += A tile 4 · the B tile at b + 256·t (through tile 5)
static inline __attribute__((always_inline)) void c_tiles_zero() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
static inline __attribute__((always_inline)) void c_tiles_load(int64_t nt, const float* c,
                                                              int64_t ld) {
  if (nt > 0) _tile_loadd(0, c, ld);
  if (nt > 1) _tile_loadd(1, c + 16, ld);
  if (nt > 2) _tile_loadd(2, c + 32, ld);
  if (nt > 3) _tile_loadd(3, c + 48, ld);
}
static inline __attribute__((always_inline)) void c_tiles_store(int64_t nt, float* c, int64_t ld) {
  _tile_stored(0, c, ld);
  if (nt > 1) _tile_stored(1, c + 16, ld);
  if (nt > 2) _tile_stored(2, c + 32, ld);
  if (nt > 3) _tile_stored(3, c + 48, ld);
}
static inline __attribute__((always_inline)) void c_tiles_dp(int64_t nt, const uint32_t* b) {
  if (nt > 0) {
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
  }
  if (nt > 1) {
    _tile_loadd(5, b + 256, 64);
    _tile_dpbf16ps(1, 4, 5);
  }
  if (nt > 2) {
    _tile_loadd(5, b + 512, 64);
    _tile_dpbf16ps(2, 4, 5);
  }
  if (nt > 3) {
    _tile_loadd(5, b + 768, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// The scores' product C[M×N] = A[M×K]·B[K×N] (C ld ldc; B ld ldb, floats holding bfloat16
// values, or, with bpairs, B's blocks already packed (pack_b_blocks, 4 blocks a step; N ≤ 64);
// A the rows' tiles from tile_pack_rows, or, with apack null, floats (ld lda) packed here). N a
// multiple of 16. Each element is the unit's float sum over K in steps of 32, the
// same whatever M, N and the element's place. False (nothing done) where K > TILE_K_MAX.
static bool tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                      const uint16_t* apack, const float* B, int64_t ldb, const uint32_t* bpairs,
                      float* C, int64_t ldc) {
  if (K > TILE_K_MAX) return false;
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  alignas(64) uint32_t bs[TILE_K_MAX / TILE_K * 4 * 256];
  alignas(64) uint16_t ah[TILE_K_MAX / TILE_K * 512];
  alignas(64) float cs[16 * 64];
  tiles_on();
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nt = (N - n0) / 16 < 4 ? (N - n0) / 16 : 4;
    const uint32_t* bt = b_blocks(bpairs, B + n0, ldb, K, nt, 4, bs);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t rows = M - m0 < 16 ? M - m0 : 16;
      const uint16_t* a = rows_blocks(A, lda, apack, m0, rows, K, ah);
      c_tiles_zero();
      for (int64_t kk = 0; kk < nk; ++kk) {
        _tile_loadd(4, a + kk * 512, 64);
        c_tiles_dp(nt, bt + kk * 4 * 256);
      }
      // 16 rows straight into C; a last block of fewer rows through cs
      float* c = rows == 16 ? C + m0 * ldc + n0 : cs;
      const int64_t ld = rows == 16 ? ldc * 4 : 256;
      c_tiles_store(nt, c, ld);
      for (int64_t r = 0; r < rows && rows < 16; ++r)
        for (int64_t x = 0; x < 16 * nt; x += 16)
          _mm512_storeu_ps(C + (m0 + r) * ldc + n0 + x, _mm512_loadu_ps(cs + r * 64 + x));
    }
  }
  _tile_release();
  return true;
}

// acc[M×N] (float, ld ldc, rows padded to a multiple of 16) = acc·alpha[m] + A·B, the forward's
// P·V for bfloat16 inputs: A (M × K, K ≤ 64) packed by tile_put_p, B (ld ldb) packed here or
// already (bpairs: pack_b_blocks, N/16 blocks a step). acc is loaded into the C tiles, the
// products add to it there, and it is stored back; rows whose α is 1 (the row's maximum did not
// move) are not touched by the vector unit at all. N ≤ TILE_PV_N and a multiple of 16.
static void tile_pv(int64_t M, int64_t N, int64_t K, const uint16_t* ap,
                    const float* B, int64_t ldb, const uint32_t* bpairs, float* acc, int64_t ldc,
                    const double* alpha) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K, ntt = N / 16;
  alignas(64) uint32_t bs[2 * (TILE_PV_N / 16) * 256];
  tiles_on();
  const uint32_t* bt = b_blocks(bpairs, B, ldb, K, ntt, ntt, bs);
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
      c_tiles_load(nt, c, ldc * 4);
      for (int64_t kk = 0; kk < nk; ++kk) {
        _tile_loadd(4, ap + (m0 / 16 * 2 + kk) * 512, 64);
        c_tiles_dp(nt, bt + (kk * ntt + t0) * 256);
      }
      c_tiles_store(nt, c, ldc * 4);
    }
  }
  _tile_release();
}

// ------------------------------------------------------------------------- float32 on the tiles
//
// A float32 x is the exact sum of three bfloat16 parts, x = h + m + l (h = bf16(x), m =
// bf16(x − h), l = x − h − m: 8 + 8 + 8 bits of x's 24), so a product q·k is the sum of the nine
// products of parts, each exact in float32. The six kept (q_h k_h; q_h k_m, q_m k_h; q_h k_l,
// q_m k_m, q_l k_h) leave out terms below 2⁻²⁵ of |q·k|, under a float rounding of it. The
// tiles add them into a float32 accumulator, smallest first, so a score is one float chain of
// 32 products per step of 32 values of d (the bigger parts' sum rounding as an FMA chain's
// does), and the steps are summed in double: the arithmetic of gemm_chain's chains of 32, with
// the tile unit doing the multiplying (about 16 times the FMA rate of the vector unit).
// Values the split cannot carry exactly read as 0 and flag their row or column, whose scores the
// caller forms with gemm_chain instead: non-finite ones, and nonzero ones below 2⁻⁸⁰ in
// magnitude (their low parts, times a scale ≥ 2⁻¹⁶, would be subnormal, which the unit reads as 0). Where bf16(x) would
// overflow (|x| ≥ 0x7F7F8000), h is x truncated to bfloat16 instead; the parts still sum to x.

static constexpr bool TILE_F32 = true;

// the parts of 16 floats as bfloat16 bits; the lanes that cannot be split set their bit in *bad
static inline void split3(__m512 x, __m256i& h, __m256i& m, __m256i& l, __mmask16& bad) {
  const __m512 ax = _mm512_abs_ps(x);
  const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 tiny = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0x1p-80f), _CMP_LT_OQ) &
                         _mm512_cmp_ps_mask(ax, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  const __mmask16 ok = fin & (__mmask16)~tiny;
  bad |= (__mmask16)~ok;
  x = _mm512_maskz_mov_ps(ok, x);
  const __mmask16 big = _mm512_cmp_ps_mask(ax, _mm512_castsi512_ps(_mm512_set1_epi32(0x7F7F8000)), _CMP_GE_OQ) & ok;
  const __m512 trunc = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0xFFFF0000u)));
  const __m512 hf = _mm512_mask_mov_ps(f32_of_bf16(bf16_bits(x)), big, trunc);
  h = bf16_bits(hf);
  const __m512 r = _mm512_sub_ps(x, hf);
  m = bf16_bits(r);
  l = bf16_bits(_mm512_sub_ps(r, f32_of_bf16(m)));
}

static inline __m512i vnni_pair(__m256i even, __m256i odd) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
}

// The rows' parts (of the rows times scale: 1, or the scores' scale where tile_scale_folds) as A
// tiles: row block m0/16, step kk, part p (h, m, l) at dst + ((m0/16 · nk + kk) · 3 + p) · 512,
// nk = ⌈K/32⌉; bad[r] = 1 for a row the split cannot carry
static inline int64_t tile_a3_elems(int64_t M, int64_t K) { return 3 * tile_a_elems(M, K); }
static void tile_pack_rows3(int64_t M, int64_t K, const float* A, int64_t lda, uint16_t* dst,
                            int8_t* bad, float scale) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  for (int64_t m0 = 0; m0 < M; m0 += 16)
    for (int64_t r = 0; r < 16; ++r) {
      __mmask16 b = 0;
      for (int64_t kk = 0; kk < nk; ++kk) {
        uint16_t* t = dst + (m0 / 16 * nk + kk) * 3 * 512 + r * 32;
        for (int64_t hh = 0; hh < 2; ++hh) {
          const int64_t c = kk * TILE_K + 16 * hh;
          const __mmask16 mk = m0 + r < M ? first_n(K - c) : (__mmask16)0;
          __m256i ph, pm, pl;
          split3(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, A + (m0 + r) * lda + c), _mm512_set1_ps(scale)),
                 ph, pm, pl, b);
          _mm256_storeu_si256((__m256i*)(t + 16 * hh), ph);
          _mm256_storeu_si256((__m256i*)(t + 512 + 16 * hh), pm);
          _mm256_storeu_si256((__m256i*)(t + 1024 + 16 * hh), pl);
        }
      }
      if (m0 + r < M) bad[m0 + r] = b != 0;
    }
}

// A transposed key tile kt (K × 64 floats, ld ldb) as B tiles of parts: step kk, column tile t
// (16 keys), part p at dst + ((kk · 4 + t) · 3 + p) · 256. Returns the columns the split cannot
// carry, one bit per key.
static inline int64_t tile_b3_elems(int64_t K) { return (K + TILE_K - 1) / TILE_K * 4 * 3 * 256; }
static uint64_t tile_pack_keys3(int64_t K, const float* B, int64_t ldb, uint32_t* dst) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  uint64_t bad = 0;
  for (int64_t t = 0; t < 4; ++t) {
    __mmask16 b = 0;
    for (int64_t kk = 0; kk < nk; ++kk) {
      uint32_t* d = dst + (kk * 4 + t) * 3 * 256;
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t k = kk * TILE_K + 2 * p;
        const __m512 e = k < K ? _mm512_loadu_ps(B + k * ldb + 16 * t) : _mm512_setzero_ps();
        const __m512 o = k + 1 < K ? _mm512_loadu_ps(B + (k + 1) * ldb + 16 * t) : _mm512_setzero_ps();
        __m256i eh, em, el, oh, om, ol;
        split3(e, eh, em, el, b);
        split3(o, oh, om, ol, b);
        _mm512_storeu_si512(d + p * 16, vnni_pair(eh, oh));
        _mm512_storeu_si512(d + 256 + p * 16, vnni_pair(em, om));
        _mm512_storeu_si512(d + 512 + p * 16, vnni_pair(el, ol));
      }
    }
    bad |= (uint64_t)b << (16 * t);
  }
  return bad;
}

// C tile t (0–3, at run time) += A tile 4 · B tile BREG
#define qkv_dp_c(t, BREG)                        \
  switch (t) {                                   \
    case 0: _tile_dpbf16ps(0, 4, BREG); break;   \
    case 1: _tile_dpbf16ps(1, 4, BREG); break;   \
    case 2: _tile_dpbf16ps(2, 4, BREG); break;   \
    default: _tile_dpbf16ps(3, 4, BREG); break;  \
  }

// C tile t += A tile 4 · the B tile at b, loaded into the next of tiles 5, 6, 7 (reg: 0, 1, 2,
// advanced here): a load waits for the product that last read its tile, so consecutive products
// read different ones
static inline void dp_next_b(int& reg, int64_t t, const uint32_t* b) {
  switch (reg) {
    case 0: _tile_loadd(5, b, 64); qkv_dp_c(t, 5); break;
    case 1: _tile_loadd(6, b, 64); qkv_dp_c(t, 6); break;
    default: _tile_loadd(7, b, 64); qkv_dp_c(t, 7); break;
  }
  reg = reg == 2 ? 0 : reg + 1;
}

// C[M×N] (ld ldc) = float(scale · Σ_kk chain_kk) for the rows' parts (apack, tile_pack_rows3)
// against key columns 16·t0 … 16·t0 + N − 1 of the key tile's parts (bpack, tile_pack_keys3);
// chain kk is the unit's float sum, from 0, of the six products of parts over d = 32kk … 32kk+31
// in the order q_l k_h, q_m k_m, q_m k_h, q_h k_l, q_h k_m, q_h k_h; the chains widened to double
// and added in order (gemm_chain's conventions). With `folded` (the rows' parts came times the
// scale, a power of two: tile_scale_folds) the unit's accumulator runs on over all of d instead
// (one float chain of the products, step after step, in the order above) and whole blocks of 16
// rows are stored from the tiles straight into C: no vector pass (the scores take fewer cycles,
// measured: docs/cpu.md, Measurements behind the code). The same (row, key) gets the same bits
// from any call. N a multiple of 16, 16·t0 + N ≤ 64, K ≤ TILE_K_MAX.
// whether the scores' scale folds into the rows' parts: a power of two, so that (q·s)·k is
// (q·k)·s exactly, and ≥ 2⁻¹⁶, so that no part it scales becomes subnormal (split3's bound)
static inline bool tile_scale_folds(float scale) {
  int e = 0;
  return __builtin_frexpf(scale, &e) == 0.5f && e >= -15 && e <= 16;
}

// chain kk of one block of 16 rows (a: its parts) at cs + kk·1024 (16 rows × 64 floats); with
// ldc, one chain over all kk, stored at cs (ld ldc floats)
static inline void chain3_block(int64_t N, int64_t K, const uint16_t* a, const uint32_t* bpack,
                                int64_t t0, float* cs, int64_t ldc = 0) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K, nt = N / 16;
  for (int64_t kk = 0; kk < nk; ++kk) {
    if (kk == 0 || !ldc) c_tiles_zero();
    const uint16_t* ak = a + kk * 3 * 512;
    const uint32_t* b = bpack + (kk * 4 + t0) * 3 * 256;
    // each pass of one A part and one B part runs over the four C tiles, so consecutive
    // products write different accumulators (B's loads rotate, dp_next_b): the order of the
    // products per C tile is the one above
    int reg = 0;
#define QKV_PASS(PART) \
  for (int64_t t = 0; t < nt; ++t) dp_next_b(reg, t, b + t * 3 * 256 + (PART) * 256);
    _tile_loadd(4, ak + 2 * 512, 64);  // q_l
    QKV_PASS(0)
    _tile_loadd(4, ak + 512, 64);  // q_m
    QKV_PASS(1)
    QKV_PASS(0)
    _tile_loadd(4, ak, 64);  // q_h
    QKV_PASS(2)
    QKV_PASS(1)
    QKV_PASS(0)
#undef QKV_PASS
    if (ldc && kk + 1 < nk) continue;
    c_tiles_store(nt, ldc ? cs : cs + kk * 1024, ldc ? ldc * 4 : 256);
  }
}

// chain3_block for two blocks of 16 rows at once (a: the first block's parts, the second's
// follow) against all 64 key columns: the same products in the same order, so the same bits,
// with the C tiles as 2 × 2 (rows × 16 columns: C0 and C1 the first block's, C2 and C3 the
// second's) over one half of the columns at a time. Each loaded tile serves two products (18
// loads per 24 products, against 27 in chain3_block), and each product takes less time (measured:
// docs/cpu.md, Measurements behind the code). With ldc, one chain over all kk stored at C (ld ldc
// floats); without, chain kk of the first block at C + kk·1024 and of the second at C2 + kk·1024.
static inline void chain3_pair(int64_t K, const uint16_t* a, const uint32_t* bpack, float* C,
                               int64_t ldc, float* C2 = nullptr) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  const uint16_t* a1 = a + nk * 3 * 512;
  static constexpr int A_PART[6] = {2, 1, 1, 0, 0, 0}, B_PART[6] = {0, 1, 0, 2, 1, 0};
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t kk = 0; kk < nk; ++kk) {
      if (kk == 0 || !ldc) c_tiles_zero();
      const uint32_t* b = bpack + (kk * 4 + 2 * half) * 3 * 256;
      for (int p = 0; p < 6; ++p) {
        if (p == 0 || A_PART[p] != A_PART[p - 1]) {
          _tile_loadd(4, a + (kk * 3 + A_PART[p]) * 512, 64);
          _tile_loadd(5, a1 + (kk * 3 + A_PART[p]) * 512, 64);
        }
        _tile_loadd(6, b + B_PART[p] * 256, 64);
        _tile_loadd(7, b + (3 + B_PART[p]) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if (!ldc) {
        _tile_stored(0, C + kk * 1024 + 32 * half, 256);
        _tile_stored(1, C + kk * 1024 + 32 * half + 16, 256);
        _tile_stored(2, C2 + kk * 1024 + 32 * half, 256);
        _tile_stored(3, C2 + kk * 1024 + 32 * half + 16, 256);
      }
    }
    if (ldc) {
      float* c = C + 32 * half;
      _tile_stored(0, c, ldc * 4);
      _tile_stored(1, c + 16, ldc * 4);
      _tile_stored(2, c + 16 * ldc, ldc * 4);
      _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
    }
  }
}

// the chains of 16 floats (row r, columns x … x+15) widened to double and added in order
static inline void chains_f64(const float* cs, int64_t nk, int64_t r, int64_t x, __m512d& lo, __m512d& hi) {
  for (int64_t kk = 0; kk < nk; ++kk) {
    const __m512 c = _mm512_load_ps(cs + kk * 1024 + r * 64 + x);
    const __m512d l = _mm512_cvtps_pd(_mm512_castps512_ps256(c));
    const __m512d h = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1)));
    lo = kk == 0 ? l : _mm512_add_pd(lo, l);
    hi = kk == 0 ? h : _mm512_add_pd(hi, h);
  }
}

static void tile_chain3(int64_t M, int64_t N, int64_t K, const uint16_t* apack,
                        const uint32_t* bpack, int64_t t0, float* C, int64_t ldc, double scale,
                        bool folded) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  // each step's chains stored apart (cs + kk·1024) and summed once per row block, so the vector
  // unit's widening and sums of one block overlap the tiles' products of the next
  alignas(64) float cs[TILE_K_MAX / TILE_K * 16 * 64];
  const __m512d sc = _mm512_set1_pd(scale);
  tiles_on();
  int64_t m0 = 0;
  if (folded && N == 64)
    for (; m0 + 32 <= M; m0 += 32) chain3_pair(K, apack + m0 / 16 * nk * 3 * 512, bpack, C + m0 * ldc, ldc);
  for (; m0 < M; m0 += 16) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    if (folded) {
      if (rows == 16) {
        chain3_block(N, K, apack + m0 / 16 * nk * 3 * 512, bpack, t0, C + m0 * ldc, ldc);
        continue;
      }
      chain3_block(N, K, apack + m0 / 16 * nk * 3 * 512, bpack, t0, cs, 64);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t x = 0; x < N; x += 16) _mm512_storeu_ps(C + (m0 + r) * ldc + x, _mm512_load_ps(cs + r * 64 + x));
      continue;
    }
    chain3_block(N, K, apack + m0 / 16 * nk * 3 * 512, bpack, t0, cs);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t x = 0; x < N; x += 16) {
        __m512d lo, hi;
        chains_f64(cs, nk, r, x, lo, hi);
        const __m256 fl = _mm512_cvtpd_ps(_mm512_mul_pd(lo, sc)), fh = _mm512_cvtpd_ps(_mm512_mul_pd(hi, sc));
        _mm512_storeu_ps(C + (m0 + r) * ldc + x,
                         _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(fl)),
                                                             _mm256_castps_pd(fh), 1)));
      }
  }
  _tile_release();
}

// The same chains for 64 columns (the backward's dP = dO Vᵀ: apack dO's rows, bpack V's tile as
// tile_pack_keys3 packs keys), their sums in double, neither scaled nor rounded: C64[M × 64]
// (ld ldc), gemm_dp's float form.
static void tile_chain3_f64(int64_t M, int64_t K, const uint16_t* apack, const uint32_t* bpack,
                            double* C, int64_t ldc) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K;
  alignas(64) float cs[2][TILE_K_MAX / TILE_K * 16 * 64];
  tiles_on();
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t blocks = M - m0 >= 32 ? 2 : 1;
    if (blocks == 2)
      chain3_pair(K, apack + m0 / 16 * nk * 3 * 512, bpack, cs[0], 0, cs[1]);
    else
      chain3_block(64, K, apack + m0 / 16 * nk * 3 * 512, bpack, 0, cs[0]);
    for (int64_t r = 0; r < (M - m0 < 16 * blocks ? M - m0 : 16 * blocks); ++r)
      for (int64_t x = 0; x < 64; x += 16) {
        __m512d lo, hi;
        chains_f64(cs[r / 16], nk, r % 16, x, lo, hi);
        _mm512_storeu_pd(C + (m0 + r) * ldc + x, lo);
        _mm512_storeu_pd(C + (m0 + r) * ldc + x + 8, hi);
      }
    m0 += 16 * blocks;
  }
  _tile_release();
}

// ------------------------------------------------------------------------- the bf16 backward
//
// The backward's products for bfloat16 inputs: dP = dO Vᵀ (tile_gemm: dO and V hold bfloat16
// values), dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS and dQ += dS K (tile_acc), with P and dS rounded to
// bfloat16 as they are formed (backward.h, bwd_p_ds_tiles).

// C[m·ldc + n] += Σ_k A[m][k] · B[k][n] for A as A tiles (tile_pack_a's layout, K values of k)
// and B as B blocks (pack_b_blocks's layout, N/16 blocks a step; N a multiple of 16, at most
// TILE_PV_N): the C tiles loaded from C, one float chain per element over all of K (the unit's
// sums) from C's value, stored back (the backward's dVᵀ, dKᵀ and dQ, summed in float).
static void tile_acc(int64_t M, int64_t N, int64_t K, const uint16_t* apack, const uint32_t* bt,
                     float* C, int64_t ldc) {
  const int64_t nk = (K + TILE_K - 1) / TILE_K, ntt = N / 16;
  alignas(64) float cs[16 * 64];
  tiles_on();
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    for (int64_t t0 = 0; t0 < ntt; t0 += 4) {
      const int64_t nt = ntt - t0 < 4 ? ntt - t0 : 4;
      float* c = C + m0 * ldc + 16 * t0;
      // 16 rows straight from and to C; a last block of fewer rows through cs (rows past M zero)
      if (rows < 16) {
        __builtin_memset(cs, 0, sizeof cs);
        for (int64_t r = 0; r < rows; ++r) __builtin_memcpy(cs + r * 64, c + r * ldc, (size_t)(64 * nt));
      }
      float* cc = rows == 16 ? c : cs;
      const int64_t ld = rows == 16 ? ldc * 4 : 256;
      c_tiles_load(nt, cc, ld);
      int reg = 0;
      for (int64_t kk = 0; kk < nk; ++kk) {
        _tile_loadd(4, apack + (m0 / 16 * nk + kk) * 512, 64);
        for (int64_t t = 0; t < nt; ++t) dp_next_b(reg, t, bt + (kk * ntt + t0 + t) * 256);
      }
      c_tiles_store(nt, cc, ld);
      if (rows < 16)
        for (int64_t r = 0; r < rows; ++r) __builtin_memcpy(c + r * ldc, cs + r * 64, (size_t)(64 * nt));
    }
  }
  _tile_release();
}
