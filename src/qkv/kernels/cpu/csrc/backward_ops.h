// The backward's tile products built from an ISA's gemm, add_f64 and gemm64 (included at the
// end of simd_portable.h; simd_avx2.h and simd_avx512.h have their own forms: a fused gemm_acc
// with the same chains, and a gemm_dp with a float form for tiles without a peaked row).

// D[m·ldd + n] += Σ_c double(chain_c), chain c gemm's float sum of A[m·sam + k·sak]·B[k·ldb + n]
// over k = 16c … 16c + 15 (CHAIN) into tmp (M × N floats), widened and added row by row in
// order of c (docs/cpu.md, Accuracy: one float sum over a tile's 64 or 128 rows lost more than
// the reference's). `chain` terms per chain (ACC_CHAIN, or ONE_CHAIN for 16-bit inputs: one
// chain per call). N a multiple of 16.
constexpr int64_t ACC_CHAIN = CHAIN;
static void gemm_acc(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                     const float* B, int64_t ldb, double* D, int64_t ldd, float* tmp,
                     int64_t chain) {
  for (int64_t k0 = 0; k0 < K; k0 += chain) {
    gemm(M, N, K - k0 < chain ? K - k0 : chain, A + k0 * sak, sam, sak, B + k0 * ldb, ldb, tmp, N);
    for (int64_t m = 0; m < M; ++m) add_f64(D + m * ldd, tmp + m * N, N);
  }
}

// The backward's dP[M×N] (double, ld ldc) = dO[M×K]·Vᵀ[K×N] from the double copies (a64, ld K;
// b64, ld ldb): products exact, sums in double, for every tile (the float copies and `exact`
// are for ISAs with a faster form).
constexpr bool DP_FLOAT_CHAINS = false;  // gemm_dp is exact in every tile
static void gemm_dp(int64_t M, int64_t N, int64_t K, const float*, int64_t, const double* a64,
                    const float*, const double* b64, int64_t ldb, double* C, int64_t ldc, bool) {
  gemm64(M, N, K, a64, K, 1, b64, ldb, C, ldc);
}
