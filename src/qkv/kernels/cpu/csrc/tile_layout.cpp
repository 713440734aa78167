// The kernel's block layout (the arrays `CpuLayout` holds) in one pass over the tiles, for the
// problems whose allowed keys are intervals per query row: each row r may reach the union of R
// key intervals [lo[k, r], hi[k, r]] (`qkv.layout.row_intervals`: a built-in rule's exact key
// ranges and the causal rule, worked out in Python; lo absent: from key 0, hi absent: to the
// last key), cut by a key mask `keys (Bm, Hm, Nk)` the same for every row (a padded batch's, a
// decoding step's; absent: every key). Which pairs a rule allows is never decided here: only
// the intervals are read. What `qkv.layout` + `tile_encoding.py`'s `encode` compute with a few
// dozen tensor operations per chunk of tiles, here in one pass: a new length costs a small share
// of its call (measured: docs/cpu.md, Measurements behind the code).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "tile_bits.h"

namespace qkv_cpu {
namespace {

// The rows' allowed keys, as both passes read them: R intervals per row (absent: every key),
// clamped to the keys, and the key mask's bits per (b, h) and key tile
struct Rows {
  int64_t nq, nk, block_q, R = 1, bm = 1, hm = 1, bh = 1, nkb;
  at::Tensor lo_t, hi_t, keys;  // kept alive: lo and hi point into them
  const int64_t* lo = nullptr;
  const int64_t* hi = nullptr;
  std::vector<uint64_t> kbits;  // (bh, nkb), or empty: a tile's keys inside Nk
  std::vector<uint64_t> row_bits;  // tile_rows' result, block_q rows

  Rows(const std::optional<at::Tensor>& lo_in, const std::optional<at::Tensor>& hi_in,
       const std::optional<at::Tensor>& keys_in, int64_t nq_, int64_t nk_, int64_t block_q_)
      : nq(nq_), nk(nk_), block_q(block_q_), nkb((nk_ + BK - 1) / BK) {
    TORCH_CHECK(nq > 0 && nk > 0 && block_q > 0,
                "tile_layout: nq, nk and block_q must be positive");
    const auto bounds = [&](const std::optional<at::Tensor>& in, at::Tensor& t) -> const int64_t* {
      if (!in.has_value()) return nullptr;
      t = in->contiguous();
      TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == nq,
                  "tile_layout: lo and hi must be int64 (R, Nq) tensors");
      R = t.size(0);
      return t.data_ptr<int64_t>();
    };
    lo = bounds(lo_in, lo_t);
    hi = bounds(hi_in, hi_t);
    TORCH_CHECK(!lo || !hi || lo_t.sizes() == hi_t.sizes(),
                "tile_layout: lo and hi must be int64 (R, Nq) tensors");
    if (keys_in.has_value()) {
      keys = keys_in->contiguous();
      TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kBool && keys.size(2) == nk,
                  "tile_layout: keys must be a bool (Bm, Hm, Nk) tensor");
      bm = keys.size(0);
      hm = keys.size(1);
    }
    bh = bm * hm;
    // the key bits of each (b, h) and key tile
    if (keys_in.has_value()) {
      const bool* kp = keys.data_ptr<bool>();
      kbits.assign((size_t)(bh * nkb), 0);
      for (int64_t s = 0; s < bh; ++s)
        for (int64_t c = 0; c < nk; ++c)
          if (kp[s * nk + c]) kbits[(size_t)(s * nkb + c / BK)] |= uint64_t(1) << (c % BK);
    }
    row_bits.resize((size_t)block_q);
  }

  uint64_t key_bits(int64_t s, int64_t j) const {
    return kbits.empty() ? low_bits(nk - j * BK) : kbits[(size_t)(s * nkb + j)];
  }
  // interval k of row r, clamped to the keys: [a, b], empty when a > b
  std::pair<int64_t, int64_t> interval(int64_t k, int64_t r) const {
    const int64_t a = lo ? lo[k * nq + r] : 0, b = hi ? hi[k * nq + r] : nk - 1;
    return {std::max<int64_t>(a, 0), std::min(b, nk - 1)};
  }
  // the allowed keys of rows r0 … r0 + block_q − 1 of query tile i in key tile j, before the
  // key mask (rows past Nq: none), into row_bits
  void tile_rows(int64_t i, int64_t j) {
    const int64_t r0 = i * block_q, r1 = std::min(nq, r0 + block_q);
    const int64_t first = j * BK, last = std::min(nk, first + BK) - 1;
    for (int64_t r = r0; r < r0 + block_q; ++r) {
      uint64_t rb = 0;
      for (int64_t k = 0; r < r1 && k < R; ++k) {
        const auto [a, b] = interval(k, r);
        rb |= span_bits(std::max(a, first), std::min(b, last), first);
      }
      row_bits[(size_t)(r - r0)] = rb;
    }
  }
};

// The kept tiles in row order: query tile, key tile, code (−1 FULL, else the PARTIAL tile's
// index into the bits)
struct Kept {
  std::vector<int64_t> row, col;
  std::vector<int32_t> code;
  int64_t parts = 0;
};

// Pass 1: which tiles are kept, and which of those are FULL or PARTIAL
Kept kept_tiles(Rows& rows) {
  const int64_t nq = rows.nq, nk = rows.nk, block_q = rows.block_q;
  const int64_t nqb = (nq + block_q - 1) / block_q;
  Kept kept;
  std::vector<std::pair<int64_t, int64_t>> spans;  // candidate key tiles of a query tile
  for (int64_t i = 0; i < nqb; ++i) {
    const int64_t r0 = i * block_q, r1 = std::min(nq, r0 + block_q);
    // candidate key tiles: each interval's tile span over the rows, merged
    spans.clear();
    for (int64_t k = 0; k < rows.R; ++k) {
      int64_t t0 = rows.nkb, t1 = -1;
      for (int64_t r = r0; r < r1; ++r) {
        const auto [a, b] = rows.interval(k, r);
        if (a > b) continue;
        t0 = std::min(t0, a / BK);
        t1 = std::max(t1, b / BK);
      }
      if (t0 <= t1) spans.emplace_back(t0, t1);
    }
    std::sort(spans.begin(), spans.end());
    int64_t next = 0;  // key tiles below `next` are done
    for (const auto& [s0, s1] : spans) {
      for (int64_t j = std::max(s0, next); j <= s1; ++j) {
        rows.tile_rows(i, j);
        const uint64_t inside = low_bits(nk - j * BK);
        bool any = false, full = true;
        for (int64_t s = 0; s < rows.bh; ++s) {
          const uint64_t kb = rows.key_bits(s, j);
          for (int64_t r = 0; r < r1 - r0; ++r) {
            const uint64_t b = rows.row_bits[(size_t)r] & kb;
            any |= b != 0;
            full &= b == inside;
          }
        }
        if (!any) continue;
        kept.row.push_back(i);
        kept.col.push_back(j);
        kept.code.push_back(full ? -1 : (int32_t)kept.parts++);
      }
      next = std::max(next, s1 + 1);
    }
  }
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
tile_layout(const std::optional<at::Tensor>& lo_in, const std::optional<at::Tensor>& hi_in,
            const std::optional<at::Tensor>& keys_in, int64_t nq, int64_t nk, int64_t block_q) {
  Rows rows(lo_in, hi_in, keys_in, nq, nk, block_q);
  const Kept kept = kept_tiles(rows);
  const int64_t nqb = (nq + block_q - 1) / block_q, nkb = rows.nkb, bh = rows.bh;
  const int64_t nnz = (int64_t)kept.row.size();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor row_ptr = at::zeros({nqb + 1}, i64), col_ptr = at::zeros({nkb + 1}, i64);
  at::Tensor col_idx = at::empty({nnz}, i32), code_f = at::empty({nnz}, i32);
  at::Tensor row_idx = at::empty({nnz}, i32), code_t = at::empty({nnz}, i32);
  at::Tensor bits_t = at::empty({kept.parts, rows.bm, rows.hm, block_q}, i64);
  int64_t* rp = row_ptr.data_ptr<int64_t>();
  int64_t* cp = col_ptr.data_ptr<int64_t>();
  for (int64_t t = 0; t < nnz; ++t) {
    ++rp[kept.row[(size_t)t] + 1];
    ++cp[kept.col[(size_t)t] + 1];
    col_idx.data_ptr<int32_t>()[t] = (int32_t)kept.col[(size_t)t];
    code_f.data_ptr<int32_t>()[t] = kept.code[(size_t)t];
  }
  for (int64_t i = 0; i < nqb; ++i) rp[i + 1] += rp[i];
  for (int64_t j = 0; j < nkb; ++j) cp[j + 1] += cp[j];
  // by key-tile column, top to bottom (the tiles are in row order: a stable counting sort)
  std::vector<int64_t> slot(cp, cp + nkb);
  for (int64_t t = 0; t < nnz; ++t) {
    const int64_t at = slot[(size_t)kept.col[(size_t)t]]++;
    row_idx.data_ptr<int32_t>()[at] = (int32_t)kept.row[(size_t)t];
    code_t.data_ptr<int32_t>()[at] = kept.code[(size_t)t];
  }
  // pass 2: the bits of the PARTIAL tiles, written in place (no growing buffer: O(kept) memory)
  uint64_t* bp = reinterpret_cast<uint64_t*>(bits_t.data_ptr<int64_t>());
  for (int64_t t = 0; t < nnz; ++t) {
    const int32_t p = kept.code[(size_t)t];
    if (p < 0) continue;
    const int64_t j = kept.col[(size_t)t];
    rows.tile_rows(kept.row[(size_t)t], j);
    for (int64_t s = 0; s < bh; ++s) {
      const uint64_t kb = rows.key_bits(s, j);
      uint64_t* out = bp + ((int64_t)p * bh + s) * block_q;
      for (int64_t r = 0; r < block_q; ++r) out[r] = rows.row_bits[(size_t)r] & kb;
    }
  }
  return {row_ptr, col_idx, code_f, col_ptr, row_idx, code_t, bits_t};
}

}  // namespace
}  // namespace qkv_cpu

TORCH_LIBRARY_FRAGMENT(qkv_cpu, m) {
  m.def(
      "tile_layout(Tensor? lo, Tensor? hi, Tensor? keys, int q_len, int kv_len, int block_q) "
      "-> (Tensor row_ptr, Tensor col_idx, Tensor tile_code, Tensor col_ptr, "
      "Tensor row_idx, Tensor tile_code_t, Tensor bits)",
      &qkv_cpu::tile_layout);
}
