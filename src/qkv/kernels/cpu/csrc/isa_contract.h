// The ISA contract: every name the kernel (kernel.h and the headers it includes) is written
// against that an instruction-set path provides. A path is a SIMD layer (simd_avx512.h for the
// avx512 and amx paths, simd_avx2.h, simd_portable.h) and a tile layer (tiles_amx.h, or
// tiles_none.h on every path without a tile unit), both included by isa_unit.h inside the path's
// namespace before kernel.h, which includes this file first: each name below must be declared
// there with exactly this type, or the path does not compile. A new path writes these and
// nothing else.
//
// Bits: within a path, whatever computes a score computes it alike in the forward and the
// backward (the products' chains below are fixed by the path, never by a call's sizes); across
// paths the AVX ones give the same bits (the same chains and the same exp), portable its own.

template <class A, class B>
struct contract_same {
  static constexpr bool value = false;
};
template <class A>
struct contract_same<A, A> {
  static constexpr bool value = true;
};
#define QKV_PROVIDES(name, ...)                                            \
  static_assert(contract_same<decltype(&name), __VA_ARGS__>::value,        \
                "an ISA path provides " #name " as " #__VA_ARGS__)
#define QKV_CONSTANT(name, type)                                           \
  static_assert(contract_same<decltype(name), const type>::value,          \
                "an ISA path provides the constant " #name " of type " #type)

// ------------------------------------------------------------------------- the SIMD layer
//
// V16: 16 float lanes, the unit of the elementwise passes (a 64-key tile row is 4 of them);
// M16: a mask of 16 lanes; U16: 16 uint32 lanes (the dropout hash).
static_assert(sizeof(V16) >= 64 && sizeof(U16) >= 64 && sizeof(M16) > 0, "V16, M16, U16");

// a·b + c exactly as gemm's micro-kernel forms it (fused where gemm fuses)
QKV_PROVIDES(madd, float (*)(float, float, float));
// 16 floats from / to p (unaligned); v_stream: a non-temporal store to p aligned to
// STREAM_ALIGN bytes, ordered by stream_fence() before the call returns
QKV_PROVIDES(v_load, V16 (*)(const float*));
QKV_PROVIDES(v_store, void (*)(float*, V16));
QKV_PROVIDES(v_stream, void (*)(float*, V16));
QKV_PROVIDES(stream_fence, void (*)());
QKV_CONSTANT(STREAM_ALIGN, int64_t);
// lane-wise arithmetic, each one IEEE operation (v_fma fused where madd is)
QKV_PROVIDES(v_set, V16 (*)(float));
QKV_PROVIDES(v_add, V16 (*)(V16, V16));
QKV_PROVIDES(v_sub, V16 (*)(V16, V16));
QKV_PROVIDES(v_mul, V16 (*)(V16, V16));
QKV_PROVIDES(v_div, V16 (*)(V16, V16));
QKV_PROVIDES(v_fma, V16 (*)(V16, V16, V16));
// max(a, b), the second operand when either is NaN (the x86 instructions' rule)
QKV_PROVIDES(v_max, V16 (*)(V16, V16));
// masks: lane i set where bit i is; a where set, else b; lanes x − x == 0 (finite); all set
QKV_PROVIDES(m_bits, M16 (*)(uint32_t));
QKV_PROVIDES(v_select, V16 (*)(M16, V16, V16));
QKV_PROVIDES(v_finite, M16 (*)(V16));
QKV_PROVIDES(m_all, bool (*)(M16));
// horizontal max and sum (the sum's order fixed per path); whether some lane exceeds b (a NaN
// lane does not)
QKV_PROVIDES(v_hmax, float (*)(V16));
QKV_PROVIDES(v_hsum, float (*)(V16));
QKV_PROVIDES(v_any_gt, bool (*)(V16, float));
// float(|base − lane|) for lanes 0 … 15 (ALiBi's distance)
QKV_PROVIDES(v_absdist, V16 (*)(int32_t));
// exp(x) for the softmax's x ≤ 0 (small positive x fine), 0 below −87.34, NaN for NaN; tanh in
// double rounded once to float (the softcap)
QKV_PROVIDES(v_exp, V16 (*)(V16));
QKV_PROVIDES(v_tanh, V16 (*)(V16));
// float(double(x) · s); float((keep ? x·mul : 0) − s) for 16 doubles x (the backward's dP − Δ):
// one rounding each
QKV_PROVIDES(v_mul_f64, V16 (*)(V16, double));
QKV_PROVIDES(v_dsub, V16 (*)(const double*, double, double, M16));
// the dropout hash on 16 lanes: load, x ^ s, qkv.dropout's mix, unsigned x ≥ t
QKV_PROVIDES(u_load, U16 (*)(const uint32_t*));
QKV_PROVIDES(u_xor, U16 (*)(U16, uint32_t));
QKV_PROVIDES(u_mix, U16 (*)(U16));
QKV_PROVIDES(u_ge, M16 (*)(U16, uint32_t));
// the first values of a bfloat16 / float16 row as floats: returns how many it converted (the
// caller converts the rest)
QKV_PROVIDES(cvt_bf16, int64_t (*)(const uint16_t*, float*, int64_t));
QKV_PROVIDES(cvt_f16, int64_t (*)(const uint16_t*, float*, int64_t));
// dst[c·ldd + r] = src[r·lds + c] for a 16 × 16 block
QKV_PROVIDES(transpose16, void (*)(const float*, int64_t, float*, int64_t));

// The products. A's element (m, k) is A[m·sam + k·sak] (Aᵀ by swapping the strides; sak = 1
// where only sam is given), B's row k starts at B + k·ldb; N a multiple of 16. Every element
// is the same chain of operations whatever M, N and the element's place, so a score, a weight
// or a gradient has the same bits from any call (the forward and the backward rely on it).
//
// gemm: C[M×N] = A·B in float, each element the sequential sum over k of madd, from 0.
QKV_PROVIDES(gemm, void (*)(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                            const float*, int64_t, float*, int64_t));
// gemm_chain: C = float(scale · Σ_c chain_c), chain c the sequential fused sum from 0 of the
// products of its SCORE_CHAIN values of k, widened to double and added in order (the precise
// scores). With D (double, ld ldc) instead of C: D = D·alpha[m] + the sum of one chain, row m
// (the forward's P·V, K ≤ PV_CHAIN). D and alpha default to null.
QKV_PROVIDES(gemm_chain, void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                                  int64_t, float*, int64_t, double, double*, const double*));
// keys per float chain of the forward's P·V
QKV_CONSTANT(PV_CHAIN, int64_t);
// acc[0 … n) = acc·alpha + Σ_c x[c·stride + i] over n_chains float partials, in double (P·V
// where V is not finite: the chains of gemm_chain's D form, from a zero-skipping product)
QKV_PROVIDES(acc_chains, void (*)(double*, const float*, int64_t, int64_t, double, int64_t));
// gemm_acc: D[m·ldd + n] += Σ_c double(chain_c), chain c the float sum (gemm's chain) of `chain`
// terms (ACC_CHAIN, or one chain per call for 16-bit inputs), in order of c; tmp (M × N floats)
// for a path that needs it. The backward's dV, dK and dQ.
QKV_PROVIDES(gemm_acc, void (*)(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                                const float*, int64_t, double*, int64_t, float*, int64_t));
QKV_CONSTANT(ACC_CHAIN, int64_t);
// gemm_dp: the backward's dP[M×N] (double, ld ldc) = dO[M×K]·Vᵀ[K×N]: with `exact` (or where
// DP_FLOAT_CHAINS is false, always) from the double copies a64 (ld K) and b64 (ld ldb), every
// product exact and every sum in double; else gemm_chain's chains over the float copies (a, ld
// lda; b, ld ldb), neither scaled nor rounded.
QKV_PROVIDES(gemm_dp, void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const double*,
                               const float*, const double*, int64_t, double*, int64_t, bool));
QKV_CONSTANT(DP_FLOAT_CHAINS, bool);
// out[r·lds] = float(scale · Σ_d q[r][d]·k[d]) for rows r < M against one key row of n values:
// dot_rows64 from double rows q (the products exact, the sums in double; out_lo the low part,
// score_lo), dot_rows32 in float (decoding; rows whose scores are formed exactly)
QKV_PROVIDES(dot_rows64, void (*)(const double*, int64_t, int64_t, const float*, int64_t, float*,
                                  float*, int64_t, double));
QKV_PROVIDES(dot_rows32, void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*,
                                  int64_t, float));

// ------------------------------------------------------------------------- the tile layer
//
// TILE_BF16: the products of bfloat16 inputs may run on a tile unit (scores at most TILE_K_MAX
// deep, P·V and the backward's products with rows at most TILE_PV_N wide); TILE_F32: the precise
// scores of float32 inputs may, in three bfloat16 parts per value. Where they are false the
// functions are never called. tiles_amx.h says what each one computes.
QKV_CONSTANT(TILE_BF16, bool);
QKV_CONSTANT(TILE_K_MAX, int64_t);
QKV_CONSTANT(TILE_PV_N, int64_t);
QKV_CONSTANT(TILE_F32, bool);
// bfloat16: the scores (rows packed once per item, or here), P·V, and the backward's products
QKV_PROVIDES(tile_gemm, bool (*)(int64_t, int64_t, int64_t, const float*, int64_t, const uint16_t*,
                                 const float*, int64_t, const uint32_t*, float*, int64_t));
QKV_PROVIDES(tile_b_elems, int64_t (*)(int64_t, int64_t));
QKV_PROVIDES(pack_b_blocks, void (*)(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*));
QKV_PROVIDES(tile_a_elems, int64_t (*)(int64_t, int64_t));
QKV_PROVIDES(tile_pack_rows, void (*)(int64_t, int64_t, const float*, int64_t, uint16_t*, float));
QKV_PROVIDES(tile_put_p, void (*)(V16, V16, uint16_t*, int64_t, int64_t));
QKV_PROVIDES(tile_put_pair, void (*)(const V16*, const V16*, int64_t, uint32_t*));
QKV_PROVIDES(tile_pv, void (*)(int64_t, int64_t, int64_t, const uint16_t*, const float*, int64_t,
                               const uint32_t*, float*, int64_t, const double*));
QKV_PROVIDES(tile_pack_a, void (*)(int64_t, int64_t, const float*, int64_t, uint16_t*));
QKV_PROVIDES(tile_acc, void (*)(int64_t, int64_t, int64_t, const uint16_t*, const uint32_t*,
                                float*, int64_t));
// float32 scores: the rows' and the keys' parts, and their chains (gemm_chain's arithmetic)
QKV_PROVIDES(tile_a3_elems, int64_t (*)(int64_t, int64_t));
QKV_PROVIDES(tile_pack_rows3, void (*)(int64_t, int64_t, const float*, int64_t, uint16_t*, int8_t*,
                                       float));
QKV_PROVIDES(tile_scale_folds, bool (*)(float));
QKV_PROVIDES(tile_b3_elems, int64_t (*)(int64_t));
QKV_PROVIDES(tile_pack_keys3, uint64_t (*)(int64_t, const float*, int64_t, uint32_t*));
QKV_PROVIDES(tile_chain3, void (*)(int64_t, int64_t, int64_t, const uint16_t*, const uint32_t*,
                                   int64_t, float*, int64_t, double, bool));
QKV_PROVIDES(tile_chain3_f64, void (*)(int64_t, int64_t, const uint16_t*, const uint32_t*, double*,
                                       int64_t));

#undef QKV_PROVIDES
#undef QKV_CONSTANT
