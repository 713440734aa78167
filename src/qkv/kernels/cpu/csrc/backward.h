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
static inline void bwd_row(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t r,
                           BwdBufs& w, bool rows_in_place = false, bool packed = false) {
  const Layout& L = P.lay;
  const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
  if (packed) {  // bfloat16 rows the cache holds packed (BwdBf16.rows): no floats, no norm
  } else if (rows_in_place) {  // w.q and w.dO point at the tensors' rows: the norm only
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

// ------------------------------------------------------------------------- one item, by steps
//
// bwd_item walks its chunk of key-tile columns once per pass of a few heads of the group
// (bwd_pass). Per column (bwd_column) it packs K_j and V_j, and for each kept query tile and
// head (bwd_tile_head) loads the rows, forms the scores and dP, P and dS row by row, and adds
// into dV_j, dK_j and the query tile's dQ, which lives in a pool slot from the column that
// first touches the tile (bwd_open_tiles) to the last (bwd_flush_tiles). The steps are
// QKV_STEP: inlined, so the item still compiles as one function.

// A query tile's rows of one head as the bfloat16 products read them, one entry of the rows
// cache (BwdBf16.rows): Q's and dO's rows as A tiles (the scores, dP = dO Vᵀ; tile_pack_rows)
// and Qᵀ and dOᵀ as A tiles (dKᵀ += Qᵀ dS, dVᵀ += dOᵀ P; tile_pack_a)
struct RowPacks {
  uint16_t *qa, *da, *qta, *dta;
};
static inline int64_t row_packs_elems(const Problem& P, int64_t bq) {  // uint16 elements
  return tile_a_elems(bq, P.D) + tile_a_elems(bq, P.Dv) + tile_a_elems(P.Dp, bq) +
         tile_a_elems(P.Dvp, bq);
}
static inline RowPacks row_packs(const Problem& P, int64_t bq, uint16_t* e) {
  RowPacks rp;
  rp.qa = e;
  rp.da = rp.qa + tile_a_elems(bq, P.D);
  rp.qta = rp.da + tile_a_elems(bq, P.Dv);
  rp.dta = rp.qta + tile_a_elems(P.Dp, bq);
  return rp;
}

// One item's chunk of columns and how it is walked
struct BwdChunk {
  int64_t b, hkv;
  int64_t j0, j1;      // its key tiles
  int64_t t0, t1;      // its touched query tiles (entries t0 … t1 − 1 of the plan)
  int64_t gs;          // heads per pass (BwdPlan.heads)
  int64_t tile;        // doubles of one pool slot: gs heads' dQ of a query tile (bfloat16 on
                       // the tiles: in float, two to a double)
  int64_t head;        // doubles from one head's dQ in a slot to the next's
  int64_t live;        // most query tiles live at once
  int64_t kvs;         // doubles of one column's dK_j and dV_j kept between passes
  int64_t qpe, dpe;    // float32 on the tiles: one cache entry's parts of Q's rows, of dO's
  int64_t rpe;         // bfloat16 on the tiles: one rows cache entry's elements (RowPacks)
  bool rows_in_place;  // float32 rows of Q and dO read in place (ld Dp, Dvp already)
};

// A pass of heads g0 … g1 − 1 over the chunk: its free pool slots and where the plan's lists of
// tiles to open and to flush stand
struct BwdPass {
  int64_t g0, g1, n_free, next_first, next_flush;
};

// One column of the chunk: key tile j, packed, and where its dK_j and dV_j add up
struct BwdColumn {
  int64_t j, c0, kw;
  uint64_t edge;
  double *dk64, *dv64;
  bool vt_ready;  // Vᵀ in double (dp_operands) made for this column
};

QKV_STEP BwdChunk bwd_chunk(const Problem& P, const BwdPlan& Bp, const BwdItem& it,
                            const BwdBufs& w) {
  BwdChunk ch;
  const int64_t c = it.c, bq = P.lay.bq;
  ch.b = it.b;
  ch.hkv = it.hkv;
  ch.j0 = Bp.chunk_j[c];
  ch.j1 = Bp.chunk_j[c + 1];
  ch.t0 = Bp.chunk_t[c];
  ch.t1 = Bp.chunk_t[c + 1];
  // heads g0 … g1 − 1 per pass over the chunk; dK_j, dV_j of its columns kept between passes
  ch.gs = Bp.heads;
  ch.live = Bp.chunk_live[c];
  ch.kvs = BK * (P.Dp + P.Dvp);
  ch.qpe = scores_on_tiles(P) ? tile_a3_elems(bq, P.D) : 0;  // one entry's parts
  ch.dpe = w.f32.vb3 ? tile_a3_elems(bq, P.Dv) : 0;          // … of dO's rows
  ch.rpe = bwd_on_tiles(P) ? row_packs_elems(P, bq) : 0;
  ch.head = ch.rpe ? (bq * P.Dp + 1) / 2 : bq * P.Dp;  // (bq·Dp even: Dp a multiple of 16)
  ch.tile = ch.gs * ch.head;
  ch.rows_in_place = P.dtype == DT_F32 && P.precise_scores && !P.dot_scores && P.D == P.Dp &&
                     P.Dv == P.Dvp && P.q.sn == P.Dp && P.dout.sn == P.Dvp;
  return ch;
}

// Pool slots for the query tiles that column j touches first: dQ zeroed, parts caches emptied
QKV_STEP void bwd_open_tiles(const BwdPlan& Bp, const BwdChunk& ch, int64_t j, BwdPass& ps,
                             BwdBufs& w) {
  while (ps.next_first < ch.t1 && Bp.t_first[ps.next_first] == j) {
    const int32_t s = w.free_slots[--ps.n_free];
    w.slot_of[ps.next_first - ch.t0] = s;
    __builtin_memset(w.pool + s * ch.tile, 0, (size_t)ch.tile * 8);
    if (ch.qpe) {
      __builtin_memset(w.f32.qc.state + s * ch.gs, PARTS_EMPTY, (size_t)ch.gs);
      __builtin_memset(w.f32.dc.state + s * ch.gs, PARTS_EMPTY, (size_t)ch.gs);
    }
    if (ch.rpe) __builtin_memset(w.bf16.state + s * ch.gs, 0, (size_t)ch.gs);
    ++ps.next_first;
  }
}

// The query tiles whose last column of the chunk is j: their dQ written or stored (flush_dq) and
// their slots freed
QKV_STEP void bwd_flush_tiles(const Problem& P, const BwdPlan& Bp, const BwdChunk& ch, int64_t j,
                              BwdPass& ps, BwdBufs& w) {
  while (ps.next_flush < ch.t1 - ch.t0) {
    const int64_t t = ch.t0 + Bp.t_flush[ch.t0 + ps.next_flush];
    if (Bp.t_last[t] != j) break;
    const int32_t s = w.slot_of[t - ch.t0];
    double* acc = w.pool + s * ch.tile;
    if (ch.rpe) {  // bfloat16 on the tiles: each head's dQ in float, widened to double
      const int64_t head = P.lay.bq * P.Dp;
      for (int64_t g = 0; g < ps.g1 - ps.g0; ++g) {
        const float* f = (const float*)(acc + g * ch.head);
        for (int64_t x = 0; x < head; ++x) w.dq_wide[g * head + x] = (double)f[x];
      }
      acc = w.dq_wide;
    }
    flush_dq(P, Bp, ch.b, ch.hkv, t, ps.g0, ps.g1, acc, w);
    w.free_slots[ps.n_free++] = s;
    ++ps.next_flush;
  }
}

// Column j: K_j and V_j packed where any query tile is kept in it, and (the pass of the first
// heads) its dK_j, dV_j zeroed
QKV_STEP BwdColumn bwd_column_start(const Problem& P, const BwdChunk& ch, int64_t j, int64_t g0,
                                    bool kept, BwdBufs& w) {
  BwdColumn col;
  col.j = j;
  col.c0 = tile_c0(P, j);
  col.kw = tile_kw(P, j);
  col.edge = col.kw == BK ? ~0ull : ((1ull << col.kw) - 1);
  col.dk64 = ch.gs < P.G ? w.dkv + (j - ch.j0) * ch.kvs : w.dk64;
  col.dv64 = ch.gs < P.G ? col.dk64 + BK * P.Dp : w.dv64;
  col.vt_ready = false;
  if (kept) {
    bwd_pack(P, ch.b, ch.hkv, col.c0, col.kw, w);
    if (bwd_on_tiles(P)) {  // the column's operands of the scores, dP and dQ, once
      if (!P.dot_scores) pack_b_blocks(w.kt, BK, P.D, 4, 4, w.bf16.kt_pairs);
      pack_b_blocks(w.vt, BK, P.Dv, 4, 4, w.bf16.vt_pairs);
      pack_b_blocks(w.kr, P.Dp, BK, P.Dp / 16, P.Dp / 16, w.bf16.k_pairs);
    }
    if (g0 == 0) {
      __builtin_memset(col.dk64, 0, (size_t)(BK * P.Dp) * 8);
      __builtin_memset(col.dv64, 0, (size_t)(BK * P.Dvp) * 8);
    }
  }
  return col;
}

// dK_j and dV_j of the column, complete after the pass of the last heads: scaled and stored
QKV_STEP void bwd_store_dkv(const Problem& P, const BwdChunk& ch, const BwdColumn& col,
                            BwdBufs& w) {
  const int64_t es = elem_size(P.dtype);
  // bfloat16 on the tiles: dKᵀ and dVᵀ in float, element (d, key jj) at d·BK + jj
  const float *dkt = (const float*)col.dk64, *dvt = (const float*)col.dv64;
  for (int64_t jj = 0; jj < col.kw; ++jj) {
    const int64_t row = (ch.b * P.Hkv + ch.hkv) * P.Nk + col.c0 + jj;
    for (int64_t d = 0; d < P.D; ++d)
      w.tmp[d] = (float)((ch.rpe ? (double)dkt[d * BK + jj] : col.dk64[jj * P.Dp + d]) *
                         P.mods.scale64);
    store_row((char*)P.dk + row * P.D * es, P.dtype, w.tmp, P.D);
    for (int64_t d = 0; d < P.Dv; ++d)
      w.tmp[d] = ch.rpe ? dvt[d * BK + jj] : (float)col.dv64[jj * P.Dvp + d];
    store_row((char*)P.dv + row * P.Dv * es, P.dtype, w.tmp, P.Dv);
  }
}

// The nr rows of head h of the query tile (rows r0 …): Q and dO (read in place, or copied to
// the buffers qbuf and dobuf, or neither where the rows cache holds them packed: `packed`),
// their state (bwd_row) and the row pass's Δ
QKV_STEP void bwd_load_rows(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t nr,
                            bool in_place, bool packed, float* qbuf, float* dobuf, BwdBufs& w) {
  w.q = in_place ? (float*)row_of(P.q, P.dtype, b, h, r0) : qbuf;
  w.dO = in_place ? (float*)row_of(P.dout, P.dtype, b, h, r0) : dobuf;
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t idx = (b * P.H + h) * P.Nq + r0 + r;
    bwd_row(P, b, h, r0, r, w, in_place, packed);
    w.delta[r] = P.delta[idx];  // the row pass's Δ (delta_item)
  }
}

// dP = dO Vᵀ of the rows, into w.dp64. Float32 on the tiles: as the scores are formed (dO's
// rows' parts against the V tile's), gemm_dp's float chains, unless the split cannot carry some
// value of either; bfloat16: on the tiles (one float chain over Dv, in w.o as floats); else
// gemm_dp (exact in double for a tile holding a peaked row)
QKV_STEP void bwd_dp(const Problem& P, const BwdChunk& ch, bool exact, int64_t nr, int64_t ci,
                     const RowPacks* rp, BwdColumn& col, BwdBufs& w) {
  const int64_t Dvp = P.Dvp, bq = P.lay.bq;
  if (exact || !DP_FLOAT_CHAINS) dp_operands(P, nr, col.vt_ready, w);
  if (!exact && ch.dpe && w.f32.vbad == 0 &&
      parts_of(w.f32.dc, ci, ch.dpe, bq, nr, P.Dv, w.dO, Dvp, 1.0f) == PARTS_PACKED) {
    tile_chain3_f64(nr, P.Dv, w.f32.dc.parts + ci * ch.dpe, w.f32.vb3, w.dp64, BK);
  } else if (!exact && bwd_on_tiles(P) &&
             tile_gemm(nr, BK, P.Dv, w.dO, Dvp, rp ? rp->da : nullptr, w.vt, BK,
                       w.bf16.vt_pairs, w.o, BK)) {
    // dP in w.o, floats (bwd_p_ds_tiles reads them)
  } else {
    gemm_dp(nr, BK, P.Dv, w.dO, Dvp, w.dO64, w.vt, w.vt64, BK, w.dp64, BK, exact);
  }
}

// Row r's P (dropped and rescaled: pd) and dS = P ∘ (dP̃ − Δ) (times dt/dx under a softcap) over
// the column's keys, zeros where the row attends none of them (or r ≥ nr): P recomputed from the
// forward's (m, l), the forward's scores (same bits). dP̃ − Δ in double from w.dp64, or, with
// `float_dp` (bfloat16 inputs on the tiles outside peaked tiles: P and dS round to bfloat16
// next), in float from w.o, P = e^(s − m) · (1/l) then in float too.
QKV_STEP void p_ds_row(const Problem& P, const BwdColumn& col, int64_t code, int64_t r, int64_t nr,
                       bool float_dp, V16* pd, V16* ds, BwdBufs& w) {
  const Layout& L = P.lay;
  const V16 zero = v_set(0.0f);
  const uint64_t allowed = r >= nr             ? 0
                           : code == TILE_FULL ? col.edge
                                               : L.bits[code * (L.bm * L.hm * L.bq) + w.bitoff[r]];
  if (allowed == 0 || w.inv_l[r] == 0.0) {
    for (int64_t q = 0; q < 4; ++q) pd[q] = ds[q] = zero;
    return;
  }
  const bool cap = P.mods.cap != 0.0f;
  float* srow = w.s + r * BK;
  float* frow = w.dfac + r * BK;
  row_scores(P.mods, w.slope[r], w.qpos[r], col.c0, allowed, srow, srow, cap ? frow : nullptr);
  const float* lorow = lo_row(P, w, r);
  const V16 mv = v_set(w.mrow[r]), keep_scale = v_set(P.drop.keep_scale);
  const double inv = w.inv_l[r], delta = w.delta[r];
  const double drop_mul = P.drop.on ? (double)P.drop.keep_scale : 1.0;
  const V16 inv_f = v_set((float)inv), delta_f = v_set((float)delta), mul_f = v_set((float)drop_mul);
  for (int64_t q = 0; q < 4; ++q) {
    const V16 e = exp_scores(srow, lorow, q, mv);
    const V16 p = float_dp ? v_mul(e, inv_f) : v_mul_f64(e, inv);
    M16 keep = m_bits(0xFFFFu);
    pd[q] = p;
    if (P.drop.on) {
      keep = drop_keep(P.drop, w.rowh[r], w.colh + 16 * q);
      pd[q] = v_select(keep, v_mul(p, keep_scale), zero);
    }
    const V16 dd = float_dp
                       ? v_sub(v_select(keep, v_mul(v_load(w.o + r * BK + 16 * q), mul_f), zero), delta_f)
                       : v_dsub(w.dp64 + r * BK + 16 * q, drop_mul, delta, keep);
    ds[q] = v_mul(p, dd);
    if (cap) ds[q] = v_mul(ds[q], v_load(frow + 16 * q));
  }
}

// P and dS of the rows into w.p and w.ds (the float products)
QKV_STEP void bwd_p_ds_rows(const Problem& P, const BwdColumn& col, int64_t code, int64_t nr,
                            BwdBufs& w) {
  for (int64_t r = 0; r < nr; ++r) {
    V16 pd[4], ds[4];
    p_ds_row(P, col, code, r, nr, false, pd, ds, w);
    for (int64_t q = 0; q < 4; ++q) {
      v_store(w.p + r * BK + 16 * q, pd[q]);
      v_store(w.ds + r * BK + 16 * q, ds[q]);
    }
  }
}

// P and dS of the rows, rounded to bfloat16 once, as the tile products read them: P and dS as B
// blocks over the rows (w.bf16.pb, dsb: dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS), dS as A tiles (w.bf16.dsa:
// dQ += dS K); rows nr … to a whole step of 32 zero
QKV_STEP void bwd_p_ds_tiles(const Problem& P, const BwdColumn& col, int64_t code, int64_t nr,
                             bool exact, BwdBufs& w) {
  const int64_t steps = (nr + 31) / 32 * 32;
  for (int64_t r = 0; r < steps; r += 2) {
    V16 pd[2][4], ds[2][4];
    for (int64_t h = 0; h < 2; ++h) {
      p_ds_row(P, col, code, r + h, nr, !exact, pd[h], ds[h], w);
      tile_put_p(ds[h][0], ds[h][1], w.bf16.dsa, r + h, 0);
      tile_put_p(ds[h][2], ds[h][3], w.bf16.dsa, r + h, 2);
    }
    tile_put_pair(pd[0], pd[1], r, w.bf16.pb);
    tile_put_pair(ds[0], ds[1], r, w.bf16.dsb);
  }
}

// The backward's float chains for dQ, dK and dV: ACC_CHAIN terms for float32 inputs (docs/cpu.md,
// Accuracy: one float sum over a tile's rows broke the rule); for 16-bit inputs, whose gradients
// round to 16 bits, one chain per tile (≤ 256 terms, a float rounding of ≤ 256·2⁻²⁴ against
// bf16's 2⁻⁹), summed in double across tiles, as their scores and P·V are plain float sums
// (bfloat16 on the tile paths sums in float throughout: bwd_acc_grads).
constexpr int64_t ONE_CHAIN = int64_t(1) << 40;

// dV_j += Pᵀ dO and dK_j += dSᵀ Q; dQ (qacc: this head's in the tile's pool slot) += dS K_j:
// exactly in double (small float32 gradients), on the tile unit (bfloat16, rp: dVᵀ_j += dOᵀ P
// and dKᵀ_j += Qᵀ dS, transposed, from P and dS as bwd_p_ds_tiles wrote them, rounded to
// bfloat16; keys ≥ kw: P = dS = 0; all three summed in float, in the doubles' memory: a float
// sum over the whole row of keys or queries rounds by far less than the bfloat16 gradient) or
// in float chains summed in double
QKV_STEP void bwd_acc_grads(const Problem& P, const BwdColumn& col, int64_t nr, double* qacc,
                            const RowPacks* rp, BwdBufs& w) {
  const int64_t acc_chain = P.dtype == DT_F32 ? ACC_CHAIN : ONE_CHAIN;
  const int64_t Dp = P.Dp, Dvp = P.Dvp, kw = col.kw;
  if (P.exact_dkv) {
    gemm_acc_f64(kw, Dvp, nr, w.p, 1, BK, w.dO, Dvp, col.dv64, Dvp);
    gemm_acc_f64(kw, Dp, nr, w.ds, 1, BK, w.q, Dp, col.dk64, Dp);
  } else if (rp) {  // (dKᵀ and dVᵀ)
    tile_acc(Dvp, BK, nr, rp->dta, w.bf16.pb, (float*)col.dv64, BK);
    tile_acc(Dp, BK, nr, rp->qta, w.bf16.dsb, (float*)col.dk64, BK);
  } else {
    gemm_acc(kw, Dvp, nr, w.p, 1, BK, w.dO, Dvp, col.dv64, Dvp, w.o, acc_chain);
    gemm_acc(kw, Dp, nr, w.ds, 1, BK, w.q, Dp, col.dk64, Dp, w.o, acc_chain);
  }
  if (P.exact_dq) {
    gemm_acc_f64(nr, Dp, kw, w.ds, BK, 1, w.kr, Dp, qacc, Dp);
  } else if (rp) {
    tile_acc(nr, Dp, BK, w.bf16.dsa, w.bf16.k_pairs, (float*)qacc, Dp);
  } else {
    gemm_acc(nr, Dp, kw, w.ds, BK, 1, w.kr, Dp, qacc, Dp, w.o, acc_chain);
  }
}

// Kept tile e of the column (query tile i), head g of the pass: rows, scores, dP, P and dS, and
// their products into dV_j, dK_j and the tile's dQ
QKV_STEP void bwd_tile_head(const Problem& P, const BwdPlan& Bp, const BwdChunk& ch,
                            const BwdPass& ps, BwdColumn& col, int64_t e, int64_t g, float* qbuf,
                            float* dobuf, BwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t Dp = P.Dp, bq = L.bq, b = ch.b, hkv = ch.hkv;
  const int64_t i = L.row_idx[e], r0 = tile_r0(P, i), nr = tile_nr(P, i);
  const bool exact = P.peaked[(b * P.Hkv + hkv) * L.nqb + i];  // dP exact (gemm_dp)
  // float32 rows of Q and dO as the products read them (ld Dp, Dvp) already: read in place, not
  // copied per (column, query tile); not the last query tile, so that reads a vector past a
  // tile's last row stay inside the tensor
  const bool in_place = ch.rows_in_place && i + 1 < L.nqb;
  const int64_t slot = w.slot_of[Bp.local[e]];
  const int64_t ci = slot * ch.gs + g - ps.g0;  // the caches' entry
  // bfloat16 on the tiles: the rows packed at the tile's first column (read as floats only by
  // the exact dP of a peaked tile)
  RowPacks rows;
  const bool cached = ch.rpe && w.bf16.state[ci];
  if (ch.rpe) rows = row_packs(P, bq, w.bf16.rows + ci * ch.rpe);
  bwd_load_rows(P, b, hkv * P.G + g, r0, nr, in_place, cached && !exact && !P.dot_scores, qbuf,
                dobuf, w);
  if (ch.rpe && !cached) {
    tile_pack_rows(nr, P.D, w.q, Dp, rows.qa, 1.0f);
    tile_pack_rows(nr, P.Dv, w.dO, P.Dvp, rows.da, 1.0f);
    tile_pack_a(Dp, nr, w.q, Dp, rows.qta);
    tile_pack_a(P.Dvp, nr, w.dO, P.Dvp, rows.dta);
    w.bf16.state[ci] = 1;
  }
  if (ch.rpe && !P.dot_scores) {  // the scores from the packed rows and the column's Kᵀ
    w.tile.qa = rows.qa;
    w.tile.qa_on = true;
    w.tile.qa_scaled = false;
    w.tile.kpairs = w.bf16.kt_pairs;
  }
  if (ch.qpe) {  // the rows' parts, for the scores
    parts_of(w.f32.qc, ci, ch.qpe, bq, nr, P.D, w.q, Dp,
             tile_scale_folds(P.mods.scale) ? P.mods.scale : 1.0f);
    w.tile.qa = w.f32.qc.parts + ci * ch.qpe;
    w.tile.qbad = w.f32.qc.bad + ci * bq;
    w.tile.qa_on = true;
  }
  tile_scores(P, nr, w.q, w.q64, Dp, w.kr, Dp, col.kw, w);
  exact_rows(P, nr, w.kr, Dp, col.kw, w);
  const RowPacks* rp = ch.rpe ? &rows : nullptr;
  bwd_dp(P, ch, exact, nr, ci, rp, col, w);
  if (rp)
    bwd_p_ds_tiles(P, col, L.code_t[e], nr, exact, w);
  else
    bwd_p_ds_rows(P, col, L.code_t[e], nr, w);
  bwd_acc_grads(P, col, nr, w.pool + slot * ch.tile + (g - ps.g0) * ch.head, rp, w);
}

// One pass of heads g0 … over the chunk, column by column
QKV_STEP void bwd_pass(const Problem& P, const BwdPlan& Bp, const BwdChunk& ch, int64_t g0,
                       float* qbuf, float* dobuf, BwdBufs& w) {
  const Layout& L = P.lay;
  BwdPass ps{g0, imin(P.G, g0 + ch.gs), ch.live, ch.t0, 0};
  for (int64_t s = 0; s < ch.live; ++s) w.free_slots[s] = (int32_t)(ch.live - 1 - s);
  for (int64_t j = ch.j0; j < ch.j1; ++j) {
    bwd_open_tiles(Bp, ch, j, ps, w);
    const int64_t e0 = L.col_ptr[j], e1 = L.col_ptr[j + 1];
    BwdColumn col = bwd_column_start(P, ch, j, g0, e1 > e0, w);
    for (int64_t e = e0; e < e1; ++e)
      for (int64_t g = ps.g0; g < ps.g1; ++g)
        bwd_tile_head(P, Bp, ch, ps, col, e, g, qbuf, dobuf, w);
    if (e1 > e0 && ps.g1 == P.G) bwd_store_dkv(P, ch, col, w);
    bwd_flush_tiles(P, Bp, ch, j, ps, w);
  }
}

static bool bwd_item(const Problem& P, const BwdPlan& Bp, const BwdItem& it, BwdBufs& w) {
  const BwdChunk ch = bwd_chunk(P, Bp, it, w);
  const int64_t kv_need = ch.gs < P.G ? (ch.j1 - ch.j0) * ch.kvs : 0;
  if (!bwd_reserve(w, kv_need, ch.live, ch.tile, ch.gs, ch.qpe, ch.dpe, ch.rpe, P.lay.bq,
                   ch.t1 - ch.t0))
    return false;
  float* const qbuf = w.q;  // (w.q and w.dO point at the tensors' rows while read in place)
  float* const dobuf = w.dO;
  for (int64_t g0 = 0; g0 < P.G; g0 += ch.gs) bwd_pass(P, Bp, ch, g0, qbuf, dobuf, w);
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

// The rows of query tile i whose q and output both hold a NaN or inf (a query row of NaN or inf
// that attends something): the formula's gradients there are NaN (its weights are NaN, so is its
// dq and, through dS = P ∘ (dP − Δ), every dK and dV of its kv head, masked keys too: 0 · NaN).
// The passes read non-finite values as 0 (masked garbage stays out); the op puts these NaNs back
// after them (poison_grads, ops.cpp). A row that attends nothing (output 0) keeps zero gradients.
static void flag_bad_rows(const Problem& P, int64_t b, int64_t hkv, int64_t i, BwdBufs& w) {
  const int64_t r0 = tile_r0(P, i), nr = tile_nr(P, i);
  for (int64_t g = 0; g < P.G; ++g) {
    const int64_t h = hkv * P.G + g;
    for (int64_t r = 0; r < nr; ++r) {
      load_row(row_of(P.q, P.dtype, b, h, r0 + r), P.dtype, P.D, P.Dp, w.tmp);
      bool bad = !rows_finite(w.tmp, 1, P.Dp, P.Dp);
      if (bad) {
        load_row(row_of(P.out, P.dtype, b, h, r0 + r), P.dtype, P.Dv, P.Dvp, w.tmp);
        bad = !rows_finite(w.tmp, 1, P.Dvp, P.Dvp);
      }
      P.bad_rows[(b * P.H + h) * P.Nq + r0 + r] = bad;
    }
  }
}

static void delta_item(const Problem& P, int64_t b, int64_t hkv, int64_t i, BwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t G = P.G, bq = L.bq, r0 = tile_r0(P, i), nr = tile_nr(P, i);
  flag_bad_rows(P, b, hkv, i, w);
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
