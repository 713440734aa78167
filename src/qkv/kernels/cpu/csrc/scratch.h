// Each worker's buffers, by pass. Part of kernel.h (compiled once per ISA).
//
//     StepBufs   both passes: a tile step's rows, the packed K and V tile, the scores, and the
//                tile unit's operands of the scores (TileOperands)
//     FwdBufs    the forward's own: the running (m, l) and accumulator, the key-tile store
//                (KeyTileStore) and the bfloat16 tile unit's P·V (FwdBf16)
//     BwdBufs    the backward's own (column and row pass): dO, dP, dS, dK, dV and the live dQ
//                tiles, the bfloat16 tile unit's operands (BwdBf16) and the float32 one's
//                (BwdF32)
//
// A worker allocates its pass's buffers once, as one block (carve_block), and frees them when
// its part of the call ends; the backward grows its pool and caches as its items need
// (bwd_reserve). `rows`: the most rows a tile step handles (forward G·bq, backward bq, its row
// pass G·bq).

// The tile unit's operands of a step's scores (amx, avx512bf16; unused on the other paths): the
// step's rows as A tiles (bfloat16: one part, tile_pack_rows; float32: three, tile_pack_rows3)
// and the key tile's blocks (float32: three parts, tile_pack_keys3; bfloat16: pairs).
struct TileOperands {
  uint16_t* qa;    // the rows as A tiles
  bool qa_on;      // qa holds the rows of w.q (packed once per forward item or backward query
                   // tile; else block_scores packs them)
  bool qa_scaled;  // bfloat16: … times the scale (a power of two)
  int8_t* qbad;    // float32: rows of qa the split cannot carry (gemm_chain forms them)
  bool qbad_any;   // … some row of the forward's item
  uint32_t* kb;    // float32: the key tile's parts (the forward's: in its slot of the store)
  uint64_t kbad;   // … its keys the split cannot carry (gemm_chain forms them)
  // bfloat16, the forward: the key tile's K and V as B blocks from the call's store
  // (fwd_pair_tile), or null (the products pack them)
  const uint32_t *kpairs, *vpairs;
};

// Both passes: one tile step
struct StepBufs {
  char* base;  // the block every pointer below (and the pass's own) is carved from
  float *q, *kr, *kt, *vr;  // the rows (ld Dp); the key tile's rows and transposed; V's rows
  float *s, *p, *o, *tmp;   // scores, weights, the products' scratch, a row to store
  float* slo;    // the scores' low parts (score_lo; finite: zeroed here, written finite)
  float *mrow, *slope;
  int64_t *qpos, *bitoff;
  uint32_t *rowh, *colh;  // the dropout hashes of the rows and of the key tile's columns
  double* q64;    // precise scores (float32 inputs): Q in double (decoding, exact rows)
  double* qn;     // precise scores: |q| of each row (exact_rows)
  double kmax;    // precise scores: the largest |k| of the packed key tile (exact_rows)
  int8_t* exact;  // per row: this tile's scores formed exactly, with their low parts in slo
  TileOperands tile;
};

// The forward's items of one (b, kv head) come in order of their query tiles (plan_forward), so
// a worker's next item reads most of the key tiles its last one read (a band: all but a few).
// Each worker keeps its last packed key tiles, slot j mod KT_SLOTS, and packs a tile only when
// its slot holds another: the same bits, a transposition (and a key_norm_max) saved per hit.
constexpr int64_t KT_SLOTS = 16;
struct KeyTileStore {
  float* kt;        // KT_SLOTS packed key tiles (w.kt points at one of them)
  int64_t* tag;     // which key tile each slot holds, −1 none
  double* kmax;     // each slot's key_norm_max
  int64_t slot0;    // with the call's store (FwdPlan.kparts): the tile slot 0's kt holds, or −1
  uint32_t* parts;  // float32 on the tile unit: each slot's parts
  uint64_t* bad;    // … and its keys the split cannot carry
};

// The forward's P·V of bfloat16 inputs on the tile unit
struct FwdBf16 {
  float* accf;   // the P·V accumulator (rows padded to 16)
  uint16_t* pa;  // P as A tiles (tile_put_p)
  float* lv;     // the row sums l, 16 lanes a row
};

struct FwdBufs : StepBufs {
  double *l, *alpha, *acc;  // the running denominators, rescalings and accumulator (ld Dvp)
  int8_t *glo, *ghi;  // the first and last 16-key chunk each group of 16 rows computes
  KeyTileStore keys;
  FwdBf16 bf16;
};

// The backward's products of bfloat16 inputs on the tile unit
struct BwdBf16 {
  uint32_t *pb, *dsb;  // P and dS of a step's rows as B blocks over the rows (tile_put_pair)
  uint16_t* dsa;       // … dS as A tiles (tile_put_p)
  // the column's Kᵀ (the scores), Vᵀ (dP) and K (dQ) as B blocks, packed once per column
  uint32_t *kt_pairs, *vt_pairs, *k_pairs;
  // The backward walks key columns outer: a query tile's rows of one head, packed as the
  // products read them (RowPacks: Q's and dO's rows as A tiles and as B blocks) at the tile's
  // first column of a chunk, in an entry of this cache (per pool slot and head of the group),
  // and read by the others
  uint16_t* rows;
  int8_t* state;     // each entry's: 1 packed, 0 not yet
  int64_t rows_cap;  // entries
};

// The backward walks key columns outer: the three-part split (tile_pack_rows3) of a query tile's
// rows is made at the tile's first column of a chunk, in an entry of such a cache, and read by
// the others. Each entry's state is a PartsState (PARTS_EMPTY is 0: a zeroed state is empty).
enum PartsState : int8_t { PARTS_EMPTY = 0, PARTS_PACKED = 1, PARTS_PACKED_BAD_ROW = 2 };
struct PartsCache {
  uint16_t* parts;  // entry e at parts + e · (its elements)
  int8_t* bad;      // entry e's rows the split cannot carry, at bad + e · bq
  int8_t* state;    // entry e's PartsState
};

// The backward's float32 scores and dP on the tile unit
struct BwdF32 {
  PartsCache qc, dc;  // Q's rows' parts (the scores) and dO's (dP = dO Vᵀ), per pool slot and
                      // head of the group
  int64_t parts_cap;  // entries of each
  uint32_t* vb3;      // the V tile's parts (tile_pack_keys3), dP's; null where Dv is too deep
  uint64_t vbad;      // … its keys the split cannot carry (the tile's dP then on AVX-512)
};

struct BwdBufs : StepBufs {
  float *vt, *ds, *dfac, *dO;  // Vᵀ; dS and dt/dx (softcap) of the rows; dO's rows (ld Dvp)
  double *delta, *inv_l;        // per row: Δ, 1/l
  double *dk64, *dv64;          // dK_j, dV_j of the column (a pass of all the group's heads;
                                // bfloat16 on the tiles: dKᵀ_j, dVᵀ_j in float, in their memory)
  double *vt64, *dO64, *dp64;   // Vᵀ, dO and dP in double (dP's sums are exact)
  double* dq_sum;               // a query tile's dQ partials summed (flush_dq)
  double* dq_wide;              // bfloat16 on the tiles: a pool slot's float dQ widened to double
  double *sum_p, *sum_pdp;      // the row pass: Σ_j P_ij and Σ_j P_ij dP̃_ij per row
  double* pool;                 // live dQ tiles (bfloat16 on the tiles: in float until flushed)
  int64_t pool_cap;
  double* dkv;  // passes of a few heads: dK_j and dV_j of each column of the chunk
  int64_t dkv_cap;
  int32_t *slot_of, *free_slots;  // the pool slot of each touched query tile; the free ones
  int64_t slot_cap;
  BwdBf16 bf16;
  BwdF32 f32;
};

// One block for a pass's buffers: `lay(c)` takes each buffer from a Carver c, once to count the
// bytes (c.cur null) and once to carve them, every buffer 64-byte aligned.
struct Carver {
  char* cur;
  int64_t bytes;
  template <class T>
  void take(T*& ptr, int64_t n) {
    ptr = cur ? (T*)(cur + bytes) : nullptr;
    bytes += ((int64_t)sizeof(T) * n + 63) & ~int64_t(63);
  }
  template <class... T>
  void take_each(int64_t n, T*&... ptrs) {  // buffers of n elements each, in order
    (take(ptrs, n), ...);
  }
};
template <class Lay>
static char* carve_block(const Lay& lay) {
  Carver count{nullptr, 0};
  lay(count);
  char* base = (char*)alloc64(count.bytes);
  if (!base) return nullptr;
  Carver carve{base, 0};
  lay(carve);
  return base;
}

// StepBufs' buffers for R rows: taken from c, and (once carved) initialised
static void step_take(Carver& c, StepBufs& w, const Problem& P, int64_t R) {
  const int64_t Dp = P.Dp, Dvp = P.Dvp, Dm = imax(Dp, Dvp);
  c.take_each(R * Dp, w.q, w.q64);
  c.take_each(BK * Dp, w.kr, w.kt);
  c.take(w.vr, BK * Dvp);
  c.take_each(R * BK, w.s, w.slo, w.p);
  c.take(w.o, imax(4 * R, BK) * Dm);
  c.take(w.tmp, Dm + 16);
  c.take_each(R, w.mrow, w.slope, w.qpos, w.bitoff, w.rowh, w.qn, w.exact, w.tile.qbad);
  c.take(w.colh, BK);
  c.take(w.tile.qa, on_tiles(P)          ? tile_a_elems(R, P.D)
                    : scores_on_tiles(P) ? tile_a3_elems(R, P.D)
                                         : 0);
}
static void step_init(StepBufs& w, int64_t R) {
  __builtin_memset(w.slo, 0, (size_t)(R * BK) * 4);
  __builtin_memset(w.exact, 0, (size_t)R);
  w.tile.qa_on = w.tile.qa_scaled = w.tile.qbad_any = false;
  w.tile.kbad = 0;
  w.tile.kpairs = w.tile.vpairs = nullptr;
}

// The forward's buffers (rows: G·bq); the key-tile store where the scores use packed key tiles
static bool fwd_alloc(FwdBufs& w, const Problem& P, int64_t rows) {
  const int64_t R = imax(rows, 1), Dvp = P.Dvp, Dm = imax(P.Dp, Dvp), R16 = (R + 15) / 16 * 16;
  w.keys = KeyTileStore{nullptr, nullptr, nullptr, -1, nullptr, nullptr};
  w.base = carve_block([&](Carver& c) {
    step_take(c, w, P, R);
    c.take_each(R, w.l, w.alpha, w.glo, w.ghi);
    c.take(w.acc, R * Dm);
    c.take(w.bf16.accf, on_tiles(P) ? R16 * Dvp : 0);
    c.take(w.bf16.lv, on_tiles(P) ? R * 16 : 0);
    c.take(w.bf16.pa, on_tiles(P) ? R16 * BK : 0);
  });
  if (!w.base) return false;
  step_init(w, R);
  w.tile.kb = nullptr;  // points into the store (fwd_key_tile)
  if (P.dot_scores) return true;  // decoding reads K in place: no packed key tiles
  KeyTileStore& s = w.keys;
  s.kt = (float*)alloc64(KT_SLOTS * P.Dp * BK * 4);
  s.tag = (int64_t*)malloc(KT_SLOTS * 8);
  s.kmax = (double*)malloc(KT_SLOTS * 8);
  if (!s.kt || !s.tag || !s.kmax) return false;
  if (scores_on_tiles(P)) {
    s.parts = (uint32_t*)alloc64(KT_SLOTS * tile_b3_elems(P.D) * 4);
    s.bad = (uint64_t*)malloc(KT_SLOTS * 8);
    if (!s.parts || !s.bad) return false;
  }
  for (int64_t slot = 0; slot < KT_SLOTS; ++slot) s.tag[slot] = -1;
  return true;
}

static void fwd_free(FwdBufs& w) {
  free(w.base);
  free(w.keys.kt);
  free(w.keys.tag);
  free(w.keys.kmax);
  free(w.keys.parts);
  free(w.keys.bad);
}

// The backward's buffers (rows: G·bq, the row pass's; the column pass's steps take bq)
static bool bwd_alloc(BwdBufs& w, const Problem& P, int64_t rows) {
  const int64_t R = imax(rows, 1), Dp = P.Dp, Dvp = P.Dvp, Dm = imax(Dp, Dvp);
  const int64_t kb_elems = scores_on_tiles(P) ? tile_b3_elems(P.D) : 0;
  const int64_t vb_elems = scores_on_tiles(P) && P.Dv <= TILE_K_MAX ? tile_b3_elems(P.Dv) : 0;
  const int64_t bqa = (R + 31) / 32 * 32;  // the backward's tile rows (bq), to a whole step
  const bool bf16 = bwd_on_tiles(P);
  w.base = carve_block([&](Carver& c) {
    step_take(c, w, P, R);
    c.take_each(BK * Dvp, w.vt, w.vt64, w.dv64);
    c.take_each(R * BK, w.ds, w.dfac, w.dp64);
    c.take(w.dO, P.lay.bq * Dvp + 16);
    c.take_each(R, w.delta, w.inv_l, w.sum_p, w.sum_pdp);
    c.take(w.dk64, BK * Dp);
    c.take(w.dO64, R * Dvp);
    c.take(w.dq_sum, R * Dm);
    c.take(w.dq_wide, bf16 ? R * Dm : 0);
    c.take(w.tile.kb, kb_elems);
    c.take(w.f32.vb3, vb_elems);
    c.take_each(bf16 ? tile_b_elems(bqa, 4) : 0, w.bf16.pb, w.bf16.dsb);
    c.take(w.bf16.dsa, bf16 ? tile_a_elems(bqa, BK) : 0);
    c.take(w.bf16.kt_pairs, bf16 ? tile_b_elems(P.D, 4) : 0);
    c.take(w.bf16.vt_pairs, bf16 ? tile_b_elems(P.Dv, 4) : 0);
    c.take(w.bf16.k_pairs, bf16 ? tile_b_elems(BK, Dp / 16) : 0);
  });
  if (!w.base) return false;
  step_init(w, R);
  if (!vb_elems) w.f32.vb3 = nullptr;  // (dP's tiles: none; bwd_pack asks)
  w.f32.vbad = ~0ull;
  w.f32.qc = w.f32.dc = PartsCache{nullptr, nullptr, nullptr};
  w.f32.parts_cap = 0;
  w.bf16.rows = nullptr;
  w.bf16.state = nullptr;
  w.bf16.rows_cap = 0;
  w.pool = w.dkv = nullptr;
  w.pool_cap = w.dkv_cap = 0;
  w.slot_of = w.free_slots = nullptr;
  w.slot_cap = 0;
  return true;
}

static void parts_free(PartsCache& c) {
  free(c.parts);
  free(c.bad);
  free(c.state);
  c = PartsCache{nullptr, nullptr, nullptr};
}

// room for n entries of `elems` parts each (rows of bq); false when out of memory
static bool parts_alloc(PartsCache& c, int64_t n, int64_t elems, int64_t bq) {
  parts_free(c);
  c.parts = (uint16_t*)alloc64(n * elems * 2 + 64);
  c.bad = (int8_t*)malloc((size_t)(n * bq));
  c.state = (int8_t*)malloc((size_t)n);
  return c.parts && c.bad && c.state;
}

// entry e's parts of the nr rows x (K values, ld ldx) times scale, packed at its first use;
// its state (PARTS_PACKED, or PARTS_PACKED_BAD_ROW with a row the split cannot carry)
static int8_t parts_of(PartsCache& c, int64_t e, int64_t elems, int64_t bq, int64_t nr, int64_t K,
                       const float* x, int64_t ldx, float scale) {
  if (c.state[e] == PARTS_EMPTY) {
    tile_pack_rows3(nr, K, x, ldx, c.parts + e * elems, c.bad + e * bq, scale);
    const bool bad_row = __builtin_memchr(c.bad + e * bq, 1, (size_t)nr);
    c.state[e] = bad_row ? PARTS_PACKED_BAD_ROW : PARTS_PACKED;
  }
  return c.state[e];
}

// Room for an item's chunk (bwd_item): dK_j, dV_j of its columns kept between passes of heads
// (kv_need doubles), `live` dQ tiles of `tile` doubles in the pool, their parts caches (float32
// on the tiles: qpe and dpe elements an entry, `heads` entries a slot) or rows cache (bfloat16 on
// the tiles: rpe elements an entry) and the slot lists of its t_count touched query tiles.
// False when out of memory.
static bool bwd_reserve(BwdBufs& w, int64_t kv_need, int64_t live, int64_t tile, int64_t heads,
                        int64_t qpe, int64_t dpe, int64_t rpe, int64_t bq, int64_t t_count) {
  if (kv_need > w.dkv_cap) {
    free(w.dkv);
    w.dkv = (double*)alloc64(kv_need * 8 + 64);
    w.dkv_cap = w.dkv ? kv_need : 0;
    if (!w.dkv) return false;
  }
  const int64_t pool_need = imax(live * tile, 1);  // D = 0: a tile of no doubles, a real pool
  if (pool_need > w.pool_cap) {
    free(w.pool);
    w.pool = (double*)alloc64(pool_need * 8 + 64);
    w.pool_cap = w.pool ? pool_need : 0;
    if (!w.pool) return false;
  }
  if (qpe && live * heads > w.f32.parts_cap) {
    const bool ok = parts_alloc(w.f32.qc, live * heads, qpe, bq) &&
                    parts_alloc(w.f32.dc, live * heads, imax(dpe, 1), bq);
    w.f32.parts_cap = ok ? live * heads : 0;
    if (!ok) return false;
  }
  if (rpe && live * heads > w.bf16.rows_cap) {
    free(w.bf16.rows);
    free(w.bf16.state);
    w.bf16.rows = (uint16_t*)alloc64(live * heads * rpe * 2 + 64);
    w.bf16.state = (int8_t*)malloc((size_t)(live * heads));
    const bool ok = w.bf16.rows && w.bf16.state;
    w.bf16.rows_cap = ok ? live * heads : 0;
    if (!ok) return false;
  }
  if (imax(t_count, live) > w.slot_cap) {
    free(w.slot_of);
    free(w.free_slots);
    w.slot_cap = imax(t_count, live);
    w.slot_of = (int32_t*)malloc((size_t)w.slot_cap * 4);
    w.free_slots = (int32_t*)malloc((size_t)w.slot_cap * 4);
    if (!w.slot_of || !w.free_slots) {
      w.slot_cap = 0;
      return false;
    }
  }
  return true;
}

static void bwd_free(BwdBufs& w) {
  free(w.base);
  free(w.pool);
  free(w.dkv);
  parts_free(w.f32.qc);
  parts_free(w.f32.dc);
  free(w.bf16.rows);
  free(w.bf16.state);
  free(w.slot_of);
  free(w.free_slots);
}
