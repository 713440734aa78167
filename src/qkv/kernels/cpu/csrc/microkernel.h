// The register-blocked micro-kernel, once for every path and precision, over a vector-traits
// type VT that each SIMD layer declares with QKV_VECTOR_TRAITS before including this file:
//
//     VT::T      the element (float, double);  VT::V  a register of VT::W of them
//     VT::zero() VT::load(p) VT::bcast(p)      0; W values from p; *p in every lane
//     VT::fma(a, b, c)                         a·b + c, fused where the path fuses (madd)
//     VT::store(p, x)
//
// An element of a product is one chain: the sequential sum over k of fma(a, b, ·), from 0, in
// order, whatever the blocking (so the same (m, n) gets the same bits from any call). The SIMD
// layers build their gemm and gemm64 on gemm_blocks (each a noinline function: out of line, as
// the compiler kept the hand-written copies this replaced), and the chained products of
// gemm_chain and gemm_acc (which widen the chains to double in their own registers) on
// chain_block.

#define QKV_ALWAYS_INLINE inline __attribute__((always_inline))

// A traits type: NAME with element TYPE in registers VEC of LANES, and the path's operations as
// expressions of their arguments (p the pointer, a, b, c and x the registers): ZERO, LOAD of p,
// BCAST of p (*p in every lane), FMA of a, b, c, STORE of x at p.
#define QKV_VECTOR_TRAITS(NAME, TYPE, VEC, LANES, ZERO, LOAD, BCAST, FMA, STORE) \
  struct NAME {                                                                  \
    using T = TYPE;                                                              \
    using V = VEC;                                                               \
    static constexpr int W = LANES;                                              \
    static QKV_ALWAYS_INLINE V zero() { return ZERO; }                           \
    static QKV_ALWAYS_INLINE V load(const T* p) { return LOAD; }                 \
    static QKV_ALWAYS_INLINE V bcast(const T* p) { return BCAST; }               \
    static QKV_ALWAYS_INLINE V fma(V a, V b, V c) { return FMA; }                \
    static QKV_ALWAYS_INLINE void store(T* p, V x) { STORE; }                    \
  }

// One step k of the chains: p[m][v] += A[m·sam + k·sak] · B[k·ldb + W·v …]
template <class VT, int MR, int NV>
static QKV_ALWAYS_INLINE void chain_step(int64_t k, const typename VT::T* A, int64_t sam,
                                         int64_t sak, const typename VT::T* B, int64_t ldb,
                                         typename VT::V (&p)[MR][NV]) {
  const typename VT::T* b = B + k * ldb;
  const typename VT::T* a = A + k * sak;
  typename VT::V bv[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) bv[v] = VT::load(b + VT::W * v);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const typename VT::V av = VT::bcast(a + m * sam);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) p[m][v] = VT::fma(av, bv[v], p[m][v]);
  }
}

// p[m][v] = Σ_{k0 ≤ k < k1} A[m·sam + k·sak] · B[k·ldb + W·v …], fused, from 0, in order: the
// chain every micro-kernel forms, MR rows × NV registers held in registers. UNROLL_K unrolls
// the k loop by 8 (the AVX2 chained products: a 16-trip loop's exit cost a mispredict).
template <class VT, int MR, int NV, bool UNROLL_K = false>
static QKV_ALWAYS_INLINE void chain_block(int64_t k0, int64_t k1, const typename VT::T* A,
                                          int64_t sam, int64_t sak, const typename VT::T* B,
                                          int64_t ldb, typename VT::V (&p)[MR][NV]) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) p[m][v] = VT::zero();
  if constexpr (UNROLL_K) {
#pragma GCC unroll 8
    for (int64_t k = k0; k < k1; ++k) chain_step<VT, MR, NV>(k, A, sam, sak, B, ldb, p);
  } else {
    for (int64_t k = k0; k < k1; ++k) chain_step<VT, MR, NV>(k, A, sam, sak, B, ldb, p);
  }
}

// C[MR × W·NV] (ld ldc) = A·B over K: one block of chains, stored
template <class VT, int MR, int NV>
static inline void micro(int64_t K, const typename VT::T* A, int64_t sam, int64_t sak,
                         const typename VT::T* B, int64_t ldb, typename VT::T* C, int64_t ldc) {
  typename VT::V c[MR][NV];
  chain_block<VT, MR, NV>(0, K, A, sam, sak, B, ldb, c);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) VT::store(C + m * ldc + VT::W * v, c[m][v]);
}

// micro for a row count mr known at run time, 1 … MR (MR 4 or 6; more reads as MR)
template <class VT, int MR, int NV>
static inline void micro_rows(int64_t mr, int64_t K, const typename VT::T* A, int64_t sam,
                              int64_t sak, const typename VT::T* B, int64_t ldb,
                              typename VT::T* C, int64_t ldc) {
  static_assert(MR == 4 || MR == 6, "micro_rows: blocks of 4 or 6 rows");
  switch (mr) {
    case 1: micro<VT, 1, NV>(K, A, sam, sak, B, ldb, C, ldc); break;
    case 2: micro<VT, 2, NV>(K, A, sam, sak, B, ldb, C, ldc); break;
    case 3: micro<VT, 3, NV>(K, A, sam, sak, B, ldb, C, ldc); break;
    case 4:
      if constexpr (MR > 4) {
        micro<VT, 4, NV>(K, A, sam, sak, B, ldb, C, ldc);
        break;
      }
      [[fallthrough]];
    case 5:
      if constexpr (MR > 5) {
        micro<VT, 5, NV>(K, A, sam, sak, B, ldb, C, ldc);
        break;
      }
      [[fallthrough]];
    default: micro<VT, MR, NV>(K, A, sam, sak, B, ldb, C, ldc); break;
  }
}

// C[M×N] = A[M×K] · B[K×N] (A's element (m, k) at A[m·sam + k·sak], B's row k at B + k·ldb) by
// blocks of MR rows × NV registers. N is a multiple of 64 bytes of elements (16 floats, 8
// doubles): where that is a whole block every block is whole, else the last one of a row of
// blocks may be narrower (NV 4).
template <class VT, int MR, int NV>
static QKV_ALWAYS_INLINE void gemm_blocks(int64_t M, int64_t N, int64_t K,
                                          const typename VT::T* A, int64_t sam, int64_t sak,
                                          const typename VT::T* B, int64_t ldb,
                                          typename VT::T* C, int64_t ldc) {
  constexpr bool whole = NV * VT::W * (int)sizeof(typename VT::T) == 64;
  static_assert(whole || NV == 4, "gemm_blocks: whole blocks, or blocks of 4 registers");
  for (int64_t n0 = 0; n0 < N; n0 += NV * VT::W) {
    const int64_t nv = (N - n0) / VT::W < NV ? (N - n0) / VT::W : NV;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = M - m0 < MR ? M - m0 : MR;
      const typename VT::T* a = A + m0 * sam;
      typename VT::T* c = C + m0 * ldc + n0;
      if constexpr (whole) {
        micro_rows<VT, MR, NV>(mr, K, a, sam, sak, B + n0, ldb, c, ldc);
        continue;
      }
      switch (nv) {
        case 1: micro_rows<VT, MR, 1>(mr, K, a, sam, sak, B + n0, ldb, c, ldc); break;
        case 2: micro_rows<VT, MR, 2>(mr, K, a, sam, sak, B + n0, ldb, c, ldc); break;
        case 3: micro_rows<VT, MR, 3>(mr, K, a, sam, sak, B + n0, ldb, c, ldc); break;
        default: micro_rows<VT, MR, 4>(mr, K, a, sam, sak, B + n0, ldb, c, ldc); break;
      }
    }
  }
}
