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
//     worker.h       what every part leans on: min/max, −inf, aligned buffers, taking items
//     unit_choice.h  which unit runs a problem's products (the tile unit or the vector code)
//     rows.h         a row at a time: dtype conversions, loads, stores, finiteness, dropout hashes
//     scratch.h      each worker's buffers, by pass (forward, backward; the tile unit's state)
//     packing.h      K and V tiles as the products read them (the forward's key-tile store too)
//     scores.h       the scores both passes compute alike: products, modifiers, exact rows, exp
//     forward.h      the forward's items: online softmax, P·V over a row of tiles, splits merged
//     backward.h     the backward: the row pass (Δ) and the column pass (dV, dK, dQ)

#include "isa_contract.h"
#include "worker.h"
#include "unit_choice.h"
#include "rows.h"
#include "scratch.h"
#include "packing.h"
#include "scores.h"
#include "forward.h"
#include "backward.h"
