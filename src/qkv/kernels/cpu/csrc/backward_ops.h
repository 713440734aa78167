// The backward's accumulating product built from an ISA's gemm and add_f64 (included at the end
// of simd_avx512.h and simd_portable.h; simd_avx2.h has a fused form with the same contract and
// the same bits).

// D[m·ldd + n] += double(float Σ_k A[m·sam + k·sak]·B[k·ldb + n]): gemm's float sum into tmp
// (M × N floats), widened and added row by row. N a multiple of 16.
static void gemm_acc(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                     const float* B, int64_t ldb, double* D, int64_t ldd, float* tmp) {
  gemm(M, N, K, A, sam, sak, B, ldb, tmp, N);
  for (int64_t m = 0; m < M; ++m) add_f64(D + m * ldd, tmp + m * N, N);
}

