// FlashAttention-2, forward and backward, over the kept tiles of a block layout.
//
// Included by each isa_*.cpp (isa_unit.h) inside its own namespace, after that ISA's SIMD and
// tile layers, so the same source becomes one kernel per instruction set: it is written against
// the names isa_contract.h lists. No torch types and no std templates here: every
// function has internal linkage or lives in the ISA's namespace.
//
// Tiles are bq query rows × 64 keys. The forward runs one item per (b, kv head, query tile[,
// split of its kept tiles]); its rows are the tile's rows of all G query heads that share the kv
// head, so each K/V tile is read and packed once per group. Per kept tile:
//
//     S = Q Kᵀ · scale           tile_scores: float chains of 32 products (16 portable) summed
//                                in double (fp32; on the amx path the chains are tile products
//                                of three bfloat16 parts per value, tiles_amx.h)
//     t = mods(S)                ALiBi / softcap in float, masked to −inf outside the bits
//     m' = max(m, rowmax t);  P = exp(t − m');  l = l·α + rowsum P;  α = e^(m − m') in double
//     acc = acc·α + P V          P V in one float chain per tile (16 keys portable) summed in double,
//                                acc in double
//
// and at the end out = acc / l, with (m, l) saved for the backward and lse = m + log l returned.
//
// The backward runs one item per (b, kv head, chunk of key-tile columns). Per column j it packs
// K_j, V_j once and, for every kept query tile i and query head g of the group, recomputes
//
//     S, t                       the forward's own tile_scores and row_scores: the same bits
//     P = float(exp(t − m) · (1/l))          (the division and the product in double)
//     dP = dO Vᵀ in double (exact sums of float products), Δ = rowsum(dO ∘ O) − dlse summed
//     the same way (query tiles holding a peaked row: Σ P·dP / Σ P − dlse from a row pass
//     before, delta_item);  dS = P ∘ float(dP − Δ)
//     dV_j += Pᵀ dO;  dK_j += dSᵀ Q;  dQ_i += dS K_j
//
// each product in float chains of 32 terms (portable: CHAIN, 16; exactly, in double, for small
// gradients: exact_sums in ops.cpp) summed in double, within and across tiles.
// dQ tiles live in a small pool while the chunk's columns reach them (see BwdPlan). Where the
// whole group's live dQ tiles would not stay in cache (GQA over long rows), an item walks its
// chunk once per few heads of the group, keeping dK_j and dV_j of every column between passes.
//
// The kernel by responsibility, in the order included below:
//
//     rows.h      a row at a time: dtype conversions, loads and stores, finiteness, dropout hashes
//     scratch.h   each worker's buffers, by pass (forward, backward; the tile unit's state)
//     packing.h   K and V tiles as the products read them (the forward's key-tile store too)
//     scores.h    the scores both passes compute alike: products, modifiers, exact rows, exp
//     forward.h   the forward's items: online softmax and P·V over a row of tiles, splits merged
//     backward.h  the backward: the row pass (Δ) and the column pass (dV, dK, dQ)

#include "isa_contract.h"

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// 64-byte-aligned memory for `bytes` (rounded up to a whole 64: aligned_alloc wants a multiple of
// the alignment, and at least one line, so that a size of 0, D = 0, is a real block)
static inline void* alloc64(int64_t bytes) {
  return aligned_alloc(64, (size_t)((imax(bytes, 1) + 63) & ~int64_t(63)));
}
static const float NEG_INF = -__builtin_inff();

// A named step of an item (fwd_item, bwd_item): inlined where it is called, so that the item
// compiles as the one function it was written as
#define QKV_STEP static inline __attribute__((always_inline))

// A worker's part of a call (Kernels): each item it takes from the queue to run(k) until none is
// left; run returns false, or a worker's buffers could not be had (fail), when out of memory:
// *error is set and the worker stops.
static void fail(int32_t* error) { __atomic_store_n(error, 1, __ATOMIC_RELAXED); }
template <class Run>
static void take_items(ItemQueue* items, int32_t* error, const Run& run) {
  for (const int me = queue_join(*items);;) {
    const int64_t k = queue_take(*items, me);
    if (k < 0) break;
    if (!run(k)) {
      fail(error);
      break;
    }
  }
}

// whether this problem's products run on the tile unit (bfloat16 inputs on a path that has it)
static inline bool on_tiles(const Problem& P) { return TILE_BF16 && P.dtype == DT_BF16; }
// whether its backward's products run on the tile unit too (bfloat16: dP, dV, dK and dQ)
static inline bool bwd_on_tiles(const Problem& P) {
  return on_tiles(P) && P.Dp <= TILE_PV_N && P.Dvp <= TILE_PV_N;
}
// whether its precise float32 scores run on the tile unit, in three bfloat16 parts (tiles_amx.h):
// the products gemm_chain would form, same chains of 32 summed in double
static inline bool scores_on_tiles(const Problem& P) {
  return TILE_F32 && P.dtype == DT_F32 && P.precise_scores && !P.dot_scores && P.D <= TILE_K_MAX;
}

#include "rows.h"
#include "scratch.h"
#include "packing.h"
#include "scores.h"
#include "forward.h"
#include "backward.h"
