// K and V tiles as the products read them: rows, transposed, in double, and (float32 scores on
// the tile unit) in three bfloat16 parts; the forward's store of packed key tiles. Part of
// kernel.h (compiled once per ISA).

// K rows c0 … c0+kw−1 of (b, hkv) → kr (64 × Dp, zero rows past kw) and kt = krᵀ (Dp × 64).
// Without `need_kr` (the forward), a whole float32 tile is transposed from the tensor itself.
static void pack_k(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw,
                   StepBufs& w, bool sanitize, bool need_kr) {
  const int64_t Dp = P.Dp;
  if (!need_kr && !sanitize && P.dtype == DT_F32 && kw == BK && P.D == Dp) {
    const float* src = (const float*)row_of(P.k, P.dtype, b, hkv, c0);
    for (int64_t d0 = 0; d0 < Dp; d0 += 16)
      for (int64_t j0 = 0; j0 < BK; j0 += 16)
        transpose16(src + j0 * P.k.sn + d0, P.k.sn, w.kt + d0 * BK + j0, BK);
    return;
  }
  for (int64_t j = 0; j < kw; ++j) {
    float* dst = w.kr + j * Dp;
    load_row(row_of(P.k, P.dtype, b, hkv, c0 + j), P.dtype, P.D, Dp, dst);
    if (sanitize) sanitize_row(dst, P.D);
  }
  for (int64_t j = kw; j < BK; ++j)
    for (int64_t d = 0; d < Dp; ++d) w.kr[j * Dp + d] = 0.0f;
  for (int64_t d0 = 0; d0 < Dp; d0 += 16)
    for (int64_t j0 = 0; j0 < BK; j0 += 16) transpose16(w.kr + j0 * Dp + d0, Dp, w.kt + d0 * BK + j0, BK);
}

// V rows → vr (kw × Dvp, zero-padded columns); with vt (the backward's) also vt = vrᵀ (Dvp × 64)
static void pack_v(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw,
                   StepBufs& w, bool sanitize, float* vt) {
  const int64_t Dvp = P.Dvp;
  for (int64_t j = 0; j < kw; ++j) {
    float* dst = w.vr + j * Dvp;
    load_row(row_of(P.v, P.dtype, b, hkv, c0 + j), P.dtype, P.Dv, Dvp, dst);
    if (sanitize) sanitize_row(dst, P.Dv);
  }
  if (!vt) return;
  for (int64_t j = kw; j < BK; ++j)
    for (int64_t d = 0; d < Dvp; ++d) w.vr[j * Dvp + d] = 0.0f;
  for (int64_t d0 = 0; d0 < Dvp; d0 += 16)
    for (int64_t j0 = 0; j0 < BK; j0 += 16)
      transpose16(w.vr + j0 * Dvp + d0, Dvp, vt + d0 * BK + j0, BK);
}

// the largest |k_j| of a packed key tile kt (Dp × BK, columns j < kw), non-finite entries
// read as 0 (as the backward's sanitized copy holds them): the same value from both passes
static double key_norm_max(const Problem& P, const float* kt, int64_t kw) {
  const V16 zero = v_set(0.0f);
  V16 acc[4] = {zero, zero, zero, zero};
  for (int64_t d = 0; d < P.D; ++d)
    for (int64_t q = 0; q < 4; ++q) {
      const V16 x = v_load(kt + d * BK + 16 * q);
      acc[q] = v_add(acc[q], v_select(v_finite(x), v_mul(x, x), zero));
    }
  float sq[BK];
  for (int64_t q = 0; q < 4; ++q) v_store(sq + 16 * q, acc[q]);
  float mx = 0.0f;
  for (int64_t j = 0; j < kw; ++j) mx = sq[j] > mx ? sq[j] : mx;
  return __builtin_sqrt((double)mx);
}

// The call's store of packed key tiles (FwdPlan.kparts), one entry per (b, hkv, key tile), packed
// by the first item that reaches the tile and read by the others:
// - float32 scores on the tile unit: the key tile's three parts, where the rows of tiles are on
//   average longer than a worker's slots (dense, causal): there every item packed every key tile
//   of its row afresh (the transposition, the norms and the split: a visible share of the dense
//   forward's time);
// - bfloat16 on the tile unit or the dot-product instruction (fwd_pairs_on): K as the scores' B
//   blocks and V as P·V's, where a key tile is read by two items or more on average: packing
//   them per item (bfloat16 → float → pairs) took a large share of the amx path's dense
//   forward (both measured: docs/cpu.md, Measurements behind the code).
// Up to KSHARE_MAX_BYTES (dense N = 4096, H = 8, D = 64: 12 MiB of parts, 8 MiB of pairs), so
// that long sparse rows (the Longformer's memory) are not charged.
constexpr int64_t KSHARE_MAX_BYTES = int64_t(64) << 20;
static inline bool fwd_pairs_on(const Problem& P) {
  return on_tiles(P) && !P.dot_scores && P.D <= TILE_K_MAX && P.Dvp <= TILE_PV_N;
}
static inline int64_t fwd_pair_elems(const Problem& P) {  // K's blocks, then V's
  return tile_b_elems(P.D, 4) + tile_b_elems(BK, P.Dvp / 16);
}
static int64_t fwd_share_elems(const Problem& P) {
  const Layout& L = P.lay;
  const int64_t tiles = P.B * P.Hkv * L.nkb, kept = fwd_kept(L);
  int64_t elems = 0;
  if (scores_on_tiles(P) && P.D == P.Dp && kept > KT_SLOTS * L.nqb)
    elems = tiles * tile_b3_elems(P.D);
  else if (fwd_pairs_on(P) && kept >= 2 * L.nkb)
    elems = tiles * fwd_pair_elems(P);
  return elems * 4 <= KSHARE_MAX_BYTES ? elems : 0;
}

// whether V tile j of (b, hkv) is all finite: computed by the first item that reads it, then
// remembered for the call (a benign race: every writer stores the same value)
static inline bool tile_v_finite(const Problem& P, const FwdPlan& F, int64_t b, int64_t hkv,
                                 int64_t j, const float* vb, int64_t kw, int64_t ldv) {
  int8_t* flag = F.v_finite + (b * P.Hkv + hkv) * P.lay.nkb + j;
  int8_t known = __atomic_load_n(flag, __ATOMIC_RELAXED);
  if (known == V_TILE_UNKNOWN) {
    known = rows_finite(vb, kw, ldv, P.Dvp) ? V_TILE_FINITE : V_TILE_NONFINITE;
    __atomic_store_n(flag, known, __ATOMIC_RELAXED);
  }
  return known == V_TILE_FINITE;
}

// bfloat16 (fwd_pairs_on, with the call's store): point w.tile.kpairs at key tile j's K blocks
// and w.tile.vpairs at its V blocks (null where V is not all finite: the float kernels add that
// P·V), packed by the first item to reach the tile, which also records V's finiteness
// (F.v_finite). False where the tile is not whole or another item is packing it (the caller
// packs its own operands then, as without the store).
static bool fwd_pair_tile(const Problem& P, const FwdPlan& F, int64_t b, int64_t hkv, int64_t j,
                          int64_t c0, int64_t kw, FwdBufs& w) {
  if (!F.kparts || !fwd_pairs_on(P) || kw != BK) return false;
  const int64_t tag = (b * P.Hkv + hkv) * P.lay.nkb + j;
  int32_t* state = F.kstate + tag;
  uint32_t* kp = F.kparts + tag * fwd_pair_elems(P);
  uint32_t* vp = kp + tile_b_elems(P.D, 4);
  int32_t st = __atomic_load_n(state, __ATOMIC_ACQUIRE), idle = KEY_TILE_IDLE;
  if (st == KEY_TILE_IDLE && __atomic_compare_exchange_n(state, &idle, KEY_TILE_PACKING, false,
                                                         __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    w.kt = w.keys.kt;  // slot 0, which then holds no tile of its own
    w.keys.tag[0] = -1;
    pack_k(P, b, hkv, c0, kw, w, false, false);
    pack_b_blocks(w.kt, BK, P.D, 4, 4, kp);
    pack_v(P, b, hkv, c0, kw, w, false, nullptr);
    pack_b_blocks(w.vr, P.Dvp, kw, P.Dvp / 16, P.Dvp / 16, vp);
    tile_v_finite(P, F, b, hkv, j, w.vr, kw, P.Dvp);  // known before the tile is published
    __atomic_store_n(state, KEY_TILE_READY, __ATOMIC_RELEASE);
    st = KEY_TILE_READY;
  }
  if (st != KEY_TILE_READY) return false;
  w.tile.kpairs = kp;
  w.tile.vpairs = tile_v_finite(P, F, b, hkv, j, nullptr, kw, P.Dvp) ? vp : nullptr;
  return true;
}

// key tile j (rows c0 …) into w.kt, its largest key norm into *kmax and its three parts (scores
// on the tiles) into parts; the keys the split cannot carry into *kbad
static void pack_key_tile(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw,
                          StepBufs& w, uint32_t* parts, double* kmax, uint64_t* kbad) {
  pack_k(P, b, hkv, c0, kw, w, false, false);
  *kmax = P.precise_scores ? key_norm_max(P, w.kt, kw) : 0.0;
  if (scores_on_tiles(P)) *kbad = tile_pack_keys3(P.D, w.kt, BK, parts);
}

// Point w.kt at key tile j of (b, hkv), packed, and set w.kmax (precise scores). With `need_kr`
// (exact rows read the tile's rows from w.kr) the tile is packed afresh and its slot not kept.
// Without `keep` (an item whose row spans more tiles than the slots: walked in order, each tile
// would leave its slot before the next item came back to it) every tile is packed into slot 0,
// which stays in L1, instead of cycling through 16 slots' 256 KB (a little faster, measured:
// docs/cpu.md, Measurements behind the code); with the call's store (F.kparts) the first
// item to reach a tile packs its parts there and the others read them (w.kt, then, holds the
// tile only where gemm_chain needs it: keys or rows the split cannot carry).
static void fwd_key_tile(const Problem& P, const FwdPlan& F, int64_t b, int64_t hkv, int64_t j,
                         int64_t c0, int64_t kw, bool need_kr, FwdBufs& w, bool keep = true) {
  KeyTileStore& s = w.keys;
  const int64_t tag = (b * P.Hkv + hkv) * P.lay.nkb + j, slot = keep ? j % KT_SLOTS : 0;
  w.kt = s.kt + slot * P.Dp * BK;
  if (F.kparts && scores_on_tiles(P) && !keep && !need_kr && kw == BK) {
    int32_t* state = F.kstate + tag;
    int32_t st = __atomic_load_n(state, __ATOMIC_ACQUIRE), idle = KEY_TILE_IDLE;
    uint32_t* parts = F.kparts + tag * tile_b3_elems(P.D);
    // slot 0's kt, rewritten here, no longer matches its parts: s.slot0 names the tile it holds
    if (st == KEY_TILE_IDLE && __atomic_compare_exchange_n(state, &idle, KEY_TILE_PACKING, false,
                                                           __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      pack_key_tile(P, b, hkv, c0, kw, w, parts, F.kmaxv + tag, F.kbadv + tag);
      s.tag[slot] = -1;
      s.slot0 = tag;
      __atomic_store_n(state, KEY_TILE_READY, __ATOMIC_RELEASE);
      st = KEY_TILE_READY;
    }
    if (st == KEY_TILE_READY) {  // (another item packing it: this one packs its own below)
      w.tile.kb = parts;
      w.tile.kbad = F.kbadv[tag];
      w.kmax = F.kmaxv[tag];
      if ((w.tile.kbad || w.tile.qbad_any) && s.slot0 != tag) {
        pack_k(P, b, hkv, c0, kw, w, false, false);
        s.tag[slot] = -1;
        s.slot0 = tag;
      }
      return;
    }
  }
  if (slot == 0) s.slot0 = -1;
  if (s.tag[slot] != tag) {
    const bool parts = scores_on_tiles(P);
    pack_key_tile(P, b, hkv, c0, kw, w, parts ? s.parts + slot * tile_b3_elems(P.D) : nullptr,
                  s.kmax + slot, parts ? s.bad + slot : nullptr);
    s.tag[slot] = need_kr || !keep ? -1 : tag;
  }
  w.kmax = s.kmax[slot];
  if (scores_on_tiles(P)) {
    w.tile.kb = s.parts + slot * tile_b3_elems(P.D);
    w.tile.kbad = s.bad[slot];
  }
}

// K_j, V_j of (b, hkv) as the backward reads them: rows and transposed (Vᵀ in double only where
// dP needs it, dp_operands), and the dropout hashes of their columns.
static inline void bwd_pack(const Problem& P, int64_t b, int64_t hkv, int64_t c0, int64_t kw,
                            BwdBufs& w) {
  pack_k(P, b, hkv, c0, kw, w, true, true);
  pack_v(P, b, hkv, c0, kw, w, true, w.vt);
  if (P.precise_scores && !P.dot_scores) w.kmax = key_norm_max(P, w.kt, kw);
  if (scores_on_tiles(P)) w.tile.kbad = tile_pack_keys3(P.D, w.kt, BK, w.tile.kb);
  if (w.f32.vb3) w.f32.vbad = tile_pack_keys3(P.Dv, w.vt, BK, w.f32.vb3);
  if (P.drop.on) drop_col_hash(P.drop, c0, w.colh);
}
