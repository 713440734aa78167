// The backward: the row pass (delta_item: Δ of every row) and the column pass (bwd_item: dV, dK
// and dQ over chunks of key-tile columns). Part of kernel.h (compiled once per ISA).

// D[m·ldd + n] += Σ_k A[m·sam + k·sak] · B[k·ldb + n] with every product (of two floats: exact)
// and every sum in double: the backward's accumulations of small gradients (exact_sums in
// ops.cpp), in place of gemm_acc's float chains.
static void gemm_acc_f64(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                         int64_t sak, const float* B, int64_t ldb, double* D, int64_t ldd) {
  for (int64_t m = 0; m < M; ++m) {
    double* d = D + m * ldd;
    for (int64_t k = 0; k < K; ++k) {
      const double a = (double)A[m * sam + k * sak];
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) d[n] += a * (double)b[n];
    }
  }
}

static void write_dq(const Problem& P, int64_t b, int64_t hkv, int64_t g0, int64_t g1, int64_t r0,
                     int64_t nr, const double* acc, float* tmp) {
  const int64_t bq = P.lay.bq, Dp = P.Dp;
  const double scale = P.mods.scale64;
  const int64_t es = elem_size(P.dtype);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t h = hkv * P.G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const double* a = acc + ((g - g0) * bq + r) * Dp;
      for (int64_t d = 0; d < P.D; ++d) tmp[d] = (float)(a[d] * scale);
      store_row((char*)P.dq + (((b * P.H + h) * P.Nq + r0 + r) * P.D) * es, P.dtype, tmp, P.D);
    }
  }
}

// the dQ of heads g0 … g1 − 1 of touched entry t is complete for this chunk: write it, or store
// it as this chunk's partial and, if it is the last one (of every chunk and pass), sum all
// partials in chunk order and write that
static void flush_dq(const Problem& P, const BwdPlan& Bp, int64_t b, int64_t hkv, int64_t t,
                     int64_t g0, int64_t g1, const double* acc, BwdBufs& w) {
  const int64_t bq = P.lay.bq, i = Bp.t_tile[t], r0 = tile_r0(P, i), nr = tile_nr(P, i);
  const int64_t head = bq * P.Dp, tile = P.G * head;
  if (Bp.t_slot[t] < 0) {
    write_dq(P, b, hkv, g0, g1, r0, nr, acc, w.tmp);
    return;
  }
  double* dst = Bp.store + ((Bp.t_slot[t] * P.B + b) * P.Hkv + hkv) * tile;
  __builtin_memcpy(dst + g0 * head, acc, (size_t)((g1 - g0) * head) * 8);
  const int64_t key = (b * P.Hkv + hkv) * P.lay.nqb + i;
  const int64_t passes = (P.G + Bp.heads - 1) / Bp.heads;
  const int64_t n = (Bp.q_ptr[i + 1] - Bp.q_ptr[i]) * passes;
  if (__atomic_fetch_add(&Bp.done[key], 1, __ATOMIC_ACQ_REL) + 1 != n) return;
  double* sum = w.dq_sum;
  __builtin_memset(sum, 0, (size_t)tile * 8);
  for (int64_t s = Bp.q_ptr[i]; s < Bp.q_ptr[i + 1]; ++s) {
    const double* part = Bp.store + ((Bp.q_slots[s] * P.B + b) * P.Hkv + hkv) * tile;
    for (int64_t x = 0; x < tile; ++x) sum[x] += part[x];
  }
  write_dq(P, b, hkv, 0, P.G, r0, nr, sum, w.tmp);
}

// Row r of a tile, query row r0 + r of head h, as the backward reads it: q, dO (in double only
// where dP needs it, dp_operands), 1/l, m, the ALiBi slope, the position, the mask-bit offset,
// the dropout hash. The column pass (bwd_item) and the row pass (delta_item) both load rows with
// it, so the row pass recomputes P and dP from the very same inputs.
static inline void bwd_row(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t r, BwdBufs& w,
                           bool rows_in_place = false) {
  const Layout& L = P.lay;
  const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
  if (rows_in_place) {  // w.q and w.dO point at the tensors' rows: the norm only
    w.qn[r] = row_norm(P, w.q + r * P.Dp);
  } else {
    load_q(P, b, h, r0 + r, w.q + r * P.Dp, w.q64 + r * P.Dp, w.qn + r);
    load_row(row_of(P.dout, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.dO + r * P.Dvp);
  }
  const double lr = P.l[idx];
  w.inv_l[r] = lr > 0.0 ? 1.0 / lr : 0.0;
  w.mrow[r] = P.m[idx];
  w.slope[r] = P.mods.slopes ? P.mods.slopes[h] : 0.0f;
  w.qpos[r] = r0 + r + P.Nk - P.Nq;
  w.bitoff[r] = ((L.bm > 1 ? b : 0) * L.hm + (L.hm > 1 ? h : 0)) * L.bq + r;
  if (P.drop.on) w.rowh[r] = drop_row_hash(P.drop, b * P.H + h, r0 + r);
}

// dP's operands in double, where gemm_dp takes its exact form (`exact`: a query tile holding a
// peaked row; every tile where the ISA has no float form, DP_FLOAT_CHAINS): the packed column's
// Vᵀ once per column (vt_ready) and the nr dO rows of the tile.
static inline void dp_operands(const Problem& P, int64_t nr, bool& vt_ready, BwdBufs& w) {
  if (!vt_ready) {
    for (int64_t x = 0; x < P.Dv * BK; ++x) w.vt64[x] = (double)w.vt[x];
    vt_ready = true;
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t d = 0; d < P.Dv; ++d) w.dO64[r * P.Dv + d] = (double)w.dO[r * P.Dvp + d];
}

// The backward's float chains for dQ, dK and dV: ACC_CHAIN terms for float32 inputs (docs/cpu.md,
// Accuracy: one float sum over a tile's rows broke the rule); for 16-bit inputs, whose gradients
// round to 16 bits, one chain per tile (≤ 256 terms, a float rounding of ≤ 256·2⁻²⁴ against
// bf16's 2⁻⁹), summed in double across tiles, as their scores and P·V are plain float sums.
constexpr int64_t ONE_CHAIN = int64_t(1) << 40;

static bool bwd_item(const Problem& P, const BwdPlan& Bp, const BwdItem& it, BwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t acc_chain = P.dtype == DT_F32 ? ACC_CHAIN : ONE_CHAIN;
  const int64_t G = P.G, bq = L.bq, b = it.b, hkv = it.hkv, c = it.c;
  const int64_t Dp = P.Dp, Dvp = P.Dvp, code_stride = L.bm * L.hm * bq;
  const int64_t j0 = Bp.chunk_j[c], j1 = Bp.chunk_j[c + 1], t0 = Bp.chunk_t[c], t1 = Bp.chunk_t[c + 1];
  // heads g0 … g1 − 1 per pass over the chunk; dK_j, dV_j of its columns kept between passes
  const int64_t gs = Bp.heads, tile = gs * bq * Dp, live = Bp.chunk_live[c];
  const int64_t kvs = BK * (Dp + Dvp), kv_need = gs < G ? (j1 - j0) * kvs : 0;
  const int64_t qpe = scores_on_tiles(P) ? tile_a3_elems(bq, P.D) : 0;  // one entry's parts
  const int64_t dpe = w.f32.vb3 ? tile_a3_elems(bq, P.Dv) : 0;          // … of dO's rows
  if (!bwd_reserve(w, kv_need, live, tile, gs, qpe, dpe, bq, t1 - t0)) return false;
  const double scale = P.mods.scale64;
  const bool cap = P.mods.cap != 0.0f;
  const V16 keep_scale = v_set(P.drop.keep_scale), zero = v_set(0.0f);
  const double drop_mul = P.drop.on ? (double)P.drop.keep_scale : 1.0;
  const int64_t es = elem_size(P.dtype);
  bool vt_ready = false;
  float* const qbuf = w.q;
  float* const dobuf = w.dO;
  const bool rows_in_place = P.dtype == DT_F32 && P.precise_scores && !P.dot_scores &&
                             P.D == P.Dp && P.Dv == P.Dvp && P.q.sn == P.Dp && P.dout.sn == P.Dvp;
  for (int64_t g0 = 0; g0 < G; g0 += gs) {
  const int64_t g1 = imin(G, g0 + gs);
  int64_t n_free = live;
  for (int64_t s = 0; s < live; ++s) w.free_slots[s] = (int32_t)(live - 1 - s);
  int64_t next_first = t0, next_flush = 0;
  for (int64_t j = j0; j < j1; ++j) {
    while (next_first < t1 && Bp.t_first[next_first] == j) {
      const int32_t s = w.free_slots[--n_free];
      w.slot_of[next_first - t0] = s;
      __builtin_memset(w.pool + s * tile, 0, (size_t)tile * 8);
      if (qpe) {
        __builtin_memset(w.f32.qc.state + s * gs, PARTS_EMPTY, (size_t)gs);
        __builtin_memset(w.f32.dc.state + s * gs, PARTS_EMPTY, (size_t)gs);
      }
      ++next_first;
    }
    const int64_t e0 = L.col_ptr[j], e1 = L.col_ptr[j + 1];
    const int64_t c0 = tile_c0(P, j), kw = tile_kw(P, j);
    const uint64_t edge = kw == BK ? ~0ull : ((1ull << kw) - 1);
    double* const dk64 = gs < G ? w.dkv + (j - j0) * kvs : w.dk64;
    double* const dv64 = gs < G ? dk64 + BK * Dp : w.dv64;
    if (e1 > e0) {
      bwd_pack(P, b, hkv, c0, kw, w);
      vt_ready = false;
      if (g0 == 0) {
        __builtin_memset(dk64, 0, (size_t)(BK * Dp) * 8);
        __builtin_memset(dv64, 0, (size_t)(BK * Dvp) * 8);
      }
    }
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = L.row_idx[e], code = L.code_t[e], r0 = tile_r0(P, i), nr = tile_nr(P, i);
      const bool exact = P.peaked[(b * P.Hkv + hkv) * L.nqb + i];  // dP exact (gemm_dp)
      double* qacc = w.pool + w.slot_of[Bp.local[e]] * tile;
      // float32 rows of Q and dO as the products read them (ld Dp, Dvp) already: read in place,
      // not copied per (column, query tile); not the last query tile, so that reads a vector
      // past a tile's last row stay inside the tensor
      const bool in_place = rows_in_place && i + 1 < L.nqb;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t h = hkv * G + g;
        w.q = in_place ? (float*)row_of(P.q, P.dtype, b, h, r0) : qbuf;
        w.dO = in_place ? (float*)row_of(P.dout, P.dtype, b, h, r0) : dobuf;
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
          bwd_row(P, b, h, r0, r, w, in_place);
          w.delta[r] = P.delta[idx];  // the row pass's Δ (delta_item)
        }
        const int64_t ci = qpe ? w.slot_of[Bp.local[e]] * gs + g - g0 : 0;  // the caches' entry
        if (qpe) {  // the rows' parts, for the scores
          parts_of(w.f32.qc, ci, qpe, bq, nr, P.D, w.q, Dp, tile_scale_folds(P.mods.scale) ? P.mods.scale : 1.0f);
          w.tile.qa = w.f32.qc.parts + ci * qpe;
          w.tile.qbad = w.f32.qc.bad + ci * bq;
          w.tile.qa_on = true;
        }
        tile_scores(P, nr, w.q, w.q64, Dp, w.kr, Dp, kw, w);
        exact_rows(P, nr, w.kr, Dp, kw, w);
        if (exact || !DP_FLOAT_CHAINS) dp_operands(P, nr, vt_ready, w);
        // float32 on the tiles: dO Vᵀ as the scores are formed (dO's rows' parts against the V
        // tile's), gemm_dp's float chains, unless the split cannot carry some value of either;
        // bfloat16: dO Vᵀ on the tiles (one float chain over Dv, widened); else gemm_dp
        if (!exact && dpe && w.f32.vbad == 0 && parts_of(w.f32.dc, ci, dpe, bq, nr, P.Dv, w.dO, Dvp, 1.0f) == PARTS_PACKED) {
          tile_chain3_f64(nr, P.Dv, w.f32.dc.parts + ci * dpe, w.f32.vb3, w.dp64, BK);
        } else if (!exact && bwd_on_tiles(P) && tile_gemm(nr, BK, P.Dv, w.dO, Dvp, nullptr, w.vt, BK, w.o, BK)) {
          for (int64_t x = 0; x < nr * BK; ++x) w.dp64[x] = (double)w.o[x];
        } else {
          gemm_dp(nr, BK, P.Dv, w.dO, Dvp, w.dO64, w.vt, w.vt64, BK, w.dp64, BK, exact);
        }
        for (int64_t r = 0; r < nr; ++r) {
          float* srow = w.s + r * BK;
          const float* lorow = lo_row(P, w, r);
          float* prow = w.p + r * BK;
          float* dsrow = w.ds + r * BK;
          float* frow = w.dfac + r * BK;
          const uint64_t allowed = code == TILE_FULL ? edge : L.bits[code * code_stride + w.bitoff[r]];
          if (allowed == 0 || w.inv_l[r] == 0.0) {
            for (int64_t q = 0; q < 4; ++q) {
              v_store(prow + 16 * q, zero);
              v_store(dsrow + 16 * q, zero);
            }
            continue;
          }
          row_scores(P.mods, w.slope[r], w.qpos[r], c0, allowed, srow, srow, cap ? frow : nullptr);
          const V16 mv = v_set(w.mrow[r]);
          const double inv = w.inv_l[r], delta = w.delta[r];
          for (int64_t q = 0; q < 4; ++q) {
            const V16 p = v_mul_f64(exp_scores(srow, lorow, q, mv), inv);
            V16 pd = p;
            M16 keep = m_bits(0xFFFFu);
            if (P.drop.on) {
              keep = drop_keep(P.drop, w.rowh[r], w.colh + 16 * q);
              pd = v_select(keep, v_mul(p, keep_scale), zero);
            }
            V16 ds = v_mul(p, v_dsub(w.dp64 + r * BK + 16 * q, drop_mul, delta, keep));
            if (cap) ds = v_mul(ds, v_load(frow + 16 * q));
            v_store(prow + 16 * q, pd);
            v_store(dsrow + 16 * q, ds);
          }
        }
        if (P.exact_dkv) {
          gemm_acc_f64(kw, Dvp, nr, w.p, 1, BK, w.dO, Dvp, dv64, Dvp);
          gemm_acc_f64(kw, Dp, nr, w.ds, 1, BK, w.q, Dp, dk64, Dp);
        } else if (bwd_on_tiles(P)) {  // Pᵀ and dSᵀ in two parts (keys ≥ kw: P = dS = 0)
          tile_pack_a(BK, nr, w.p, BK, true, 2, w.bf16.ta);
          tile_acc(BK, Dvp, nr, w.bf16.ta, 2, w.dO, Dvp, w.bf16.tb, dv64, Dvp);
          tile_pack_a(BK, nr, w.ds, BK, true, 2, w.bf16.ta);
          tile_acc(BK, Dp, nr, w.bf16.ta, 2, w.q, Dp, w.bf16.tb, dk64, Dp);
        } else {
          gemm_acc(kw, Dvp, nr, w.p, 1, BK, w.dO, Dvp, dv64, Dvp, w.o, acc_chain);
          gemm_acc(kw, Dp, nr, w.ds, 1, BK, w.q, Dp, dk64, Dp, w.o, acc_chain);
        }
        if (P.exact_dq) {
          gemm_acc_f64(nr, Dp, kw, w.ds, BK, 1, w.kr, Dp, qacc + (g - g0) * bq * Dp, Dp);
        } else if (bwd_on_tiles(P)) {
          tile_pack_a(nr, BK, w.ds, BK, false, 2, w.bf16.ta);
          tile_acc(nr, Dp, BK, w.bf16.ta, 2, w.kr, Dp, w.bf16.tb, qacc + (g - g0) * bq * Dp, Dp);
        } else {
          gemm_acc(nr, Dp, kw, w.ds, BK, 1, w.kr, Dp, qacc + (g - g0) * bq * Dp, Dp, w.o, acc_chain);
        }
      }
    }
    if (e1 > e0 && g1 == G) {
      for (int64_t jj = 0; jj < kw; ++jj) {
        const int64_t row = (b * P.Hkv + hkv) * P.Nk + c0 + jj;
        for (int64_t d = 0; d < P.D; ++d) w.tmp[d] = (float)(dk64[jj * Dp + d] * scale);
        store_row((char*)P.dk + row * P.D * es, P.dtype, w.tmp, P.D);
        for (int64_t d = 0; d < P.Dv; ++d) w.tmp[d] = (float)dv64[jj * Dvp + d];
        store_row((char*)P.dv + row * P.Dv * es, P.dtype, w.tmp, P.Dv);
      }
    }
    while (next_flush < t1 - t0) {
      const int64_t t = t0 + Bp.t_flush[t0 + next_flush];
      if (Bp.t_last[t] != j) break;
      const int32_t s = w.slot_of[t - t0];
      flush_dq(P, Bp, b, hkv, t, g0, g1, w.pool + s * tile, w);
      w.free_slots[n_free++] = s;
      ++next_flush;
    }
  }
  }
  w.q = qbuf;
  w.dO = dobuf;
  return true;
}

// The backward's row pass: Δ of every row, once. For query tiles holding a peaked row:
// Δ_i = Σ_j P_ij dP̃_ij / Σ_j P_ij − dlse_i over the kept tiles of query tile i, where P and dP̃
// (dP, dropped and rescaled) are computed exactly as bwd_item computes them (same packing, same
// instructions: the same bits).
// dS = P ∘ (dP̃ − Δ) then sums to zero over each row up to the rounding of P, as the softmax's
// gradient does. Δ = dO·O from the saved output carries the rounding of O (to its dtype, and of
// the forward's P, which are not the backward's bits); dP̃_j − Δ is of the order of
// (1 − max_j P_ij)·|dP̃|, so that rounding is amplified by 1 / (1 − max P): harmless while the
// largest weight 1/l is at most PEAKED, all of a peaked row's gradient beyond it. Rows of the
// other tiles get Δ = dO·O − dlse (no pass over their tiles), once here rather than once per
// key column in bwd_item.
static const double PEAKED = 0.5;

static void delta_item(const Problem& P, int64_t b, int64_t hkv, int64_t i, BwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t G = P.G, bq = L.bq, r0 = tile_r0(P, i), nr = tile_nr(P, i);
  bool peaked = false;
  for (int64_t g = 0; g < G && !peaked; ++g)
    for (int64_t r = 0; r < nr && !peaked; ++r) {
      const double lr = P.l[(b * P.H + hkv * G + g) * P.Nq + r0 + r];
      peaked = lr > 0.0 && lr * PEAKED < 1.0;  // largest weight 1/l > PEAKED
    }
  P.peaked[(b * P.Hkv + hkv) * L.nqb + i] = peaked;
  if (!peaked) {  // Δ = dO·O − dlse, the products exact in double, summed in order
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t h = hkv * G + g, idx = (b * P.H + h) * P.Nq + r0 + r;
        load_row(row_of(P.dout, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.dO);
        load_row(row_of(P.out, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.tmp);
        double delta = 0.0;
        for (int64_t d = 0; d < P.Dv; ++d) delta = delta + (double)w.dO[d] * (double)w.tmp[d];
        if (P.dlse) delta -= (double)P.dlse[idx];
        P.delta[idx] = delta;
      }
    return;
  }
  const int64_t Dp = P.Dp, code_stride = L.bm * L.hm * bq;
  const V16 one = v_set(1.0f), zero = v_set(0.0f);
  const double drop_mul = P.drop.on ? (double)P.drop.keep_scale : 1.0;
  double* sp = w.sum_p;     // Σ_j P_ij, per row of the G heads
  double* spd = w.sum_pdp;  // Σ_j P_ij dP̃_ij
  for (int64_t R = 0; R < G * nr; ++R) sp[R] = spd[R] = 0.0;
  for (int64_t e = L.row_ptr[i]; e < L.row_ptr[i + 1]; ++e) {
    const int64_t j = L.col_idx[e], code = L.code[e], c0 = tile_c0(P, j), kw = tile_kw(P, j);
    const uint64_t edge = kw == BK ? ~0ull : ((1ull << kw) - 1);
    bwd_pack(P, b, hkv, c0, kw, w);
    bool vt_ready = false;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = hkv * G + g;
      for (int64_t r = 0; r < nr; ++r) bwd_row(P, b, h, r0, r, w);
      tile_scores(P, nr, w.q, w.q64, Dp, w.kr, Dp, kw, w);
      exact_rows(P, nr, w.kr, Dp, kw, w);
      dp_operands(P, nr, vt_ready, w);
      gemm_dp(nr, BK, P.Dv, w.dO, P.Dvp, w.dO64, w.vt, w.vt64, BK, w.dp64, BK, true);
      for (int64_t r = 0; r < nr; ++r) {
        float* srow = w.s + r * BK;
        const float* lorow = lo_row(P, w, r);
        float* prow = w.p + r * BK;
        float* krow = w.ds + r * BK;  // 1 where the weight is kept (dropout), else 0
        const uint64_t allowed = code == TILE_FULL ? edge : L.bits[code * code_stride + w.bitoff[r]];
        if (allowed == 0 || w.inv_l[r] == 0.0) continue;
        row_scores(P.mods, w.slope[r], w.qpos[r], c0, allowed, srow, srow, nullptr);
        const V16 mv = v_set(w.mrow[r]);
        const double inv = w.inv_l[r];
        for (int64_t q = 0; q < 4; ++q) {
          const V16 p = v_mul_f64(exp_scores(srow, lorow, q, mv), inv);
          M16 keep = m_bits(0xFFFFu);
          if (P.drop.on) keep = drop_keep(P.drop, w.rowh[r], w.colh + 16 * q);
          v_store(prow + 16 * q, p);
          v_store(krow + 16 * q, v_select(keep, one, zero));
        }
        double a = 0.0, c = 0.0;
        const double* dprow = w.dp64 + r * BK;
        for (int64_t x = 0; x < BK; ++x) {
          const double px = (double)prow[x];
          a += px;
          if (krow[x] != 0.0f) c += px * (dprow[x] * drop_mul);
        }
        sp[g * nr + r] += a;
        spd[g * nr + r] += c;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hkv * G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
      const double a = sp[g * nr + r];
      double d = a > 0.0 ? spd[g * nr + r] / a : 0.0;
      if (P.dlse) d -= (double)P.dlse[idx];
      P.delta[idx] = d;
    }
  }
}

static void delta_worker(const Problem& P, ItemQueue* items, int32_t* error) {
  BwdBufs w;
  if (!bwd_alloc(w, P, imax(P.lay.bq, P.G * P.lay.bq))) return fail(error);
  take_items(items, error, [&](int64_t k) {
    const int64_t i = k % P.lay.nqb, bh = k / P.lay.nqb;
    delta_item(P, bh / P.Hkv, bh % P.Hkv, i, w);
    return true;
  });
  bwd_free(w);
}

static void backward_worker(const Problem& P, const BwdPlan& Bp, ItemQueue* items, int32_t* error) {
  BwdBufs w;
  if (!bwd_alloc(w, P, imax(P.lay.bq, P.G * P.lay.bq))) return fail(error);
  take_items(items, error, [&](int64_t k) { return bwd_item(P, Bp, Bp.items[k], w); });
  bwd_free(w);
}
