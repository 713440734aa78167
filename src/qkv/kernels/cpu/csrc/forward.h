// The forward: one item per (b, kv head, query tile[, split of its kept tiles]), the online
// softmax and P·V over its row of kept tiles, and the splits of a long row merged. Part of
// kernel.h (compiled once per ISA).

// Whether a row of one tile's scores (BK of them) holds a NaN: a NaN in q or k, which the
// row maxima pass over (max(NaN, x) is x), asked only where the row would otherwise be empty.
static inline bool has_nan(const float* row) {
  bool nan = false;
  for (int64_t j = 0; j < BK; ++j) nan = nan || row[j] != row[j];
  return nan;
}

// C = A·B where a zero in A never multiplies B (B may hold NaN/inf where A is 0). Each element
// is the same chain of operations as gemm's (a skipped term a·b + c with a = 0 is c), so on
// finite data both give the same bits.
static void gemm_zero_safe(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam,
                           int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    for (int64_t n = 0; n < N; ++n) c[n] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[m * sam + k * sak];
      if (a == 0.0f) continue;
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] = madd(a, b[n], c[n]);
    }
  }
}

// Write rows r0 … r0+nr−1 of all heads of (b, hkv): out = acc / l, and the saved (m, l) and lse.
static void finish_rows(const Problem& P, int64_t b, int64_t hkv, int64_t r0, int64_t nr,
                        const float* mrow, const double* l, const double* acc, int64_t ldacc,
                        float* tmp) {
  for (int64_t g = 0; g < P.G; ++g) {
    const int64_t h = hkv * P.G + g;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t R = g * nr + r, idx = (b * P.H + h) * P.Nq + r0 + r;
      const double lr = l[R];
      if (lr == 0.0) {
        for (int64_t d = 0; d < P.Dv; ++d) tmp[d] = 0.0f;
        P.m[idx] = NEG_INF;
        P.l[idx] = 0.0;
        P.lse[idx] = NEG_INF;
      } else {
        const double* a = acc + R * ldacc;
        for (int64_t d = 0; d < P.Dv; ++d) tmp[d] = (float)(a[d] / lr);
        P.m[idx] = mrow[R];
        P.l[idx] = lr;
        P.lse[idx] = (float)((double)mrow[R] + __builtin_log(lr));
      }
      void* dst = (void*)row_of(P.out, P.dtype, b, h, r0 + r);
      if (P.stream_out && (uintptr_t)dst % STREAM_ALIGN == 0) {
        for (int64_t d = 0; d < P.Dv; d += 16) v_stream((float*)dst + d, v_load(tmp + d));
      } else {
        store_row(dst, P.dtype, tmp, P.Dv);
      }
    }
  }
}

// The spans of 16-key chunks that the rows of a PARTIAL tile attend, per group of 16 rows, into
// w.glo / w.ghi (lo > hi: none): the group size, 16, or M when every group spans every chunk
static int64_t group_spans(const Problem& P, int64_t code, uint64_t edge, int64_t n_chains,
                           int64_t M, FwdBufs& w) {
  const Layout& L = P.lay;
  const uint64_t* bits = L.bits + code * (L.bm * L.hm * L.bq);
  bool narrow = false;
  for (int64_t R0 = 0, gi = 0; R0 < M; R0 += 16, ++gi) {
    uint64_t u = 0;
    for (int64_t R = R0; R < imin(M, R0 + 16); ++R) u |= bits[w.bitoff[R]];
    u &= edge;
    w.glo[gi] = u ? (int8_t)(__builtin_ctzll(u) / 16) : (int8_t)1;
    w.ghi[gi] = u ? (int8_t)((63 - __builtin_clzll(u)) / 16) : (int8_t)0;
    narrow = narrow || w.glo[gi] != 0 || w.ghi[gi] != n_chains - 1;
  }
  return narrow ? 16 : M;
}

// ------------------------------------------------------------------------- one item, by steps
//
// fwd_item runs an item as named steps (QKV_STEP: inlined into it, so the item still compiles
// as one function): its rows loaded, their state and accumulator started, then per kept key
// tile the tile's operands, its scores, the online softmax of its rows and P·V, and at the end
// the rows written (or the item's split stored and, by the last split, the splits merged).

// The rows of one forward item: rows r0 … r0+nr−1 of query tile i of each of the G query heads of
// kv head hkv; the item's buffers hold head g's row r at R = g·nr + r (M = G·nr rows)
struct FwdRows {
  int64_t b, hkv, i, r0, nr, M;
};

// One kept key tile of an item's row, and where its operands are read from
struct FwdTile {
  int64_t j, code, c0, kw;
  uint64_t edge;       // its keys inside Nk
  const float* krows;  // its key rows (exact rows, decoding), ld ldk
  int64_t ldk;
  const float* vb;     // its V rows, ld ldv: in place (float32 whole tiles) or packed in w.vr
  int64_t ldv;
  int64_t gs;          // rows per group of group_spans, or M where every group spans every chunk
  bool v_finite;       // V holds no NaN or inf (tile_v_finite)
};

// The item's Q rows (with their norms for precise scores) and each row's running max and sum,
// ALiBi slope, position, mask-bit offset and dropout hash
QKV_STEP void fwd_load_rows(const Problem& P, const FwdRows& x, FwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t G = P.G, Dp = P.Dp;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = x.hkv * G + g;
    for (int64_t r = 0; r < x.nr; ++r) {
      const int64_t R = g * x.nr + r;
      load_q(P, x.b, h, x.r0 + r, w.q + R * Dp, w.q64 + R * Dp, w.qn + R);
      w.mrow[R] = NEG_INF;
      w.l[R] = 0.0;
      w.slope[R] = P.mods.slopes ? P.mods.slopes[h] : 0.0f;
      w.qpos[R] = x.r0 + r + P.Nk - P.Nq;
      w.bitoff[R] = ((L.bm > 1 ? x.b : 0) * L.hm + (L.hm > 1 ? h : 0)) * L.bq + r;
      if (P.drop.on) w.rowh[R] = drop_row_hash(P.drop, x.b * P.H + h, x.r0 + r);
    }
  }
}

// The tile unit reads the item's Q rows as A tiles for every key tile: packed once here
QKV_STEP void fwd_pack_rows(const Problem& P, int64_t M, FwdBufs& w) {
  w.tile.qa_on = (on_tiles(P) && !P.dot_scores && P.D <= TILE_K_MAX) || scores_on_tiles(P);
  // (bfloat16: scaled, where the scale is a power of two: q·k·2ᵉ rounds as (q·k)·2ᵉ does)
  int scale_exp = 0;
  w.tile.qa_scaled =
      on_tiles(P) && w.tile.qa_on && __builtin_frexpf(P.mods.scale, &scale_exp) == 0.5f;
  w.tile.qbad_any = false;
  if (scores_on_tiles(P)) {
    tile_pack_rows3(M, P.D, w.q, P.Dp, w.tile.qa, w.tile.qbad,
                    tile_scale_folds(P.mods.scale) ? P.mods.scale : 1.0f);
    for (int64_t R = 0; R < M; ++R) w.tile.qbad_any = w.tile.qbad_any || w.tile.qbad[R];
  } else if (w.tile.qa_on) {
    tile_pack_rows(M, P.D, w.q, P.Dp, w.tile.qa, w.tile.qa_scaled ? P.mods.scale : 1.0f);
  }
}

// The accumulators zeroed; whether P·V starts on the tile unit (bfloat16 there: P·V adds into a
// float accumulator held by the tiles (its sums of ≤ 4096 keys round at 2⁻²⁴ per add, far below
// the output's bfloat16 rounding), moved to acc at the end or at the first key tile whose V is
// not all finite; and each row's l kept in 16 float lanes (l = l·α + P's lanes, no horizontal
// sum per tile; float sums round at 2⁻²⁴, far below the output's rounding), summed in double at
// the end)
QKV_STEP bool fwd_start_acc(const Problem& P, int64_t M, FwdBufs& w) {
  const int64_t Dvp = P.Dvp;
  __builtin_memset(w.acc, 0, (size_t)(M * Dvp) * 8);
  const bool tiles_pv = on_tiles(P) && Dvp <= TILE_PV_N;
  if (tiles_pv) __builtin_memset(w.bf16.accf, 0, (size_t)((M + 15) / 16 * 16 * Dvp) * 4);
  if (on_tiles(P)) __builtin_memset(w.bf16.lv, 0, (size_t)(M * 16) * 4);
  return tiles_pv;
}
QKV_STEP void fwd_acc_from_tiles(const Problem& P, int64_t M, FwdBufs& w) {
  for (int64_t x = 0; x < M * P.Dvp; ++x) w.acc[x] = (double)w.bf16.accf[x];
}

// Key tile e of the item's row: its place, its K operand (bfloat16: the call's store of pairs;
// else packed in the worker's store, or its rows read in place or loaded for decoding), its V
// operand (floats unless the tiles add this P·V from the store's pairs), and its columns'
// dropout hashes
QKV_STEP FwdTile fwd_tile_operands(const Problem& P, const FwdPlan& F, const FwdItem& it,
                                   int64_t e, bool tiles_pv, FwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t b = it.b, hkv = it.hkv, Dp = P.Dp, Dvp = P.Dvp;
  FwdTile t;
  t.j = L.col_idx[e];
  t.code = L.code[e];
  t.c0 = tile_c0(P, t.j);
  t.kw = tile_kw(P, t.j);
  t.edge = t.kw == BK ? ~0ull : ((1ull << t.kw) - 1);
  t.krows = w.kr;
  t.ldk = Dp;
  w.tile.kpairs = w.tile.vpairs = nullptr;
  const bool pairs = fwd_pair_tile(P, F, b, hkv, t.j, t.c0, t.kw, w);
  if (pairs) {
    // K's pairs only: the bfloat16 scores read no float K (no exact rows, no key norms)
  } else if (!P.dot_scores) {
    const bool whole = P.dtype == DT_F32 && t.kw == BK && P.D == Dp;  // kt from the tensor, no kr
    fwd_key_tile(P, F, b, hkv, t.j, t.c0, t.kw, !whole && P.precise_scores, w,
                 it.e1 - it.e0 <= KT_SLOTS);
    if (whole) {
      t.krows = (const float*)row_of(P.k, P.dtype, b, hkv, t.c0);
      t.ldk = P.k.sn;
    }
  } else if (P.dtype == DT_F32) {
    t.krows = (const float*)row_of(P.k, P.dtype, b, hkv, t.c0);
    t.ldk = P.k.sn;
  } else {
    for (int64_t jj = 0; jj < t.kw; ++jj)
      load_row(row_of(P.k, P.dtype, b, hkv, t.c0 + jj), P.dtype, P.D, Dp, w.kr + jj * Dp);
  }
  if (tiles_pv && w.tile.vpairs) {
    t.vb = nullptr;  // (its finiteness is known: tile_v_finite reads no row)
    t.ldv = Dvp;
  } else if (P.dtype == DT_F32 && P.Dv == Dvp && t.kw == BK) {
    t.vb = (const float*)row_of(P.v, P.dtype, b, hkv, t.c0);
    t.ldv = P.v.sn;
  } else {
    w.tile.vpairs = nullptr;
    pack_v(P, b, hkv, t.c0, t.kw, w, false, nullptr);
    t.vb = w.vr;
    t.ldv = Dvp;
  }
  if (P.drop.on) drop_col_hash(P.drop, t.c0, w.colh);
  return t;
}

// The tile's scores of the item's rows, into w.s (and the exact rows' low parts, w.slo). Rows in
// groups of 16 (PARTIAL tiles): a group computes only the span of 16-key chunks that some row of
// it may attend (the corner of a band or a segment); the other scores are never read (the bits
// select −inf there) and the other chunks' P·V terms would be exact zeros.
QKV_STEP void fwd_tile_scores(const Problem& P, int64_t M, FwdTile& t, FwdBufs& w) {
  const bool stream = P.dot_scores && P.dtype == DT_F32 && t.vb != w.vr;  // K, V read in place
  const int64_t n_chains = (t.kw + 15) / 16;
  t.gs = t.code != TILE_FULL && !P.dot_scores ? group_spans(P, t.code, t.edge, n_chains, M, w) : M;
  if (t.gs == M) {
    w.glo[0] = 0;
    w.ghi[0] = (int8_t)(n_chains - 1);
    tile_scores(P, M, w.q, w.q64, P.Dp, t.krows, t.ldk, t.kw, w, stream ? t.vb : nullptr, t.ldv);
  } else {
    for (int64_t R0 = 0; R0 < M; R0 += t.gs) {
      const int64_t lo = w.glo[R0 / t.gs], hi = w.ghi[R0 / t.gs];
      if (lo <= hi) block_scores(P, w, R0, imin(t.gs, M - R0), lo, 16 * (hi - lo + 1));
    }
  }
  exact_rows(P, M, t.krows, t.ldk, t.kw, w);
}

// P of row R, keys 16q … 16q+31 (q even), as the tiles read it (rounded to bfloat16) or as floats
QKV_STEP void fwd_put_p(FwdBufs& w, bool tiles_p, int64_t R, int64_t q, V16 x0, V16 x1) {
  if (tiles_p) {
    tile_put_p(x0, x1, w.bf16.pa, R, q);
  } else {
    v_store(w.p + R * BK + 16 * q, x0);
    v_store(w.p + R * BK + 16 * q + 16, x1);
  }
}

// The online softmax of the tile's rows: each row's scores modified and masked, its maximum
// moved, P = exp(t − m') (dropped and rescaled), l = l·α + rowsum P and α = e^(m − m') kept for
// P·V (w.alpha)
QKV_STEP void fwd_softmax_rows(const Problem& P, int64_t M, const FwdTile& t, bool tiles_p,
                               FwdBufs& w) {
  const Layout& L = P.lay;
  const int64_t code_stride = L.bm * L.hm * L.bq;
  const V16 keep_scale = v_set(P.drop.keep_scale), zero = v_set(0.0f);
  for (int64_t R = 0; R < M; ++R) {
    float* srow = w.s + R * BK;
    const float* lorow = lo_row(P, w, R);
    const uint64_t allowed =
        t.code == TILE_FULL ? t.edge : L.bits[t.code * code_stride + w.bitoff[R]];
    w.alpha[R] = 1.0;
    if (allowed == 0) {
      fwd_put_p(w, tiles_p, R, 0, zero, zero);
      fwd_put_p(w, tiles_p, R, 2, zero, zero);
      continue;
    }
    row_scores(P.mods, w.slope[R], w.qpos[R], t.c0, allowed, srow, srow, nullptr);
    V16 mx = v_max(v_max(v_load(srow), v_load(srow + 16)),
                   v_max(v_load(srow + 32), v_load(srow + 48)));
    // the row's maximum moves only where some score exceeds it: the horizontal maximum is
    // formed only then (after a row's first tiles, rarely)
    const float mold = w.mrow[R];
    float mnew = mold;
    if (v_any_gt(mx, mold)) {
      const float tmax = v_hmax(mx);
      mnew = tmax > mold ? tmax : mold;
    }
    if (mnew == NEG_INF) {
      // nothing above −inf: an empty row so far, unless an allowed score is NaN (a NaN in
      // q or k, which the maxima above pass over): that row is NaN, as in the formula
      if (!has_nan(srow)) {
        fwd_put_p(w, tiles_p, R, 0, zero, zero);
        fwd_put_p(w, tiles_p, R, 2, zero, zero);
        continue;
      }
      mnew = __builtin_nanf("");
    }
    const V16 mv = v_set(mnew);
    V16 sum = zero, ev[4];
    for (int64_t q = 0; q < 4; ++q) {
      ev[q] = exp_scores(srow, lorow, q, mv);
      sum = v_add(sum, ev[q]);
      if (P.drop.on)
        ev[q] = v_select(drop_keep(P.drop, w.rowh[R], w.colh + 16 * q), v_mul(ev[q], keep_scale),
                         zero);
    }
    fwd_put_p(w, tiles_p, R, 0, ev[0], ev[1]);
    fwd_put_p(w, tiles_p, R, 2, ev[2], ev[3]);
    const double alpha =
        mold == mnew ? 1.0 : (mold == NEG_INF ? 0.0 : __builtin_exp((double)mold - (double)mnew));
    if (on_tiles(P)) {
      const V16 lr = v_load(w.bf16.lv + 16 * R);
      v_store(w.bf16.lv + 16 * R,
              alpha == 1.0 ? v_add(lr, sum) : v_fma(lr, v_set((float)alpha), sum));
    } else {
      w.l[R] = w.l[R] * alpha + (double)v_hsum(sum);
    }
    w.mrow[R] = mnew;
    w.alpha[R] = alpha;
  }
}

// acc = acc·α + P V: on the tiles while they hold the accumulator and V is finite (tiles_pv, the
// item's state, turns off for good at the first V that is not), else in float chains of PV_CHAIN
// keys (a whole tile; 16 portable) summed in double, zero-skipping where V is not finite
QKV_STEP void fwd_pv(const Problem& P, int64_t M, const FwdTile& t, bool& tiles_pv, FwdBufs& w) {
  const int64_t Dvp = P.Dvp, gs = t.gs;
  if (tiles_pv && t.v_finite) {  // the tiles add P V over the whole tile (P = 0 outside the spans)
    tile_pv(M, Dvp, t.kw, w.bf16.pa, t.vb, t.ldv, w.tile.vpairs, w.bf16.accf, Dvp, w.alpha);
    return;
  }
  if (tiles_pv) {  // from here on the float kernels, which skip P = 0 exactly
    fwd_acc_from_tiles(P, M, w);
    tiles_pv = false;
  }
  for (int64_t R0 = 0; R0 < M; R0 += gs) {
    const int64_t gm = imin(gs, M - R0), lo = w.glo[R0 / gs], hi = w.ghi[R0 / gs];
    if (lo > hi) continue;  // no row of the group attends here: acc unchanged (α = 1)
    const int64_t k0 = 16 * lo, k1 = imin(t.kw, 16 * (hi + 1));
    if (t.v_finite) {  // the micro-kernel adds the chains' sum straight into acc
      gemm_chain(gm, Dvp, k1 - k0, w.p + R0 * BK + k0, BK, t.vb + k0 * t.ldv, t.ldv, nullptr, Dvp,
                 0.0, w.acc + R0 * Dvp, w.alpha + R0);
      continue;
    }
    int64_t nc = 0;  // the same chains, from the same first key, in w.o
    for (int64_t c0 = k0; c0 < k1; c0 += PV_CHAIN, ++nc)
      gemm_zero_safe(gm, Dvp, imin(PV_CHAIN, k1 - c0), w.p + R0 * BK + c0, BK, 1, t.vb + c0 * t.ldv,
                     t.ldv, w.o + nc * M * Dvp + R0 * Dvp, Dvp);
    for (int64_t R = R0; R < R0 + gm; ++R)
      acc_chains(w.acc + R * Dvp, w.o + R * Dvp, M * Dvp, nc, w.alpha[R], Dvp);
  }
}

// The accumulators brought home: acc from the tiles, l from its 16 lanes
QKV_STEP void fwd_end_acc(const Problem& P, int64_t M, bool tiles_pv, FwdBufs& w) {
  if (tiles_pv) fwd_acc_from_tiles(P, M, w);
  if (on_tiles(P))
    for (int64_t R = 0; R < M; ++R) {
      double l = 0.0;
      for (int64_t x = 0; x < 16; ++x) l += (double)w.bf16.lv[16 * R + x];
      w.l[R] = l;
    }
}

// All splits of a long row of tiles merged, in split order, into the item's (m, l, acc)
QKV_STEP void fwd_merge_splits(const Problem& P, const FwdPlan& F, int64_t key, int64_t M,
                               FwdBufs& w) {
  const int64_t Dvp = P.Dvp, mm = F.mmax, first = F.part_base[key];
  const int32_t nsplit = F.nsplit[key];
  for (int64_t R = 0; R < M; ++R) {
    float mstar = NEG_INF;
    for (int64_t s = 0; s < nsplit; ++s) {
      const float ms = F.part_m[(first + s) * mm + R];
      mstar = ms > mstar || ms != ms ? ms : mstar;  // a NaN row max (see above) is kept
      if (mstar != mstar) break;
    }
    double lsum = 0.0;
    double* acc = w.acc + R * Dvp;
    for (int64_t d = 0; d < Dvp; ++d) acc[d] = 0.0;
    if (mstar != NEG_INF) {
      for (int64_t s = 0; s < nsplit; ++s) {
        const float ms = F.part_m[(first + s) * mm + R];
        if (ms == NEG_INF) continue;
        const double wgt = __builtin_exp((double)ms - (double)mstar);
        lsum += F.part_l[(first + s) * mm + R] * wgt;
        const double* pa = F.part_acc + ((first + s) * mm + R) * Dvp;
        for (int64_t d = 0; d < Dvp; ++d) acc[d] += pa[d] * wgt;
      }
    }
    w.mrow[R] = mstar;
    w.l[R] = lsum;
  }
}

// The item's rows written (out, m, l, lse); for one split of a long row of tiles, its partial
// (m, l, acc) stored instead, and the last split to finish merges all of them and writes
QKV_STEP void fwd_write_rows(const Problem& P, const FwdPlan& F, const FwdItem& it,
                             const FwdRows& x, FwdBufs& w) {
  const int64_t Dvp = P.Dvp, M = x.M;
  const int64_t key = (x.b * P.Hkv + x.hkv) * P.lay.nqb + x.i;
  const int32_t nsplit = F.nsplit[key];
  if (nsplit <= 1) {
    finish_rows(P, x.b, x.hkv, x.r0, x.nr, w.mrow, w.l, w.acc, Dvp, w.tmp);
    return;
  }
  const int64_t slot = F.part_base[key] + it.split, mm = F.mmax;
  __builtin_memcpy(F.part_m + slot * mm, w.mrow, (size_t)M * 4);
  __builtin_memcpy(F.part_l + slot * mm, w.l, (size_t)M * 8);
  __builtin_memcpy(F.part_acc + slot * mm * Dvp, w.acc, (size_t)(M * Dvp) * 8);
  if (__atomic_fetch_add(&F.done[key], 1, __ATOMIC_ACQ_REL) + 1 != nsplit) return;
  fwd_merge_splits(P, F, key, M, w);
  finish_rows(P, x.b, x.hkv, x.r0, x.nr, w.mrow, w.l, w.acc, Dvp, w.tmp);
}

static void fwd_item(const Problem& P, const FwdPlan& F, const FwdItem& it, FwdBufs& w) {
  const int64_t r0 = tile_r0(P, it.i), nr = tile_nr(P, it.i);
  const FwdRows x{it.b, it.hkv, it.i, r0, nr, P.G * nr};
  fwd_load_rows(P, x, w);
  fwd_pack_rows(P, x.M, w);
  bool tiles_pv = fwd_start_acc(P, x.M, w);
  for (int64_t e = it.e0; e < it.e1; ++e) {
    FwdTile t = fwd_tile_operands(P, F, it, e, tiles_pv, w);
    fwd_tile_scores(P, x.M, t, w);
    t.v_finite = tile_v_finite(P, F, it.b, it.hkv, t.j, t.vb, t.kw, t.ldv);
    fwd_softmax_rows(P, x.M, t, tiles_pv && t.v_finite, w);
    fwd_pv(P, x.M, t, tiles_pv, w);
  }
  fwd_end_acc(P, x.M, tiles_pv, w);
  fwd_write_rows(P, F, it, x, w);
}

static void forward_worker(const Problem& P, const FwdPlan& F, ItemQueue* items, int32_t* error) {
  FwdBufs w;
  if (!fwd_alloc(w, P, F.mmax)) {
    fwd_free(w);
    return fail(error);
  }
  take_items(items, error, [&](int64_t k) {
    fwd_item(P, F, F.items[k], w);
    return true;
  });
  if (P.stream_out) stream_fence();  // the output's non-temporal stores, before the call returns
  fwd_free(w);
}
