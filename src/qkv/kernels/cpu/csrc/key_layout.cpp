// The block layout of a key-padding mask, the same for every query row: `keys (Bm, Hm, Nk)`
// bool, with the causal flag. What `qkv.layout` + `cpu/layout.py`'s `encode` compute for it tile
// by tile (the arrays `CpuLayout` holds, equal to theirs), in one pass over the tiles: a decoding
// step with padding pays microseconds for its layout, not the hundreds that a few dozen small
// tensor operations cost.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace qkv_cpu {
namespace {

constexpr int64_t BK = 64;  // keys per tile (one uint64 of bits per tile row)

// the low n bits (n clamped to 0 … 64)
inline uint64_t low_bits(int64_t n) {
  if (n <= 0) return 0;
  if (n >= BK) return ~uint64_t(0);
  return (uint64_t(1) << n) - 1;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
key_layout(const at::Tensor& keys_in, int64_t nq, int64_t block_q, bool causal) {
  TORCH_CHECK(keys_in.dim() == 3 && keys_in.scalar_type() == at::kBool,
              "key_layout: keys must be a bool (Bm, Hm, Nk) tensor");
  TORCH_CHECK(nq > 0 && block_q > 0, "key_layout: nq and block_q must be positive");
  const at::Tensor keys = keys_in.contiguous();
  const int64_t bm = keys.size(0), hm = keys.size(1), nk = keys.size(2), bh = bm * hm;
  TORCH_CHECK(nk > 0, "key_layout: no keys");
  const int64_t nqb = (nq + block_q - 1) / block_q, nkb = (nk + BK - 1) / BK;
  const bool* kp = keys.data_ptr<bool>();

  // bits of each (b, h) and key tile
  std::vector<uint64_t> kbits((size_t)(bh * nkb), 0);
  for (int64_t s = 0; s < bh; ++s)
    for (int64_t c = 0; c < nk; ++c)
      if (kp[s * nk + c]) kbits[(size_t)(s * nkb + c / BK)] |= uint64_t(1) << (c % BK);

  // keys row r may reach: the first reach(r) (length, and causality bottom-right)
  auto reach = [&](int64_t r) -> int64_t {
    if (!causal) return nk;
    const int64_t last = r + nk - nq + 1;
    return last < nk ? last : nk;
  };

  std::vector<int64_t> t_row, t_col;
  std::vector<int32_t> code;
  std::vector<uint64_t> bits;  // (P, Bm, Hm, block_q)
  for (int64_t i = 0; i < nqb; ++i) {
    const int64_t r0 = i * block_q, r1 = std::min(nq, r0 + block_q);
    for (int64_t j = 0; j < nkb; ++j) {
      const int64_t first = j * BK;
      const uint64_t inside = low_bits(nk - first);  // the tile's keys
      bool any = false, full = true;
      for (int64_t r = r0; r < r1 && (full || !any); ++r) {
        const uint64_t row = low_bits(reach(r) - first);
        for (int64_t s = 0; s < bh; ++s) {
          const uint64_t b = row & kbits[(size_t)(s * nkb + j)];
          any |= b != 0;
          full &= b == inside;
        }
      }
      if (!any) continue;
      t_row.push_back(i);
      t_col.push_back(j);
      if (full) {
        code.push_back(-1);
        continue;
      }
      code.push_back((int32_t)(bits.size() / (size_t)(bh * block_q)));
      for (int64_t s = 0; s < bh; ++s)
        for (int64_t r = r0; r < r0 + block_q; ++r)
          bits.push_back(r < r1 ? low_bits(reach(r) - first) & kbits[(size_t)(s * nkb + j)] : 0);
    }
  }

  const int64_t nnz = (int64_t)t_row.size(), parts = (int64_t)(bits.size() / (size_t)(bh * block_q));
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor row_ptr = at::zeros({nqb + 1}, i64), col_ptr = at::zeros({nkb + 1}, i64);
  at::Tensor col_idx = at::empty({nnz}, i32), code_f = at::empty({nnz}, i32);
  at::Tensor row_idx = at::empty({nnz}, i32), code_t = at::empty({nnz}, i32);
  at::Tensor bits_t = at::empty({parts, bm, hm, block_q}, i64);
  int64_t* rp = row_ptr.data_ptr<int64_t>();
  int64_t* cp = col_ptr.data_ptr<int64_t>();
  for (int64_t t = 0; t < nnz; ++t) {
    ++rp[t_row[(size_t)t] + 1];
    ++cp[t_col[(size_t)t] + 1];
    col_idx.data_ptr<int32_t>()[t] = (int32_t)t_col[(size_t)t];
    code_f.data_ptr<int32_t>()[t] = code[(size_t)t];
  }
  for (int64_t i = 0; i < nqb; ++i) rp[i + 1] += rp[i];
  for (int64_t j = 0; j < nkb; ++j) cp[j + 1] += cp[j];
  // by key-tile column, top to bottom (the tiles are in row order: a stable counting sort)
  std::vector<int64_t> next(cp, cp + nkb);
  for (int64_t t = 0; t < nnz; ++t) {
    const int64_t at = next[(size_t)t_col[(size_t)t]]++;
    row_idx.data_ptr<int32_t>()[at] = (int32_t)t_row[(size_t)t];
    code_t.data_ptr<int32_t>()[at] = code[(size_t)t];
  }
  if (!bits.empty())
    std::memcpy(bits_t.data_ptr<int64_t>(), bits.data(), bits.size() * sizeof(uint64_t));
  return {row_ptr, col_idx, code_f, col_ptr, row_idx, code_t, bits_t};
}

}  // namespace
}  // namespace qkv_cpu

TORCH_LIBRARY_FRAGMENT(qkv_cpu, m) {
  m.def(
      "key_layout(Tensor keys, int q_len, int block_q, bool causal) -> (Tensor row_ptr, "
      "Tensor col_idx, Tensor tile_code, Tensor col_ptr, Tensor row_idx, Tensor tile_code_t, "
      "Tensor bits)",
      &qkv_cpu::key_layout);
}
