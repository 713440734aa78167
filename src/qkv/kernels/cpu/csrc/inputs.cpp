// The ops' arguments checked and read into what the kernel takes (problem.h): the tensors q,
// k, v and the score modifiers into a Problem, the tile lists into its Layout.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "inputs.h"

namespace qkv_cpu {
namespace {

int32_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DT_F32;
    case at::kBFloat16: return DT_BF16;
    case at::kHalf: return DT_F16;
    default: TORCH_CHECK(false, "qkv_cpu: unsupported dtype ", t.scalar_type());
  }
  return DT_F32;
}


}  // namespace

// the kernel reads rows: the last dim must be dense
at::Tensor rows_dense(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

View view_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

namespace {

void check_index(const at::Tensor& t, at::ScalarType st, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == st && t.is_contiguous() && t.dim() == 1,
              "qkv_cpu: ", name, " must be a contiguous 1-D CPU tensor of ", st);
}

}  // namespace

Layout layout_of(const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& code,
                 const at::Tensor& col_ptr, const at::Tensor& row_idx, const at::Tensor& code_t,
                 const at::Tensor& bits, const std::optional<at::Tensor>& q_starts,
                 const std::optional<at::Tensor>& k_starts, int64_t bq, int64_t Nq, int64_t Nk,
                 int64_t B, int64_t H, int64_t Hkv) {
  TORCH_CHECK(bq >= 1, "qkv_cpu: block_q must be ≥ 1");
  const bool ragged = q_starts.has_value() && q_starts->defined();
  TORCH_CHECK(ragged == (k_starts.has_value() && k_starts->defined()),
              "qkv_cpu: q_starts and k_starts come together");
  // tile origins: the uniform grid, or the given starts (each tile 1 … bq rows / 1 … 64 keys)
  auto check_starts = [&](const at::Tensor& t, int64_t n, int64_t most, const char* what) {
    check_index(t, at::kLong, what);
    TORCH_CHECK(t.numel() >= 1, "qkv_cpu: ", what, " is empty");
    const int64_t* p = t.data_ptr<int64_t>();
    const int64_t m = t.numel() - 1;
    TORCH_CHECK(p[0] == 0 && p[m] == n, "qkv_cpu: ", what, " must run from 0 to ", n);
    for (int64_t i = 0; i < m; ++i)
      TORCH_CHECK(p[i + 1] > p[i] && p[i + 1] - p[i] <= most, "qkv_cpu: ", what,
                  " must rise by 1 … ", most, " per tile");
    return m;
  };
  const int64_t nqb = ragged ? check_starts(*q_starts, Nq, bq, "q_starts") : (Nq + bq - 1) / bq;
  const int64_t nkb = ragged ? check_starts(*k_starts, Nk, BK, "k_starts") : (Nk + BK - 1) / BK;
  TORCH_CHECK(bits.device().is_cpu() && bits.scalar_type() == at::kLong && bits.is_contiguous() &&
                  bits.dim() == 4 && bits.size(3) == bq,
              "qkv_cpu: bits must be a contiguous int64 (P, Bm, Hm, block_q) tensor");
  const int64_t bm = bits.size(1), hm = bits.size(2);
  TORCH_CHECK((bm == 1 || bm == B) && (hm == 1 || hm == H), "qkv_cpu: bits must be (P, 1|B, 1|H, bq)");
  Layout L{};
  L.bq = bq;
  L.nqb = nqb;
  L.nkb = nkb;
  L.bits = reinterpret_cast<const uint64_t*>(bits.data_ptr<int64_t>());
  L.bm = bm;
  L.hm = hm;
  L.q_starts = ragged ? q_starts->data_ptr<int64_t>() : nullptr;
  L.k_starts = ragged ? k_starts->data_ptr<int64_t>() : nullptr;
  const int64_t P = bits.size(0);
  // `groups` CSRs back to back, each continuing where the one before ends
  auto check_csr = [&](const at::Tensor& ptr, const at::Tensor& idx, const at::Tensor& cd,
                       int64_t n_rows, int64_t n_cols, int64_t groups, const char* what) {
    check_index(ptr, at::kLong, what);
    check_index(idx, at::kInt, what);
    check_index(cd, at::kInt, what);
    TORCH_CHECK(ptr.numel() == groups * (n_rows + 1) && idx.numel() == cd.numel(), "qkv_cpu: ",
                what, " has the wrong size for this problem");
    const int64_t* p = ptr.data_ptr<int64_t>();
    const int32_t* ix = idx.data_ptr<int32_t>();
    const int32_t* c = cd.data_ptr<int32_t>();
    int64_t end = 0;
    for (int64_t g = 0; g < groups; ++g, p += n_rows + 1) {
      TORCH_CHECK(p[0] == end, "qkv_cpu: ", what, " is not a CSR");
      for (int64_t r = 0; r < n_rows; ++r)
        TORCH_CHECK(p[r] <= p[r + 1], "qkv_cpu: ", what, " is not a CSR");
      end = p[n_rows];
    }
    TORCH_CHECK(end == idx.numel(), "qkv_cpu: ", what, " is not a CSR");
    for (int64_t e = 0; e < idx.numel(); ++e)
      TORCH_CHECK(ix[e] >= 0 && ix[e] < n_cols && c[e] >= TILE_FULL && c[e] < P, "qkv_cpu: ", what,
                  " holds an index out of range");
  };
  L.ng = 1;
  if (row_ptr.defined()) {
    L.ng = row_ptr.numel() == nqb + 1 ? 1 : B * Hkv;
    TORCH_CHECK(!col_ptr.defined() || L.ng == 1,
                "qkv_cpu: the backward reads one tile list for all heads");
    check_csr(row_ptr, col_idx, code, nqb, nkb, L.ng, "the forward tile list");
    L.row_ptr = row_ptr.data_ptr<int64_t>();
    L.col_idx = col_idx.data_ptr<int32_t>();
    L.code = code.data_ptr<int32_t>();
  }
  if (col_ptr.defined()) {
    check_csr(col_ptr, row_idx, code_t, nkb, nqb, 1, "the backward tile list");
    L.col_ptr = col_ptr.data_ptr<int64_t>();
    L.row_idx = row_idx.data_ptr<int32_t>();
    L.code_t = code_t.data_ptr<int32_t>();
  }
  return L;
}


Inputs inputs_of(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                 double scale, const std::optional<at::Tensor>& slopes, double softcap,
                 bool alibi_after_softcap, double dropout_p, int64_t dropout_seed,
                 bool precise_scores) {
  Inputs in;
  TORCH_CHECK(q_.dim() == 4 && k_.dim() == 4 && v_.dim() == 4, "qkv_cpu: q, k, v must be 4-D");
  TORCH_CHECK(q_.device().is_cpu() && k_.device().is_cpu() && v_.device().is_cpu(),
              "qkv_cpu: q, k, v must be CPU tensors");
  TORCH_CHECK(q_.scalar_type() == k_.scalar_type() && q_.scalar_type() == v_.scalar_type(),
              "qkv_cpu: q, k, v must share a dtype");
  in.q = rows_dense(q_);
  in.k = rows_dense(k_);
  in.v = rows_dense(v_);
  Problem& P = in.P;
  P.B = q_.size(0);
  P.H = q_.size(1);
  P.Nq = q_.size(2);
  P.D = q_.size(3);
  P.Hkv = k_.size(1);
  P.Nk = k_.size(2);
  P.Dv = v_.size(3);
  TORCH_CHECK(k_.size(0) == P.B && v_.size(0) == P.B && k_.size(3) == P.D &&
                  v_.size(1) == P.Hkv && v_.size(2) == P.Nk && P.Hkv > 0 && P.H % P.Hkv == 0,
              "qkv_cpu: shapes of q, k, v do not form an attention problem");
  P.G = P.H / P.Hkv;
  P.dot_scores = P.Nq * P.G <= 16 ? 1 : 0;
  P.Dp = (P.D + 15) / 16 * 16;
  P.Dvp = (P.Dv + 15) / 16 * 16;
  P.dtype = dtype_code(in.q);
  P.precise_scores = P.dtype == DT_F32 && precise_scores ? 1 : 0;
  P.q = view_of(in.q);
  P.k = view_of(in.k);
  P.v = view_of(in.v);
  P.mods.scale = (float)scale;
  P.mods.scale64 = scale;
  P.mods.cap = (float)softcap;
  P.mods.alibi_after_cap = alibi_after_softcap ? 1 : 0;
  P.mods.slopes = nullptr;
  if (slopes.has_value() && slopes->defined()) {
    in.slopes = slopes->to(at::kFloat).contiguous();
    TORCH_CHECK(in.slopes.numel() == P.H, "qkv_cpu: slopes must hold one value per query head");
    P.mods.slopes = in.slopes.data_ptr<float>();
  }
  P.score_lo = P.precise_scores && P.mods.cap == 0.0f && !P.mods.slopes ? 1 : 0;
  P.exact_dkv = P.exact_dq = 0;  // the backward decides (exact_sums)
  P.drop.on = dropout_p > 0.0 ? 1 : 0;
  if (P.drop.on) {
    TORCH_CHECK(dropout_p < 1.0 && dropout_seed >= 0, "qkv_cpu: bad dropout arguments");
    const uint64_t seed = (uint64_t)dropout_seed;
    P.drop.s0 = (uint32_t)(seed & 0xFFFFFFFFu);
    P.drop.s1 = (uint32_t)((seed >> 32) & 0xFFFFFFFFu);
    const double thr = std::floor(dropout_p * 4294967296.0 + 0.5);  // as qkv.dropout.keep_mask
    P.drop.threshold = (uint64_t)std::min(thr, 4294967296.0);
    P.drop.keep_scale = (float)(1.0 / (1.0 - dropout_p));
  }
  return in;
}

}  // namespace qkv_cpu
