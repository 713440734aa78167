// The scores of a tile, which the forward and the backward compute alike (the same bits): the
// products, the modifiers (ALiBi, softcap) and the mask, the rows formed exactly, and exp.
// Part of kernel.h (compiled once per ISA).

// t = mods(s) for scaled scores s of keys c0 … c0+63 of a row at position qpos, −inf where `allowed` has no
// bit. With dfac, also dt/dx (softcap: 1 − tanh², else 1). The forward and the backward both
// call this on the same gemm output, so they see the same t.
static inline void row_scores(const Mods& md, float slope, int64_t qpos, int64_t c0,
                              uint64_t allowed, const float* s, float* t, float* dfac) {
  const bool cap = md.cap != 0.0f;
  if (!cap && slope == 0.0f && allowed == ~0ull && s == t) return;  // t = s already
  for (int64_t q = 0; q < 4; ++q) {
    V16 x = v_load(s + 16 * q);
    V16 bias = v_set(0.0f);
    if (slope != 0.0f) bias = v_mul(v_set(slope), v_absdist((int32_t)(qpos - c0 - 16 * q)));
    if (slope != 0.0f && !md.alibi_after_cap) x = v_sub(x, bias);
    if (cap) {
      const V16 th = v_tanh(v_div(x, v_set(md.cap)));
      x = v_mul(th, v_set(md.cap));
      if (dfac) v_store(dfac + 16 * q, v_sub(v_set(1.0f), v_mul(th, th)));
    }
    if (slope != 0.0f && md.alibi_after_cap) x = v_sub(x, bias);
    const uint32_t w = (uint32_t)(allowed >> (16 * q)) & 0xFFFFu;
    if (w != 0xFFFFu) x = v_select(m_bits(w), x, v_set(NEG_INF));
    v_store(t + 16 * q, x);
  }
}

// Decoding (float32, K and V read in place) streams each K/V row once with little work per
// byte; the scores' loop asks for K rows this far ahead and for the V row of the same key, which
// the P·V reads next. K and V read faster 48 rows ahead than 8 ahead or with no prefetch, close
// to a plain copy's rate (measured: docs/cpu.md, Measurements behind the code).
constexpr int64_t PREFETCH_ROWS = 48;

// s[M × N] (ld BK) = round(q · kt · scale) for rows R0 … R0+M−1 of w.q and key columns 16·lo …
// 16·lo + N − 1 of the packed transposed key tile w.kt, into the same places of w.s: every score
// the same bits whatever M, N and lo (each product promises it). Float32 scores on the tile unit
// (scores_on_tiles) take the rows' parts from w.tile.qa (packed once per forward item, else
// here) and the key tile's from w.tile.kb; rows and keys the split cannot carry get gemm_chain's
// bits instead.
static void block_scores(const Problem& P, StepBufs& w, int64_t R0, int64_t M, int64_t lo,
                         int64_t N) {
  const int64_t Dp = P.Dp;
  const float* q = w.q + R0 * Dp;
  const float* kt = w.kt + 16 * lo;
  float* s = w.s + R0 * BK + 16 * lo;
  if (P.precise_scores) {
    if (!scores_on_tiles(P)) {
      gemm_chain(M, N, P.D, q, Dp, kt, BK, s, BK, P.mods.scale64);
      return;
    }
    const bool folded = tile_scale_folds(P.mods.scale);
    if (!w.tile.qa_on)
      tile_pack_rows3(M, P.D, q, Dp, w.tile.qa, w.tile.qbad + R0, folded ? P.mods.scale : 1.0f);
    tile_chain3(M, N, P.D, w.tile.qa_on ? w.tile.qa + tile_a3_elems(R0, P.D) : w.tile.qa,
                w.tile.kb, lo, s, BK, P.mods.scale64, folded);
    for (int64_t r = 0; r < M; ++r)
      if (w.tile.qbad[R0 + r])
        gemm_chain(1, N, P.D, q + r * Dp, Dp, kt, BK, s + r * BK, BK, P.mods.scale64);
    const uint64_t cols = (w.tile.kbad >> (16 * lo)) & (N == BK ? ~0ull : ((1ull << N) - 1));
    for (int64_t c0 = 0; c0 < N; c0 += 16) {
      const uint64_t u = (cols >> c0) & 0xFFFFull;
      if (!u) continue;
      gemm_chain(M, 16, P.D, q, Dp, kt + c0, BK, w.o, 16, P.mods.scale64);
      for (int64_t c = 0; c < 16; ++c)
        if (u >> c & 1)
          for (int64_t r = 0; r < M; ++r) s[r * BK + c0 + c] = w.o[r * 16 + c];
    }
    return;
  }
  const uint16_t* qa = w.tile.qa_on ? w.tile.qa + tile_a_elems(R0, P.D) : nullptr;
  const uint32_t* kp = w.tile.kpairs ? w.tile.kpairs + lo * 256 : nullptr;  // block lo's pairs
  const bool tiles = on_tiles(P) && tile_gemm(M, N, P.D, q, Dp, qa, kt, BK, kp, s, BK);
  if (!tiles) gemm(M, N, P.D, q, Dp, 1, kt, BK, s, BK);
  if (tiles && w.tile.qa_scaled) return;  // the rows came scaled by a power of two: the same bits
  const V16 scale = v_set(P.mods.scale);
  for (int64_t R = 0; R < M; ++R)
    for (int64_t x = 0; x < N; x += 16) v_store(s + R * BK + x, v_mul(v_load(s + R * BK + x), scale));
}

// Scores of rows q (float, ldq) against the packed key tile: s = round(q·k · scale). For float32
// inputs at torch's default matmul precision (P.precise_scores; else one float gemm) the
// products are summed in float chains of SCORE_CHAIN (32; portable: CHAIN, 16) terms and the
// chains in double (gemm_chain), so a score carries the roundings of 32-term (16-term) sums where the
// float32 reference's carries its whole dot product's D (the same design as P·V's chains); for
// 16-bit inputs, whose outputs round to 16 bits, float sums suffice.
//
// Decoding (Nq·G ≤ 16 rows) takes the dot-product form instead: each score is summed over d in
// SIMD lanes straight from the key rows `krows` (no transposed tile; precise: products in
// double lanes, q64). Which form runs depends on the problem only, so the forward and the
// backward still compute the same bits.
static void tile_scores(const Problem& P, int64_t M, const float* q, const double* q64, int64_t ldq,
                        const float* krows, int64_t ldk, int64_t kw, StepBufs& w,
                        const float* vpre = nullptr, int64_t ldvp = 0) {
  if (P.dot_scores) {
    for (int64_t j = 0; j < kw; ++j) {
      if (vpre) {  // never faults, also past the last row
        const char* kn = (const char*)(krows + (j + PREFETCH_ROWS) * ldk);
        const char* vn = (const char*)(vpre + j * ldvp);
        for (int64_t x = 0; x < P.D * 4; x += 64) __builtin_prefetch(kn + x);
        for (int64_t x = 0; x < P.Dv * 4; x += 64) __builtin_prefetch(vn + x);
      }
      if (P.precise_scores)
        dot_rows64(q64, ldq, M, krows + j * ldk, P.D, w.s + j, w.slo + j, BK, P.mods.scale64);
      else
        dot_rows32(q, ldq, M, krows + j * ldk, P.D, w.s + j, BK, P.mods.scale);
    }
    for (int64_t R = 0; R < M; ++R)
      for (int64_t j = kw; j < BK; ++j) w.s[R * BK + j] = w.slo[R * BK + j] = 0.0f;
    return;
  }
  block_scores(P, w, 0, M, 0, BK);
}

// exp(s − m) for scores 16q … 16q+15 of a row. With the scores' low parts (lorow: the row of
// w.slo, where the problem uses them; null unless P.score_lo): x = (s − m) + s_lo, rounded to
// float, and exp(x) · (1 + r) with r that rounding, exactly (s − m is exact near the row's
// maximum and |s_lo| ≤ half an ulp of s, so r = s_lo − (x − (s − m))): a weight then carries
// about a float rounding of itself, not one of its logit (x ≈ 10 rounds by 5e-7). r is 0 where
// it is not finite (masked scores, −inf). Low parts of 2 or more (scores beyond 2²⁵, whose float
// spacing is 4 or more) are read as 0: there e^(s_lo) at the row's maximum would overflow the
// weights (found with keys scaled by 1e10), and scores that far apart make the row one-hot with or
// without them (a low part times 2¹²⁷ is finite below 2).
static inline V16 exp_scores(const float* srow, const float* lorow, int64_t q, V16 mv) {
  const V16 d = v_sub(v_load(srow + 16 * q), mv);
  if (!lorow) return v_exp(d);
  V16 lo = v_load(lorow + 16 * q);
  lo = v_select(v_finite(v_mul(lo, v_set(0x1p127f))), lo, v_set(0.0f));
  const V16 x = v_add(d, lo);
  V16 r = v_sub(lo, v_sub(x, d));
  r = v_select(v_finite(r), r, v_set(0.0f));
  const V16 e = v_exp(x);
  return v_fma(e, r, e);
}

// load row n of q (b, h) into q[·] and, for precise scores, its norm *qn (and q64[·] for
// decoding's dot products)
// |q| of a row of Dp floats
static inline double row_norm(const Problem& P, const float* q) {
  V16 ss = v_set(0.0f);
  for (int64_t d = 0; d < P.Dp; d += 16) ss = v_fma(v_load(q + d), v_load(q + d), ss);
  return __builtin_sqrt((double)v_hsum(ss));
}

static inline void load_q(const Problem& P, int64_t b, int64_t h, int64_t n, float* q, double* q64,
                          double* qn) {
  load_row(row_of(P.q, P.dtype, b, h, n), P.dtype, P.D, P.Dp, q);
  if (!P.precise_scores) return;
  if (P.dot_scores)
    for (int64_t d = 0; d < P.Dp; ++d) q64[d] = (double)q[d];
  *qn = row_norm(P, q);
}

// Precise scores whose products are large lose, in the float chains, more than the float32
// reference loses in its own sums: at |q|·|k|·scale in the hundreds (logits of that size) the
// chains' roundings (of partial sums of that size) move a weight P by more than the rule
// allows, and dS = P ∘ (dP − Δ) amplifies them in peaked rows (docs/cpu.md, Accuracy). Rows
// with |q| · max_j |k_j| · scale above this bound get the tile's scores formed exactly
// instead: each a dot product in double (dot_rows64), kept as its float rounding and low part.
// Random normal q, k (|q|·|k|·scale ≈ 10 at D = 64) stay far below it.
constexpr double EXACT_BOUND = 32.0;

// After a tile's scores of M rows (w.q, w.qn: the rows and their norms; w.kmax: the key tile's):
// mark the rows whose scores are formed exactly (every row when decoding: its dot products are
// exact; see EXACT_BOUND otherwise) and form those rows' scores from the key rows krows (ld ldk)
// with their low parts. The forward and the backward mark the same rows (the same q, and K
// read alike).
static void exact_rows(const Problem& P, int64_t M, const float* krows, int64_t ldk, int64_t kw,
                       StepBufs& w) {
  if (!P.precise_scores) return;
  if (P.dot_scores) {
    for (int64_t r = 0; r < M; ++r) w.exact[r] = 1;
    return;
  }
  const double bound = EXACT_BOUND / (w.kmax * P.mods.scale64);
  for (int64_t r = 0; r < M; ++r) {
    w.exact[r] = w.qn[r] > bound;
    if (w.exact[r])
      for (int64_t d = 0; d < P.Dp; ++d) w.q64[r * P.Dp + d] = (double)w.q[r * P.Dp + d];
  }
  for (int64_t r0 = 0; r0 < M;) {
    if (!w.exact[r0]) {
      ++r0;
      continue;
    }
    int64_t r1 = r0 + 1;
    while (r1 < M && w.exact[r1]) ++r1;
    for (int64_t j = 0; j < kw; ++j)
      dot_rows64(w.q64 + r0 * P.Dp, P.Dp, r1 - r0, krows + j * ldk, P.D, w.s + r0 * BK + j,
                 w.slo + r0 * BK + j, BK, P.mods.scale64);
    r0 = r1;
  }
}

// row r's low parts of its scores where exp_scores reads them (exact rows, no modifiers), or null
static inline const float* lo_row(const Problem& P, const StepBufs& w, int64_t r) {
  return P.score_lo && w.exact[r] ? w.slo + r * BK : nullptr;
}
