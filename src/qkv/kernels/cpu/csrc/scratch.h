// Each worker's buffers. Part of kernel.h (compiled once per ISA).

// The backward walks key columns outer: the three-part split (tile_pack_rows3) of a query tile's
// rows is made at the tile's first column of a chunk, in an entry of such a cache, and read by
// the others. Each entry's state is a PartsState (PARTS_EMPTY is 0: a zeroed state is empty).
enum PartsState : int8_t { PARTS_EMPTY = 0, PARTS_PACKED = 1, PARTS_PACKED_BAD_ROW = 2 };
struct PartsCache {
  uint16_t* parts;  // entry e at parts + e · (its elements)
  int8_t* bad;      // entry e's rows the split cannot carry, at bad + e · bq
  int8_t* state;    // entry e's PartsState
};

struct Buf {
  char* base;
  float *q, *kr, *kt, *vr, *vt, *s, *p, *ds, *dfac, *o, *dO, *tmp;
  float* slo;  // the scores' low parts (score_lo; finite: zeroed here, written finite)
  float *mrow, *slope;
  int64_t *qpos, *bitoff;
  uint32_t *rowh, *colh;
  double *l, *alpha, *delta, *inv_l, *acc, *dk64, *dv64;
  double *vt64, *dO64, *dp64;  // backward: Vᵀ, dO and dP in double (dP's sums are exact)
  double* q64;  // precise scores (float32 inputs): Q in double (decoding, exact rows)
  double* qn;   // precise scores: |q| of each row (exact_rows)
  double kmax;  // precise scores: the largest |k| of the packed key tile (exact_rows)
  int8_t* exact;  // per row: this tile's scores formed exactly, with their low parts in slo
  double* pool;  // backward: live dQ tiles
  int64_t pool_cap;
  double* dkv;   // backward, passes of a few heads: dK_j and dV_j of each column of the chunk
  int64_t dkv_cap;
  PartsCache qc, dc;  // backward, float32 on the tiles: Q's rows' parts (the scores) and dO's
                      // (dP = dO Vᵀ), per pool slot and head of the group
  int64_t parts_cap;  // entries of each
  uint32_t* vb3;  // backward, float32 on the tiles: the V tile's parts (tile_pack_keys3), dP's
  uint64_t vbad;  // … its keys the split cannot carry (the tile's dP then on AVX-512)
  int32_t *slot_of, *free_slots;
  int64_t slot_cap;
  int8_t *glo, *ghi;  // forward: the first and last 16-key chunk each group of 16 rows computes
  float* ktc;         // forward: KT_SLOTS packed key tiles (w.kt points at one of them)
  int64_t* ktag;      // forward: which key tile each slot holds, −1 none
  double* kmaxc;      // forward: each slot's key_norm_max
  float* accf;        // tile unit, bfloat16: the forward's P·V accumulator (rows padded to 16)
  uint16_t* pa;       // tile unit, bfloat16: the forward's P as A tiles (tile_put_p)
  uint16_t* qa;       // tile unit: the forward item's Q rows as A tiles (tile_pack_rows; float32:
                      // three parts, tile_pack_rows3)
  bool qa_on;         // qa holds the rows of w.q
  int8_t* qbad;       // tile unit, float32: rows of qa the split cannot carry (gemm_chain forms them)
  bool qbad_any;      // … some row of the forward's item
  int64_t kt0;        // forward, the call's key-tile store: the tile slot 0's kt holds, or −1
  uint32_t* kb;       // tile unit, float32: the packed key tile's three parts (tile_pack_keys3;
                      // the forward's in its slot of kbc)
  uint64_t kbad;      // … its keys the split cannot carry (gemm_chain forms them)
  uint32_t* kbc;      // forward: each kept key-tile slot's parts
  uint64_t* kbadc;    // forward: each slot's kbad
  bool qa_scaled;     // … times the scale (a power of two)
  float* lv;          // tile unit, bfloat16: the forward's row sums l, 16 lanes a row
  uint16_t* ta;       // tile unit, bfloat16 backward: Pᵀ, dSᵀ or dS as A tiles (tile_pack_a)
  uint32_t* tb;       // … the other operand as B tiles (tile_acc)
};

static inline char* carve(char*& cur, int64_t bytes) {
  char* p = cur;
  cur += (bytes + 63) & ~int64_t(63);
  return p;
}

// rows: most rows a tile step handles (forward G·bq, backward bq)
static bool buf_alloc(Buf& w, const Problem& P, int64_t rows) {
  const int64_t Dp = P.Dp, Dvp = P.Dvp, Dm = imax(Dp, Dvp), R = imax(rows, 1);
  int64_t bytes = 0;
  const int64_t floats[] = {R * Dp, BK * Dp, Dp * BK, BK * Dvp, Dvp * BK, R * BK, R * BK, R * BK,
                            R * BK, R * BK, imax(4 * R, BK) * Dm, P.lay.bq * Dvp + 16, Dm + 16, R, R};
  for (int64_t f : floats) bytes += (f * 4 + 63) & ~int64_t(63);
  bytes += 2 * ((R * 8 + 63) & ~int64_t(63)) + 2 * ((R * 4 + 63) & ~int64_t(63)) + 256;
  bytes += 4 * ((R + 63) & ~int64_t(63));
  const int64_t qa_elems = on_tiles(P) ? tile_a_elems(R, P.D) : scores_on_tiles(P) ? tile_a3_elems(R, P.D) : 0;
  const int64_t kb_elems = scores_on_tiles(P) ? tile_b3_elems(P.D) : 0;
  bytes += (kb_elems * 4 + 63) & ~int64_t(63);
  const int64_t vb_elems = scores_on_tiles(P) && P.Dv <= TILE_K_MAX ? tile_b3_elems(P.Dv) : 0;
  bytes += (vb_elems * 4 + 63) & ~int64_t(63);
  bytes += (qa_elems * 2 + 63) & ~int64_t(63);
  const int64_t accf_elems = on_tiles(P) ? (R + 15) / 16 * 16 * Dvp : 0;
  bytes += (accf_elems * 4 + 63) & ~int64_t(63);
  const int64_t lv_elems = on_tiles(P) ? R * 16 : 0;
  bytes += (lv_elems * 4 + 63) & ~int64_t(63);
  const int64_t bqa = (R + 31) / 32 * 32;  // the backward's tile rows (bq), to a whole step
  const int64_t ta_elems = bwd_on_tiles(P) ? 2 * 512 * imax(4 * (bqa / 32), bqa / 16 * 2) : 0;
  const int64_t tb_elems = bwd_on_tiles(P) ? imax(bqa / 32, 2) * (imax(Dp, Dvp) / 16) * 256 : 0;
  bytes += ((ta_elems * 2 + 63) & ~int64_t(63)) + ((tb_elems * 4 + 63) & ~int64_t(63));
  const int64_t pa_elems = on_tiles(P) ? (R + 15) / 16 * 16 * BK : 0;
  bytes += (pa_elems * 2 + 63) & ~int64_t(63);
  const int64_t doubles[] = {R, R, R, R, R * Dm, BK * Dp, BK * Dvp, Dvp * BK, R * Dvp, R * BK, R * Dp, R};
  for (int64_t d : doubles) bytes += (d * 8 + 63) & ~int64_t(63);
  w.base = (char*)alloc64(bytes);
  if (!w.base) return false;
  char* cur = w.base;
  w.q = (float*)carve(cur, R * Dp * 4);
  w.kr = (float*)carve(cur, BK * Dp * 4);
  w.kt = (float*)carve(cur, Dp * BK * 4);
  w.vr = (float*)carve(cur, BK * Dvp * 4);
  w.vt = (float*)carve(cur, Dvp * BK * 4);
  w.s = (float*)carve(cur, R * BK * 4);
  w.slo = (float*)carve(cur, R * BK * 4);
  __builtin_memset(w.slo, 0, (size_t)(R * BK) * 4);
  w.p = (float*)carve(cur, R * BK * 4);
  w.ds = (float*)carve(cur, R * BK * 4);
  w.dfac = (float*)carve(cur, R * BK * 4);
  w.o = (float*)carve(cur, imax(4 * R, BK) * Dm * 4);
  w.dO = (float*)carve(cur, (P.lay.bq * Dvp + 16) * 4);
  w.tmp = (float*)carve(cur, (Dm + 16) * 4);
  w.mrow = (float*)carve(cur, R * 4);
  w.slope = (float*)carve(cur, R * 4);
  w.qpos = (int64_t*)carve(cur, R * 8);
  w.bitoff = (int64_t*)carve(cur, R * 8);
  w.rowh = (uint32_t*)carve(cur, R * 4);
  w.colh = (uint32_t*)carve(cur, BK * 4);
  w.l = (double*)carve(cur, R * 8);
  w.alpha = (double*)carve(cur, R * 8);
  w.delta = (double*)carve(cur, R * 8);
  w.inv_l = (double*)carve(cur, R * 8);
  w.acc = (double*)carve(cur, R * Dm * 8);
  w.dk64 = (double*)carve(cur, BK * Dp * 8);
  w.dv64 = (double*)carve(cur, BK * Dvp * 8);
  w.vt64 = (double*)carve(cur, Dvp * BK * 8);
  w.dO64 = (double*)carve(cur, R * Dvp * 8);
  w.dp64 = (double*)carve(cur, R * BK * 8);
  w.q64 = (double*)carve(cur, R * Dp * 8);
  w.qn = (double*)carve(cur, R * 8);
  w.exact = (int8_t*)carve(cur, R);
  __builtin_memset(w.exact, 0, (size_t)R);
  w.glo = (int8_t*)carve(cur, R);
  w.ghi = (int8_t*)carve(cur, R);
  w.qa = (uint16_t*)carve(cur, qa_elems * 2);
  w.kb = (uint32_t*)carve(cur, kb_elems * 4);  // the backward's; the forward's point into kbc
  w.kbad = 0;
  w.vb3 = vb_elems ? (uint32_t*)carve(cur, vb_elems * 4) : nullptr;
  w.vbad = ~0ull;
  w.qbad = (int8_t*)carve(cur, R);
  w.accf = (float*)carve(cur, accf_elems * 4);
  w.lv = (float*)carve(cur, lv_elems * 4);
  w.ta = (uint16_t*)carve(cur, ta_elems * 2);
  w.tb = (uint32_t*)carve(cur, tb_elems * 4);
  w.pa = (uint16_t*)carve(cur, pa_elems * 2);
  w.qa_on = w.qa_scaled = false;
  w.pool = nullptr;
  w.pool_cap = 0;
  w.dkv = nullptr;
  w.dkv_cap = 0;
  w.qc = w.dc = PartsCache{nullptr, nullptr, nullptr};
  w.parts_cap = 0;
  w.slot_of = w.free_slots = nullptr;
  w.slot_cap = 0;
  w.ktc = nullptr;
  w.ktag = nullptr;
  w.kmaxc = nullptr;
  w.kbc = nullptr;
  w.kbadc = nullptr;
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
    c.state[e] = __builtin_memchr(c.bad + e * bq, 1, (size_t)nr) ? PARTS_PACKED_BAD_ROW : PARTS_PACKED;
  }
  return c.state[e];
}

static void buf_free(Buf& w) {
  free(w.base);
  free(w.pool);
  free(w.dkv);
  parts_free(w.qc);
  parts_free(w.dc);
  free(w.slot_of);
  free(w.free_slots);
  free(w.ktc);
  free(w.ktag);
  free(w.kmaxc);
  free(w.kbc);
  free(w.kbadc);
}

// The forward's items of one (b, kv head) come in order of their query tiles (plan_forward), so
// a worker's next item reads most of the key tiles its last one read (a band: all but a few).
// Each worker keeps its last packed key tiles, slot j mod KT_SLOTS, and packs a tile only when
// its slot holds another: the same bits, a transposition (and a key_norm_max) saved per hit.
constexpr int64_t KT_SLOTS = 16;

static bool ktc_alloc(Buf& w, const Problem& P) {
  w.ktc = (float*)alloc64(KT_SLOTS * P.Dp * BK * 4);
  w.ktag = (int64_t*)malloc(KT_SLOTS * 8);
  w.kmaxc = (double*)malloc(KT_SLOTS * 8);
  if (!w.ktc || !w.ktag || !w.kmaxc) return false;
  if (scores_on_tiles(P)) {
    w.kbc = (uint32_t*)alloc64(KT_SLOTS * tile_b3_elems(P.D) * 4);
    w.kbadc = (uint64_t*)malloc(KT_SLOTS * 8);
    if (!w.kbc || !w.kbadc) return false;
  }
  for (int64_t s = 0; s < KT_SLOTS; ++s) w.ktag[s] = -1;
  w.kt0 = -1;
  return true;
}
