// The work plans of schedule.h: how a call's rows and columns of tiles are cut into items.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "schedule.h"

namespace qkv_cpu {
namespace {

int64_t target_items() { return std::max<int64_t>(16, 4 * (int64_t)at::get_num_threads()); }

}  // namespace

void plan_forward(const Problem& P, FwdState& S) {
  const Layout& L = P.lay;
  const int64_t BH = P.B * P.Hkv, nqb = L.nqb;
  const int64_t total = fwd_kept(L);  // per (b, kv head)
  const int64_t T = target_items();
  const int64_t per_item = std::max<int64_t>(8, (total * BH + T - 1) / std::max<int64_t>(T, 1));
  S.nsplit.assign(BH * nqb, 0);
  S.part_base.assign(BH * nqb, -1);
  S.done.assign(BH * nqb, 0);
  int64_t slots = 0;
  for (int64_t bh = 0; bh < BH; ++bh) {  // one head's query tiles in order (fwd_key_tile's cache)
    const int64_t* rows = fwd_rows(P, bh / P.Hkv, bh % P.Hkv);
    for (int64_t i = 0; i < nqb; ++i) {
      const int64_t kept = rows[i + 1] - rows[i];
      if (kept == 0) continue;
      const int64_t ns = (kept + per_item - 1) / per_item;
      S.nsplit[bh * nqb + i] = (int32_t)ns;
      if (ns > 1) {
        S.part_base[bh * nqb + i] = slots;
        slots += ns;
      }
      for (int64_t s = 0; s < ns; ++s) {
        FwdItem it{};
        it.b = (int32_t)(bh / P.Hkv);
        it.hkv = (int32_t)(bh % P.Hkv);
        it.i = (int32_t)i;
        it.split = (int32_t)s;
        it.e0 = rows[i] + kept * s / ns;
        it.e1 = rows[i] + kept * (s + 1) / ns;
        S.items.push_back(it);
      }
    }
  }
  // biggest items first: the last ones to start are the shortest
  std::stable_sort(S.items.begin(), S.items.end(), [&](const FwdItem& a, const FwdItem& b) {
    return a.e1 - a.e0 > b.e1 - b.e0;
  });
  const int64_t mmax = P.G * L.bq;
  S.part_m.assign(slots * mmax, 0.0f);
  S.part_l.assign(slots * mmax, 0.0);
  S.part_acc.assign(slots * mmax * P.Dvp, 0.0);
  FwdPlan& F = S.plan;
  F.items = S.items.data();
  F.n_items = (int64_t)S.items.size();
  F.nsplit = S.nsplit.data();
  F.part_base = S.part_base.data();
  F.done = S.done.data();
  F.mmax = mmax;  // rows of each partial slot below
  F.part_m = S.part_m.data();
  F.part_l = S.part_l.data();
  F.part_acc = S.part_acc.data();
  S.v_finite.assign(BH * L.nkb, V_TILE_UNKNOWN);
  F.v_finite = S.v_finite.data();
}

namespace {

// Cut the key-tile columns into `n_chunks` pieces of about equal work and work out, per chunk,
// which query tiles it touches and when (see BwdPlan). Returns the bytes the partials need.
int64_t chunk_columns(const Problem& P, int64_t n_chunks, BwdState& S) {
  const Layout& L = P.lay;
  const int64_t nkb = L.nkb, nqb = L.nqb, nnz = L.col_ptr[nkb];
  S.chunk_j.assign(1, 0);
  for (int64_t c = 1; c < n_chunks; ++c) {
    const int64_t goal = nnz * c / n_chunks;
    int64_t j = S.chunk_j.back();
    while (j < nkb && L.col_ptr[j] < goal) ++j;
    if (j > S.chunk_j.back() && j < nkb) S.chunk_j.push_back((int32_t)j);
  }
  S.chunk_j.push_back((int32_t)nkb);
  const int64_t C = (int64_t)S.chunk_j.size() - 1;
  S.chunk_t.assign(1, 0);
  S.t_tile.clear();
  S.t_first.clear();
  S.t_last.clear();
  S.local.assign(nnz, 0);
  std::vector<int32_t> stamp(nqb, -1), count(nqb, 0);
  std::vector<int64_t> pos(nqb, 0);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t t0 = (int64_t)S.t_tile.size();
    for (int64_t j = S.chunk_j[c]; j < S.chunk_j[c + 1]; ++j) {
      for (int64_t e = L.col_ptr[j]; e < L.col_ptr[j + 1]; ++e) {
        const int32_t i = L.row_idx[e];
        if (stamp[i] != c) {
          stamp[i] = (int32_t)c;
          pos[i] = (int64_t)S.t_tile.size();
          S.t_tile.push_back(i);
          S.t_first.push_back((int32_t)j);
          S.t_last.push_back((int32_t)j);
          ++count[i];
        } else {
          S.t_last[pos[i]] = (int32_t)j;
        }
        S.local[e] = (int32_t)(pos[i] - t0);
      }
    }
    S.chunk_t.push_back((int64_t)S.t_tile.size());
  }
  const int64_t nt = (int64_t)S.t_tile.size();
  S.t_slot.assign(nt, -1);
  S.q_ptr.assign(nqb + 1, 0);
  for (int64_t i = 0; i < nqb; ++i) S.q_ptr[i + 1] = S.q_ptr[i] + (count[i] > 1 ? count[i] : 0);
  S.q_slots.assign(S.q_ptr[nqb], 0);
  std::vector<int64_t> fill(S.q_ptr.begin(), S.q_ptr.end() - 1);
  int64_t slots = 0;
  for (int64_t t = 0; t < nt; ++t) {  // chunk by chunk: each tile's slots come in chunk order
    const int32_t i = S.t_tile[t];
    if (count[i] > 1) {
      S.t_slot[t] = slots;
      S.q_slots[fill[i]++] = slots++;
    }
  }
  S.t_flush.assign(nt, 0);
  S.chunk_live.assign(C, 0);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t t0 = S.chunk_t[c], t1 = S.chunk_t[c + 1];
    for (int64_t t = t0; t < t1; ++t) S.t_flush[t] = (int32_t)(t - t0);
    std::stable_sort(S.t_flush.begin() + t0, S.t_flush.begin() + t1,
                     [&](int32_t a, int32_t b) { return S.t_last[t0 + a] < S.t_last[t0 + b]; });
    // most tiles alive at once: opened at t_first, released after t_last
    int64_t live = 0, best = 0, f = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (f < t1 - t0 && S.t_last[t0 + S.t_flush[t0 + f]] < S.t_first[t]) {
        --live;
        ++f;
      }
      best = std::max(best, ++live);
    }
    S.chunk_live[c] = (int32_t)best;
  }
  return slots * P.B * P.Hkv * P.G * L.bq * P.Dp * 8;
}

// Query heads of a group per pass over a chunk. A column's step reads and writes the dQ tiles of
// every query tile it reaches, for each head of the group: with many heads over long rows (GQA)
// they leave the core's cache between columns, and the backward ran markedly slower than the
// same heads without grouping (measured: docs/cpu.md, Measurements behind the code). Passes of
// fewer heads keep them in cache, at the price of packing K_j, V_j once per pass and holding
// dK_j, dV_j of the chunk's columns between passes. Chosen from the shape alone (not the thread
// count), so that a call's bits never depend on the machine.
constexpr int64_t DQ_CACHE = int64_t(1) << 20;  // bytes of live dQ tiles a pass aims to stay in
constexpr int64_t DKV_CAP = int64_t(256) << 20;  // most bytes of kept dK_j, dV_j (all columns)

int64_t backward_heads(const Problem& P) {
  const Layout& L = P.lay;
  const int64_t head = L.nqb * L.bq * P.Dp * 8;  // one head's dQ tiles, if every tile is live
  if (P.G == 1 || head * P.G <= DQ_CACHE) return P.G;
  if (L.nkb * BK * (P.Dp + P.Dvp) * 8 > DKV_CAP) return P.G;  // a chunk's are at most these
  return std::max<int64_t>(1, std::min<int64_t>(P.G, DQ_CACHE / head));
}

}  // namespace

void plan_backward(const Problem& P, BwdState& S) {
  const Layout& L = P.lay;
  const int64_t BH = P.B * P.Hkv;
  int64_t nonempty = 0;
  for (int64_t j = 0; j < L.nkb; ++j) nonempty += L.col_ptr[j + 1] > L.col_ptr[j];
  // Chunks per (b, kv head): enough items to share, counted in query heads (an item holds the G
  // heads of its group), but at least a quarter as many items (one a thread beyond 4 threads, so
  // that the cut depends on the problem alone up to 4). Each further chunk adds a dQ partial of
  // every query tile it reaches (G heads of them): counted in kv heads, GQA 14:2 at N = 2048 cut
  // its columns in 8 chunks where 2 do, held several times the partials, and ran slower
  // (measured: docs/cpu.md, Measurements behind the code).
  const int64_t T = target_items();
  const int64_t by_heads = (T + P.B * P.H - 1) / std::max<int64_t>(1, P.B * P.H);
  int64_t C = std::min<int64_t>(std::max<int64_t>({1, by_heads, (T / 4 + BH - 1) / BH}),
                                std::max<int64_t>(1, nonempty));
  int64_t bytes = chunk_columns(P, C, S);
  while (bytes > STORE_CAP && C > 1) {
    C = std::max<int64_t>(1, C / 2);
    bytes = chunk_columns(P, C, S);
  }
  const int64_t n_chunks = (int64_t)S.chunk_j.size() - 1;
  std::vector<int64_t> work(n_chunks);
  std::vector<int32_t> order;
  for (int64_t c = 0; c < n_chunks; ++c) {
    work[c] = L.col_ptr[S.chunk_j[c + 1]] - L.col_ptr[S.chunk_j[c]];
    if (work[c] > 0) order.push_back((int32_t)c);
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return work[a] > work[b]; });
  for (int32_t c : order)
    for (int64_t bh = 0; bh < BH; ++bh) S.items.push_back({(int32_t)(bh / P.Hkv), (int32_t)(bh % P.Hkv), c});
  S.done.assign(BH * L.nqb, 0);
  S.store.reset(bytes > 0 ? new double[bytes / 8] : nullptr);
  // every field by name, in BwdPlan's order (the compiler checks both)
  S.plan = BwdPlan{.items = S.items.data(), .n_items = (int64_t)S.items.size(),
                   .chunk_j = S.chunk_j.data(), .chunk_t = S.chunk_t.data(),
                   .t_tile = S.t_tile.data(), .t_first = S.t_first.data(), .t_last = S.t_last.data(),
                   .t_slot = S.t_slot.data(), .t_flush = S.t_flush.data(), .local = S.local.data(),
                   .chunk_live = S.chunk_live.data(), .heads = backward_heads(P),
                   .q_ptr = S.q_ptr.data(), .q_slots = S.q_slots.data(),
                   .done = S.done.data(), .store = S.store.get()};
}

}  // namespace qkv_cpu
