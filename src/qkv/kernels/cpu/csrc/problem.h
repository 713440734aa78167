// What the torch side (ops.cpp, inputs.cpp, schedule.cpp) hands to the compute kernels
// (kernel.h, compiled once per ISA): plain structs of pointers, sizes and strides, no torch
// types. Everything defined here has internal linkage or is a plain struct, so the ISA
// translation units, compiled with different target options, never share a function body with
// the baseline one.
#pragma once

#include <cstdint>

namespace qkv_cpu {

constexpr int64_t BK = 64;          // keys per tile: a tile row's allowed keys are one uint64
constexpr int32_t TILE_FULL = -1;   // tile code of a FULL tile (no mask arithmetic)
constexpr int64_t CHAIN = 16;       // products per float chain of a precise score (gemm_chain)
enum Dtype : int32_t { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

// A precise score x (double) is kept as its float rounding hi and this low part, x − hi rounded
// to float (0 where x is not finite): the softmax takes exp of (hi − m) + lo (kernel.h,
// exp_scores), accurate to the rounding of that small difference rather than of the score
// (docs/cpu.md, Accuracy).
static inline float score_lo(double x, float hi) {
  const double d = x - (double)hi;
  return d == d ? (float)d : 0.0f;
}

// A (B, H, N, D) tensor: data and element strides of its first three dims (the last is dense).
struct View {
  const void* data;
  int64_t sb, sh, sn;
};

// The block layout (see layout.py): CSR of kept tiles by query-tile row for the forward, the
// transposed CSR by key-tile column for the backward (same tile codes), and the allowed-key
// bits of the PARTIAL tiles, `bits[((p * bm + b) * hm + h) * bq + r]` for tile code p. The
// forward may read one CSR per (b, kv head), `ng` = B·Hkv of them (blocks chosen per head:
// qkv.sparse), back to back in row_ptr with offsets into the shared col_idx, code and bits.
struct Layout {
  int64_t bq, nqb, nkb;
  int64_t ng;              // forward CSRs: 1, or B·Hkv (one per (b, kv head), b-major)
  const int64_t* row_ptr;  // (ng · (nqb + 1))
  const int32_t* col_idx;  // (nnz) key tile of each kept tile
  const int32_t* code;     // (nnz) TILE_FULL or index into bits
  const int64_t* col_ptr;  // (nkb + 1)
  const int32_t* row_idx;  // (nnz) query tile of each kept tile, by column
  const int32_t* code_t;   // (nnz)
  const uint64_t* bits;    // (P, bm, hm, bq)
  int64_t bm, hm;          // 1 or B, 1 or H: whether the mask depends on the batch / the head
  // Tile origins, or null for the uniform grid (query tile i at row i·bq, key tile j at key
  // j·64): query tile i holds rows [q_starts[i], q_starts[i+1]) (at most bq), key tile j keys
  // [k_starts[j], k_starts[j+1]) (at most 64) — tiles cut at the segment boundaries of packed
  // sequences, so a short segment is one tile instead of pieces of two.
  const int64_t* q_starts;  // (nqb + 1) or null
  const int64_t* k_starts;  // (nkb + 1) or null
};

// Score modifiers, applied to x = (q · k) · scale in this order: ALiBi before the softcap
// unless alibi_after_cap.
struct Mods {
  float scale;    // the scale rounded to float (16-bit inputs' scores: float(s · scale))
  double scale64; // the scale itself (float32 inputs' scores, and dQ, dK)
  const float* slopes;      // (H,) ALiBi slopes, or null
  float cap;                // softcap (0: none): t = cap · tanh(x / cap)
  int32_t alibi_after_cap;  // 1: t = cap · tanh(x / cap) − slope · |i − j|
};

// qkv.dropout's counter-based mask: weight (b, h, i, j) is kept when
// mix(mix(head ^ i·GOLDEN) ^ mix(j·GOLDEN ^ s1)) ≥ threshold, head = mix(bh·GOLDEN + s0).
struct Drop {
  int32_t on;
  uint32_t s0, s1;
  uint64_t threshold;  // ≤ 2^32
  float keep_scale;    // 1 / (1 − p), rounded to float
};

struct Problem {
  int64_t B, H, Hkv, G, Nq, Nk, D, Dv;
  int64_t Dp, Dvp;  // D and Dv rounded up to 16: the padded width of packed rows
  int32_t dtype;
  int32_t precise_scores;  // 1: float chains of CHAIN products summed in double (float32 inputs), 0: one float sum
  int32_t dot_scores;    // 1: scores as per-key dot products (decoding: Nq·G ≤ 16), 0: gemm
  int32_t score_lo;      // 1: precise scores without modifiers: exp reads (s − m) + s_lo (score_lo)
  int32_t stream_out;    // 1: output rows written with non-temporal stores (large float32 out)
  int32_t exact_dkv;     // backward, 1: dK and dV summed exactly (small float32 gradients)
  int32_t exact_dq;      // backward, 1: dQ summed exactly (gemm_acc_f64)
  View q, k, v, out, dout;
  float* m;            // (B, H, Nq) row max of the scores (kernel's own units)
  double* l;           // (B, H, Nq) softmax denominator, relative to m
  float* lse;          // (B, H, Nq) natural lse for the caller
  const float* dlse;   // (B, H, Nq) gradient of lse, or null
  double* delta;       // (B, H, Nq) the backward's Δ from its row pass, or null
  uint8_t* peaked;     // (B, Hkv, query tiles) 1: the tile holds a peaked row (delta_item)
  uint8_t* bad_rows;   // (B, H, Nq) 1: the row's q and output both hold a NaN or inf (delta_item)
  void* dq;            // (B, H, Nq, D) contiguous, dtype
  void* dk;            // (B, Hkv, Nk, D)
  void* dv;            // (B, Hkv, Nk, Dv)
  Layout lay;
  Mods mods;
  Drop drop;
};

// The forward CSR of (b, kv head): the shared one, or its own (Layout.ng > 1).
static inline const int64_t* fwd_rows(const Problem& P, int64_t b, int64_t hkv) {
  return P.lay.row_ptr + (P.lay.ng > 1 ? (b * P.Hkv + hkv) * (P.lay.nqb + 1) : 0);
}

// Kept tiles of one forward CSR, on average over the groups (the size of a call, for choices
// that depend on it).
static inline int64_t fwd_kept(const Layout& L) {
  return L.row_ptr[L.ng * (L.nqb + 1) - 1] / L.ng;
}

// Query tile i: rows [tile_r0, tile_r0 + tile_nr); key tile j: keys [tile_c0, tile_c0 + tile_kw).
static inline int64_t tile_r0(const Problem& P, int64_t i) {
  return P.lay.q_starts ? P.lay.q_starts[i] : i * P.lay.bq;
}
static inline int64_t tile_nr(const Problem& P, int64_t i) {
  if (P.lay.q_starts) return P.lay.q_starts[i + 1] - P.lay.q_starts[i];
  const int64_t r0 = i * P.lay.bq;
  return P.Nq - r0 < P.lay.bq ? P.Nq - r0 : P.lay.bq;
}
static inline int64_t tile_c0(const Problem& P, int64_t j) {
  return P.lay.k_starts ? P.lay.k_starts[j] : j * BK;
}
static inline int64_t tile_kw(const Problem& P, int64_t j) {
  if (P.lay.k_starts) return P.lay.k_starts[j + 1] - P.lay.k_starts[j];
  return P.Nk - j * BK < BK ? P.Nk - j * BK : BK;
}

// The states of the call's shared key-tile store (FwdPlan.kstate), lock-free: the first item to
// reach a tile claims it (IDLE → PACKING, compare-and-swap), packs its parts and publishes them
// (a release store of READY); an item that loads READY (acquire) reads them, one that finds
// the tile PACKING packs a copy of its own.
enum KeyTileState : int32_t { KEY_TILE_IDLE = 0, KEY_TILE_PACKING = 1, KEY_TILE_READY = 2 };

// Whether a V tile of the call is all finite (FwdPlan.v_finite): found by the first item that
// reads the tile, then remembered (relaxed loads and stores: every writer stores the same value).
enum VTileFinite : int8_t { V_TILE_UNKNOWN = -1, V_TILE_NONFINITE = 0, V_TILE_FINITE = 1 };

// Forward work item: rows of query tile i of (b, kv head hkv) — all G query heads of the group —
// over the kept tiles [e0, e1) of the tile row (a split of it when split_count > 1).
struct FwdItem {
  int32_t b, hkv, i, split;
  int64_t e0, e1;
};

struct FwdPlan {
  const FwdItem* items;
  int64_t n_items;
  const int32_t* nsplit;     // per (b, hkv, i): splits of that tile row
  const int64_t* part_base;  // per (b, hkv, i): first partial slot (nsplit > 1)
  int32_t* done;             // per (b, hkv, i): splits finished; the last one merges
  float* part_m;             // per slot: mmax rows
  double* part_l;            // per slot: mmax rows
  double* part_acc;          // per slot: mmax × Dvp
  int64_t mmax;              // most rows of an item: G · bq
  int8_t* v_finite;          // per (b, hkv, key tile): a VTileFinite
  // float32 scores on the tile unit, rows longer than a worker's key-tile slots (dense, causal):
  // each key tile's three parts packed once per call by the first item that reaches it and read
  // by every other (null: each worker packs its own)
  uint32_t* kparts;          // per (b, hkv, key tile): fwd_share_elems / tiles
  int32_t* kstate;           // … a KeyTileState
  uint64_t* kbadv;           // … its keys the split cannot carry
  double* kmaxv;             // … its largest key norm
};

// Backward work item: key tiles of chunk c of (b, kv head hkv).
struct BwdItem {
  int32_t b, hkv, c;
};

// The backward walks key-tile columns in chunks. A query tile touched by one chunk only gets its
// dQ written by that chunk; one touched by several gets one partial per chunk in `store`, summed
// in chunk order by whichever chunk finishes it last (so the result never depends on timing).
struct BwdPlan {
  const BwdItem* items;
  int64_t n_items;
  const int32_t* chunk_j;     // (C + 1) chunk c covers key tiles [chunk_j[c], chunk_j[c + 1])
  const int64_t* chunk_t;     // (C + 1) its touched query tiles: t in [chunk_t[c], chunk_t[c+1])
  const int32_t* t_tile;      // query tile of touched entry t, in order of first touch
  const int32_t* t_first;     // first key tile of the chunk touching it
  const int32_t* t_last;      // last key tile of the chunk touching it
  const int64_t* t_slot;      // store slot, or −1 when no other chunk touches the tile
  const int32_t* t_flush;     // per chunk, its touched entries (relative) sorted by t_last
  const int32_t* local;       // per transposed-CSR entry: its touched entry, relative to chunk
  const int32_t* chunk_live;  // (C) most tiles of chunk c accumulating at once
  int64_t heads;              // query heads of the group per pass over a chunk (see bwd_item)
  const int64_t* q_ptr;       // (nqb + 1) per query tile: its store slots ...
  const int64_t* q_slots;     // ... in chunk order
  int32_t* done;              // per (b, hkv, query tile): partials stored so far (one a pass)
  double* store;              // slots × B × Hkv × (G · bq · Dp)
};

// Items 0 … n − 1 of one call, shared by its workers. Each worker starts on a contiguous range of
// its own (consecutive items share key tiles, so a worker that walks them in order packs a tile
// once, where two workers taking items in turn each packed every tile) and, when its range runs
// dry, takes the back half of the fullest range left, so that a worker that gets less CPU holds
// back only the item it is running. Workers past QUEUE_RANGES take single items from the others.
constexpr int QUEUE_RANGES = 64;
struct ItemQueue {
  int64_t lo[QUEUE_RANGES], hi[QUEUE_RANGES];  // range r: items lo … hi − 1, under lock[r]
  int32_t lock[QUEUE_RANGES];
  int32_t ranges, joined;
  const int32_t* stop;  // when set and nonzero, no more items are handed out (interrupt.h)
};

static inline void queue_init(ItemQueue& q, int64_t n, int64_t workers) {
  q.ranges = (int32_t)(workers < 1 ? 1 : workers > QUEUE_RANGES ? QUEUE_RANGES : workers);
  q.joined = 0;
  q.stop = nullptr;
  for (int r = 0; r < q.ranges; ++r) {
    q.lo[r] = n * r / q.ranges;
    q.hi[r] = n * (r + 1) / q.ranges;
    q.lock[r] = 0;
  }
}

// a worker's number, once per worker at its start
static inline int queue_join(ItemQueue& q) { return __atomic_fetch_add(&q.joined, 1, __ATOMIC_RELAXED); }

static inline void range_lock(int32_t* l) {
  while (__atomic_exchange_n(l, 1, __ATOMIC_ACQUIRE))
    while (__atomic_load_n(l, __ATOMIC_RELAXED)) {
    }
}
static inline void range_unlock(int32_t* l) { __atomic_store_n(l, 0, __ATOMIC_RELEASE); }

// The next item for worker `me`, or −1 when none is left.
static inline int64_t queue_take(ItemQueue& q, int me) {
  const int own = me < q.ranges ? me : -1;
  for (;;) {
    if (q.stop && __atomic_load_n(q.stop, __ATOMIC_RELAXED)) return -1;  // Ctrl-C: stop here
    if (own >= 0) {
      range_lock(&q.lock[own]);
      const int64_t k = q.lo[own];
      const bool got = k < q.hi[own];
      if (got) __atomic_store_n(&q.lo[own], k + 1, __ATOMIC_RELAXED);
      range_unlock(&q.lock[own]);
      if (got) return k;
    }
    int v = -1;
    int64_t most = 0;
    for (int r = 0; r < q.ranges; ++r) {
      const int64_t left = __atomic_load_n(&q.hi[r], __ATOMIC_RELAXED) - __atomic_load_n(&q.lo[r], __ATOMIC_RELAXED);
      if (left > most) {
        most = left;
        v = r;
      }
    }
    if (v < 0) return -1;
    range_lock(&q.lock[v]);
    const int64_t lo = q.lo[v], hi = q.hi[v];
    const int64_t mid = own >= 0 ? lo + (hi - lo) / 2 : hi - 1;  // the back half, or one item
    if (lo < hi) __atomic_store_n(&q.hi[v], mid, __ATOMIC_RELAXED);
    range_unlock(&q.lock[v]);
    if (lo >= hi) continue;  // emptied meanwhile: look again
    if (own >= 0) {  // items mid + 1 … hi − 1 become this worker's range (empty until now)
      range_lock(&q.lock[own]);
      __atomic_store_n(&q.lo[own], mid + 1, __ATOMIC_RELAXED);
      __atomic_store_n(&q.hi[own], hi, __ATOMIC_RELAXED);
      range_unlock(&q.lock[own]);
    }
    return mid;
  }
}

// The compute kernels of one ISA. Each worker joins the call's queue and takes items until none
// is left; *error is set (and the worker stops) if it could not allocate its buffers.
struct Kernels {
  const char* name;
  void (*forward)(const Problem&, const FwdPlan&, ItemQueue* items, int32_t* error);
  void (*backward)(const Problem&, const BwdPlan&, ItemQueue* items, int32_t* error);
  void (*delta)(const Problem&, ItemQueue* items, int32_t* error);  // items: (b, hkv, query tile)
  int64_t (*fwd_share_elems)(const Problem&);  // FwdPlan.kparts' size in uint32 (0: none)
};

// Each path's kernels (isa_paths.h), defined by its isa_<name>.cpp
#define QKV_ISA_PATH(name, ...) \
  namespace name {              \
  extern const Kernels kernels; \
  }
#include "isa_paths.h"

}  // namespace qkv_cpu
