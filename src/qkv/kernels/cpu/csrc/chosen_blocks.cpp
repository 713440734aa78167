// Blocks chosen by the content (`qkv.sparse.select_blocks`), the two steps around the kernel
// call that torch operations would spend dozens of small calls on:
// - `choose_blocks`: each (group, query block) pools its queries, scores them against the key
//   blocks' means, and keeps its forced blocks and its top-k others (or those within a share of
//   the softmax mass);
// - `chosen_layout`: the kernel's arrays of every group straight from those block lists.
// A decoding step pays each torch call's fixed cost (and, after the other layers' work has
// evicted the caches, a cold one), so one pass here keeps the step at a small share of the
// dense step.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "tile_bits.h"

namespace qkv_cpu {
namespace {

using Scored = std::pair<float, int64_t>;  // a block's score and the block

// higher score first, the lower block on a tie
inline bool better(const Scored& a, const Scored& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The blocks one query block reads, ascending: the forced ones (its `local` nearest, up to
// `own`, and the `sink` first) within [0, reach], and the best others by score: at most `topk`
// (< 0: no cap), and with a threshold (> 0) only while the kept blocks hold less than that
// share of the softmax mass over the blocks it may read.
void choose_row(const float* s, int64_t own, int64_t reach, int64_t topk, double threshold,
                double scale, int64_t local, int64_t sink, std::vector<int64_t>& picks,
                std::vector<Scored>& best) {
  picks.clear();
  best.clear();
  for (int64_t t = 0; t < local; ++t)
    if (own - t >= 0 && own - t <= reach) picks.push_back(own - t);
  for (int64_t t = 0; t < sink && t <= reach; ++t)
    if (t <= own - local || t > own) picks.push_back(t);  // not already a local one
  const size_t n_forced = picks.size();
  const auto forced = [&](int64_t j) {
    return (j <= own && j > own - local) || j < std::min(sink, reach + 1);
  };
  const size_t cap = topk < 0 ? SIZE_MAX : (size_t)topk;
  for (int64_t j = 0; j <= reach && cap > 0; ++j) {
    const Scored x{s[j], j};
    if (!(x.first > -std::numeric_limits<float>::infinity()) || forced(j)) continue;
    if (best.size() == cap) {  // full: most candidates fail this one test
      if (!better(x, best.back())) continue;
      best.pop_back();
    }
    best.push_back(x);
    if (topk >= 0)  // kept in order while capped; sorted once at the end otherwise
      for (size_t at = best.size() - 1; at > 0 && better(best[at], best[at - 1]); --at)
        std::swap(best[at], best[at - 1]);
  }
  if (topk < 0) std::sort(best.begin(), best.end(), better);
  if (threshold > 0) {
    double top = -std::numeric_limits<double>::infinity(), total = 0.0, mass = 0.0;
    for (int64_t j = 0; j <= reach; ++j) top = std::max(top, (double)s[j]);
    if (std::isfinite(top)) {
      for (int64_t j = 0; j <= reach; ++j) total += std::exp(((double)s[j] - top) * scale);
      for (size_t t = 0; t < n_forced; ++t) mass += std::exp(((double)s[picks[t]] - top) * scale);
      mass /= total;
    }
    size_t kept = 0;
    for (; kept < best.size() && mass < threshold; ++kept)
      mass += std::exp(((double)best[kept].first - top) * scale) / total;
    best.resize(kept);
  }
  for (const Scored& x : best) picks.push_back(x.second);
  std::sort(picks.begin(), picks.end());
}

// The pooled query of query block r of group (b, hkv): the mean of its rows over the G heads of
// the group, in float, into qp (D)
template <typename T>
void pool_query(const T* q, const int64_t* st, int64_t b, int64_t hkv, int64_t G, int64_t r0,
                int64_t r1, int64_t D, float* qp) {
  std::fill(qp, qp + D, 0.0f);
  for (int64_t h = hkv * G; h < (hkv + 1) * G; ++h)
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = q + b * st[0] + h * st[1] + r * st[2];
      for (int64_t d = 0; d < D; ++d) qp[d] += (float)row[d];
    }
  const float n = (float)((r1 - r0) * G);
  for (int64_t d = 0; d < D; ++d) qp[d] /= n;
}

// s[j] = qp · kp[j] for the nks pooled keys (rows of D floats): 16 running sums a key, in a
// fixed order (vectorized without reassociating)
void pooled_scores(const float* qp, const float* kp, int64_t nks, int64_t D, float* s) {
  constexpr int64_t L = 16;
  for (int64_t j = 0; j < nks; ++j) {
    const float* k = kp + j * D;
    float acc[L] = {};
    int64_t d = 0;
    for (; d + L <= D; d += L)
      for (int64_t x = 0; x < L; ++x) acc[x] += qp[d + x] * k[d + x];
    for (int64_t x = 0; d + x < D; ++x) acc[x] += qp[d + x] * k[d + x];
    float sum = 0.0f;
    for (int64_t x = 0; x < L; ++x) sum += acc[x];
    s[j] = sum;
  }
}

// q (B, H, Nq, D) float32, bfloat16 or float16, unit stride in D; kp (B, Hkv, nks, D) float32:
// the key blocks' means. Query block r (rows r·block …) scores key block j by its pooled query
// (mean over rows and the group's heads) · kp[j], scaled by `scale` where the softmax mass is
// asked for; own[r], reach[r]: its own block and the last block it may read (−1: none).
// topk < 0: no cap; threshold ≤ 0: none. int64 (B, Hkv, R, W): each row's blocks ascending, −1
// padded. No score matrix is kept: each (group, query block) scores the keys on its own.
at::Tensor choose_blocks(const at::Tensor& q_in, const at::Tensor& kp_in, int64_t block,
                         at::IntArrayRef own, at::IntArrayRef reach, int64_t topk,
                         double threshold, double scale, int64_t local, int64_t sink) {
  TORCH_CHECK(q_in.dim() == 4 && kp_in.dim() == 4 && kp_in.scalar_type() == at::kFloat,
              "choose_blocks: q must be (B, H, Nq, D) and kp a float32 (B, Hkv, nks, D) tensor");
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor kp = kp_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = kp.size(1), nks = kp.size(2), R = (int64_t)own.size();
  TORCH_CHECK(kp.size(0) == B && kp.size(3) == D && Hkv > 0 && H % Hkv == 0 && block > 0 &&
                  Nq > 0 && (int64_t)reach.size() == R && R == (Nq + block - 1) / block,
              "choose_blocks: q, kp, block, own and reach disagree");
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(reach[r] < nks && own[r] < nks, "choose_blocks: a block past the keys");
  const int64_t G = H / Hkv, items = B * Hkv * R;
  const int64_t st[3] = {q.stride(0), q.stride(1), q.stride(2)};
  const float* kpp = kp.data_ptr<float>();
  std::vector<std::vector<int64_t>> rows((size_t)items);
  const auto run = [&](const auto* qp_data) {
    // an item scores nks·D products: one each is worth a thread (a decoding step has B·Hkv)
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> qp((size_t)D), s((size_t)nks);
      std::vector<Scored> best;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t bh = i / R, r = i % R, b = bh / Hkv, hkv = bh % Hkv;
        pool_query(qp_data, st, b, hkv, G, r * block, std::min(Nq, (r + 1) * block), D, qp.data());
        pooled_scores(qp.data(), kpp + bh * nks * D, nks, D, s.data());
        choose_row(s.data(), own[r], reach[r], topk, threshold, scale, local, sink,
                   rows[(size_t)i], best);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(q.data_ptr<float>()); break;
    case at::kBFloat16: run(q.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(q.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "choose_blocks: q must be float32, bfloat16 or float16");
  }
  size_t width = 0;
  for (const auto& picks : rows) width = std::max(width, picks.size());
  at::Tensor index =
      at::full({B, Hkv, R, (int64_t)width}, -1, at::TensorOptions().dtype(at::kLong));
  int64_t* ip = index.data_ptr<int64_t>();
  for (size_t a = 0; a < rows.size(); ++a) std::copy(rows[a].begin(), rows[a].end(), ip + a * width);
  return index;
}

// One kept tile: its group, query tile, key tile and PARTIAL index (−1: FULL)
struct Tile {
  int64_t group, row, col;
  int32_t code;
};

// The least and the greatest of each query tile's last visible keys: a key tile past the
// greatest holds no key any row sees, one up to the least is whole for every row
struct TileReach {
  std::vector<int64_t> least, most;

  TileReach(const int64_t* last, int64_t nq, int64_t nk, int64_t block_q) {
    const int64_t nqb = (nq + block_q - 1) / block_q;
    least.assign((size_t)nqb, nk - 1);
    most.assign((size_t)nqb, nk - 1);
    for (int64_t i = 0; last && i < nqb; ++i) {
      const int64_t r0 = i * block_q, r1 = std::min(nq, r0 + block_q);
      least[(size_t)i] = *std::min_element(last + r0, last + r1);
      most[(size_t)i] = *std::max_element(last + r0, last + r1);
    }
  }
};

// index int64 (..., nqs, kmax) ascending, −1 padded: each group's (the leading dimensions,
// flattened: G of them) chosen key blocks of `block` keys (a multiple of 64 and of block_q) per
// query block. Query row r sees the chosen keys up to last[r] (int64 (Nq,), negative: none;
// absent: every key): the rows' intervals, worked out in Python (`qkv.layout.chosen_tiles`).
// The forward and backward arrays of all groups back to back: row pointers (G·(nqb + 1)) and
// column pointers (G·(nkb + 1)) into one tile list, PARTIAL codes counted over all groups
// (group-major), their bits (P, 1, 1, block_q), and `parts` (G + 1): where each group's
// PARTIAL tiles start.
std::vector<at::Tensor> chosen_layout(const at::Tensor& index_in,
                                      const std::optional<at::Tensor>& last_in, int64_t block,
                                      int64_t nq, int64_t nk, int64_t block_q) {
  TORCH_CHECK(index_in.dim() >= 2 && index_in.scalar_type() == at::kLong,
              "chosen_layout: index must be an int64 (..., query blocks, kmax) tensor");
  TORCH_CHECK(nq > 0 && nk > 0 && block_q > 0 && block % BK == 0 && block % block_q == 0,
              "chosen_layout: blocks must be whole key tiles and hold whole query tiles");
  const at::Tensor index = index_in.contiguous();
  const int64_t nqs = index.size(-2), kmax = index.size(-1);
  int64_t G = 1;
  for (int64_t d = 0; d < index.dim() - 2; ++d) G *= index.size(d);
  const int64_t nqb = (nq + block_q - 1) / block_q, nkb = (nk + BK - 1) / BK, per = block / BK;
  TORCH_CHECK(nqs * block >= nq, "chosen_layout: too few query blocks for q_len");
  at::Tensor last_t;
  if (last_in.has_value()) {
    last_t = last_in->contiguous();
    TORCH_CHECK(last_t.scalar_type() == at::kLong && last_t.dim() == 1 && last_t.size(0) == nq,
                "chosen_layout: last must be an int64 (Nq,) tensor");
  }
  const int64_t* last = last_in.has_value() ? last_t.data_ptr<int64_t>() : nullptr;
  const TileReach reach(last, nq, nk, block_q);
  const int64_t* ip = index.data_ptr<int64_t>();
  std::vector<Tile> tiles;
  int32_t n_parts = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nqb; ++i) {
      const int64_t r0 = i * block_q;
      const int64_t* picks = ip + (g * nqs + r0 / block) * kmax;
      for (int64_t a = 0; a < kmax && picks[a] >= 0; ++a)
        for (int64_t j = picks[a] * per; j < (picks[a] + 1) * per && j < nkb; ++j) {
          const int64_t k_lo = j * BK, k_hi = std::min(nk, k_lo + BK) - 1;
          if (k_lo > reach.most[(size_t)i]) continue;  // no key visible to any row
          const bool full = k_hi <= reach.least[(size_t)i];
          tiles.push_back({g, i, j, full ? -1 : n_parts++});
        }
    }
  const int64_t nnz = (int64_t)tiles.size();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor row_ptr = at::zeros({G * (nqb + 1)}, i64), col_ptr = at::zeros({G * (nkb + 1)}, i64);
  at::Tensor col_idx = at::empty({nnz}, i32), code = at::empty({nnz}, i32);
  at::Tensor row_idx = at::empty({nnz}, i32), code_t = at::empty({nnz}, i32);
  at::Tensor bits = at::zeros({n_parts, 1, 1, block_q}, i64), parts = at::zeros({G + 1}, i64);
  int64_t* rp = row_ptr.data_ptr<int64_t>();
  int64_t* cp = col_ptr.data_ptr<int64_t>();
  int64_t* pp = parts.data_ptr<int64_t>();
  uint64_t* bp = reinterpret_cast<uint64_t*>(bits.data_ptr<int64_t>());
  for (int64_t t = 0; t < nnz; ++t) {
    const Tile& x = tiles[(size_t)t];
    ++rp[x.group * (nqb + 1) + x.row + 1];
    ++cp[x.group * (nkb + 1) + x.col + 1];
    col_idx.data_ptr<int32_t>()[t] = (int32_t)x.col;
    code.data_ptr<int32_t>()[t] = x.code;
    if (x.code < 0) continue;  // a PARTIAL tile only where `last` is given
    ++pp[x.group + 1];
    const int64_t first = x.col * BK, end = std::min(nk, first + BK) - 1;
    for (int64_t r = x.row * block_q; r < std::min(nq, (x.row + 1) * block_q); ++r)
      bp[(int64_t)x.code * block_q + r - x.row * block_q] =
          span_bits(first, std::min(end, last[r]), first);
  }
  // running sums over all groups: each group's pointers start where the one before it ends
  for (int64_t a = 0; a < G * (nqb + 1) - 1; ++a) rp[a + 1] += rp[a];
  for (int64_t a = 0; a < G * (nkb + 1) - 1; ++a) cp[a + 1] += cp[a];
  for (int64_t g = 0; g < G; ++g) pp[g + 1] += pp[g];
  // by key-tile column within each group, top to bottom (a stable counting sort)
  std::vector<int64_t> slot(cp, cp + G * (nkb + 1));
  for (int64_t t = 0; t < nnz; ++t) {
    const Tile& x = tiles[(size_t)t];
    const int64_t at = slot[(size_t)(x.group * (nkb + 1) + x.col)]++;
    row_idx.data_ptr<int32_t>()[at] = (int32_t)x.row;
    code_t.data_ptr<int32_t>()[at] = x.code;
  }
  return {row_ptr, col_idx, code, col_ptr, row_idx, code_t, bits, parts};
}

}  // namespace
}  // namespace qkv_cpu

TORCH_LIBRARY_FRAGMENT(qkv_cpu, m) {
  m.def(
      "choose_blocks(Tensor q, Tensor kp, int block, int[] own, int[] reach, int topk, "
      "float threshold, float scale, int local, int sink) -> Tensor",
      &qkv_cpu::choose_blocks);
  m.def(
      "chosen_layout(Tensor index, Tensor? last, int block, int q_len, int kv_len, int block_q) "
      "-> Tensor[]",
      &qkv_cpu::chosen_layout);
}
