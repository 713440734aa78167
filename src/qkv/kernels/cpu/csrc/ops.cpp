// The torch side of qkv's compiled CPU kernel: the ops `torch.ops.qkv_cpu.*` and their bodies.
// An op reads its arguments (inputs.h), takes the kernels of the requested path (isa_select.h),
// plans its work and runs it in one parallel region (schedule.h), and writes what no item writes.
// Nothing here depends on the ISA.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "inputs.h"
#include "interrupt.h"
#include "isa_select.h"
#include "problem.h"
#include "schedule.h"

#if defined(__linux__)
#include "results.h"
#endif

namespace qkv_cpu {
namespace {

// A float32 gradient of at most this many elements is summed exactly (gemm_acc_f64): the rule
// judges the kernel by the float32 reference's largest error, and over a few elements that
// maximum is often far below its typical size (a float sum that happens to land close), where
// the kernel's float chains keep their typical error: dV over 124 terms, 2 elements (Nq = 62,
// Nk = 2, D = 1, two heads per kv head) read 2.4 of the allowance. Such gradients are small, so
// their exact sums cost little.
constexpr int64_t EXACT_SUM_ELEMS = 4096;

void exact_sums(Problem& P) {
  const bool f32 = P.dtype == DT_F32;
  P.exact_dkv = f32 && P.B * P.Hkv * P.Nk * std::max(P.D, P.Dv) <= EXACT_SUM_ELEMS ? 1 : 0;
  P.exact_dq = f32 && P.B * P.H * P.Nq * P.D <= EXACT_SUM_ELEMS ? 1 : 0;
}

// Multiply-adds of one pass over the kept tiles (scores and values), the size of a call.
int64_t call_macs(const Problem& P, int64_t nnz) {
  return nnz * P.B * P.H * P.lay.bq * BK * (P.D + P.Dv);
}

// Rows of query tiles that keep no tile: no item writes them (out 0, lse −inf, m −inf, l 0).
void fill_empty_rows(const Problem& P, const at::Tensor& out) {
  const Layout& L = P.lay;
  const int64_t es = out.element_size();
  for (int64_t bh = 0; bh < P.B * P.H; ++bh) {
    const int64_t* rows = fwd_rows(P, bh / P.H, bh % P.H / P.G);
    for (int64_t i = 0; i < L.nqb; ++i) {
      if (rows[i + 1] > rows[i]) continue;
      const int64_t r0 = tile_r0(P, i), r1 = r0 + tile_nr(P, i);
      std::memset((char*)out.data_ptr() + (bh * P.Nq + r0) * P.Dv * es, 0, (r1 - r0) * P.Dv * es);
      for (int64_t r = r0; r < r1; ++r) {
        P.m[bh * P.Nq + r] = -std::numeric_limits<float>::infinity();
        P.l[bh * P.Nq + r] = 0.0;
        P.lse[bh * P.Nq + r] = -std::numeric_limits<float>::infinity();
      }
    }
  }
}

// Gradient rows no item writes: dQ rows of query tiles, dK/dV rows of key tiles, without tiles.
void zero_untouched(const Problem& P, const at::Tensor& dq, const at::Tensor& dk,
                    const at::Tensor& dv) {
  const Layout& L = P.lay;
  const int64_t es = dq.element_size();
  std::vector<char> touched(L.nqb, 0);
  for (int64_t e = 0; e < L.col_ptr[L.nkb]; ++e) touched[L.row_idx[e]] = 1;
  for (int64_t i = 0; i < L.nqb; ++i) {
    if (touched[i]) continue;
    const int64_t r0 = tile_r0(P, i), n = tile_nr(P, i);
    for (int64_t bh = 0; bh < P.B * P.H; ++bh)
      std::memset((char*)dq.data_ptr() + (bh * P.Nq + r0) * P.D * es, 0, n * P.D * es);
  }
  for (int64_t j = 0; j < L.nkb; ++j) {
    if (L.col_ptr[j + 1] > L.col_ptr[j]) continue;
    const int64_t c0 = tile_c0(P, j), n = tile_kw(P, j);
    for (int64_t bh = 0; bh < P.B * P.Hkv; ++bh) {
      std::memset((char*)dk.data_ptr() + (bh * P.Nk + c0) * P.D * es, 0, n * P.D * es);
      std::memset((char*)dv.data_ptr() + (bh * P.Nk + c0) * P.Dv * es, 0, n * P.Dv * es);
    }
  }
}

// A float32 output at least this large is written with non-temporal stores (any platform)
constexpr size_t STREAM_FROM_BYTES = size_t(8) << 20;

// A result, uninitialised. From 8 MiB on Linux its memory comes from results.h: huge pages, and
// the block of a freed result of the same size when one is kept.
at::Tensor empty_result(at::IntArrayRef size, const at::TensorOptions& opts) {
#if defined(__linux__)
  int64_t numel = 1;
  for (int64_t d : size) numel *= d;
  if ((size_t)numel * opts.dtype().itemsize() >= ResultMemory::FROM_BYTES)
    return at::detail::empty_generic(size, &ResultMemory::instance(),
                                     c10::DispatchKeySet(c10::DispatchKey::CPU),
                                     opts.dtype().toScalarType(), std::nullopt);
#endif
  return at::empty(size, opts);
}

// The bytes of kept result blocks unmapped (qkv.kernels.cpu.release_cached_results), and kept
#if defined(__linux__)
int64_t release_results() { return ResultMemory::instance().release(); }
int64_t kept_result_bytes() { return ResultMemory::instance().kept_bytes(); }
#else  // no result memory off Linux: nothing is kept
int64_t release_results() { return 0; }
int64_t kept_result_bytes() { return 0; }
#endif

// ---------------------------------------------------------------------------- the ops

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& row_ptr,
    const at::Tensor& col_idx, const at::Tensor& tile_code, const at::Tensor& bits,
    const std::optional<at::Tensor>& q_starts, const std::optional<at::Tensor>& k_starts,
    int64_t block_q, double scale, const std::optional<at::Tensor>& slopes, double softcap,
    bool alibi_after_softcap, double dropout_p, int64_t dropout_seed, bool precise_scores,
    const std::string& isa) {
  const Kernels& K = kernels_for(isa);
  Inputs in = inputs_of(q, k, v, scale, slopes, softcap, alibi_after_softcap, dropout_p,
                        dropout_seed, precise_scores);
  Problem& P = in.P;
  P.lay = layout_of(row_ptr, col_idx, tile_code, at::Tensor(), at::Tensor(), at::Tensor(), bits,
                    q_starts, k_starts, block_q, P.Nq, P.Nk, P.B, P.H, P.Hkv);
  const auto opts = in.q.options();
  // uninitialised: every row is written by an item or by fill_empty_rows
  at::Tensor out = empty_result({P.B, P.H, P.Nq, P.Dv}, opts);
  at::Tensor m = at::empty({P.B, P.H, P.Nq}, opts.dtype(at::kFloat));
  at::Tensor l = at::empty({P.B, P.H, P.Nq}, opts.dtype(at::kDouble));
  at::Tensor lse = at::empty({P.B, P.H, P.Nq}, opts.dtype(at::kFloat));
  P.out = view_of(out);
  // A large output is written once and not read by this call: its rows skip the caches (no
  // read-for-ownership of lines that are about to be overwritten whole)
  P.stream_out = P.dtype == DT_F32 && P.Dv % 16 == 0 &&
                 (size_t)out.numel() * 4 >= STREAM_FROM_BYTES;
  P.m = m.data_ptr<float>();
  P.l = l.data_ptr<double>();
  P.lse = lse.data_ptr<float>();
  fill_empty_rows(P, out);
  FwdState S;
  plan_forward(P, S);
  if (const int64_t share = K.fwd_share_elems(P)) {  // the key tiles' parts, packed once per call
    const int64_t tiles = P.B * P.Hkv * P.lay.nkb;
    S.kparts = at::empty({share}, at::TensorOptions().dtype(at::kInt));
    S.kstate.assign(tiles, KEY_TILE_IDLE);
    S.kbadv.assign(tiles, 0);
    S.kmaxv.assign(tiles, 0.0);
    S.plan.kparts = (uint32_t*)S.kparts.data_ptr<int32_t>();
    S.plan.kstate = S.kstate.data();
    S.plan.kbadv = S.kbadv.data();
    S.plan.kmaxv = S.kmaxv.data();
  }
  int32_t error = 0;
  InterruptScope interrupt;
  run_parallel(call_macs(P, fwd_kept(P.lay)), S.plan.n_items,
               [&](ItemQueue* items) { K.forward(P, S.plan, items, &error); });
  interrupt.finish();
  if (error) throw std::bad_alloc();
  return {out, m, l, lse};
}

// The formula's NaN gradients of rows whose q and output both hold a NaN or inf (flagged by the
// row pass: flag_bad_rows, backward.h): their dq rows, and all of dK and dV of their kv heads.
// Rare: one look at the flags, nothing more where none is set.
void poison_grads(const Problem& P, const at::Tensor& bad_rows, at::Tensor& dq, at::Tensor& dk,
                  at::Tensor& dv) {
  if (!bad_rows.any().item<bool>()) return;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  dq.masked_fill_(bad_rows.unsqueeze(-1), nan);
  const at::Tensor heads = bad_rows.view({P.B, P.Hkv, -1}).any(-1).view({P.B, P.Hkv, 1, 1});
  dk.masked_fill_(heads, nan);
  dv.masked_fill_(heads, nan);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& dlse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& m,
    const at::Tensor& l, const at::Tensor& row_ptr, const at::Tensor& col_idx,
    const at::Tensor& tile_code, const at::Tensor& col_ptr, const at::Tensor& row_idx,
    const at::Tensor& tile_code_t, const at::Tensor& bits,
    const std::optional<at::Tensor>& q_starts, const std::optional<at::Tensor>& k_starts,
    int64_t block_q, double scale,
    const std::optional<at::Tensor>& slopes, double softcap, bool alibi_after_softcap,
    double dropout_p, int64_t dropout_seed, bool precise_scores, const std::string& isa) {
  const Kernels& K = kernels_for(isa);
  Inputs in = inputs_of(q, k, v, scale, slopes, softcap, alibi_after_softcap, dropout_p,
                        dropout_seed, precise_scores);
  Problem& P = in.P;
  TORCH_CHECK(dout.sizes() == out.sizes() && out.dim() == 4 && out.size(0) == P.B &&
                  out.size(1) == P.H && out.size(2) == P.Nq && out.size(3) == P.Dv,
              "qkv_cpu: dout and out must be (B, H, Nq, Dv)");
  if (P.B == 0 || P.H == 0 || P.Nq == 0 || P.Nk == 0) {
    // no pair attends: every gradient is 0 (and the plan below would divide by a zero count)
    const auto o = in.q.options();
    return {at::zeros({P.B, P.H, P.Nq, P.D}, o), at::zeros({P.B, P.Hkv, P.Nk, P.D}, o),
            at::zeros({P.B, P.Hkv, P.Nk, P.Dv}, o)};
  }
  P.lay = layout_of(row_ptr, col_idx, tile_code, col_ptr, row_idx, tile_code_t, bits, q_starts,
                    k_starts, block_q, P.Nq, P.Nk, P.B, P.H, P.Hkv);
  at::Tensor dout_c = rows_dense(dout.to(in.q.scalar_type()));
  // The column pass reads float32 rows of Q and dO in place where each row follows the last
  // (rows_in_place in bwd_item), else copies them per key column, query tile and head.
  // transformers hands both as views of (B, N, H, D), rows H·D apart: one copy of each here
  // instead: a GQA causal forward + backward went from behind SDPA to ahead of it (measured:
  // docs/cpu.md, Measurements behind the code).
  if (P.dtype == DT_F32 && P.precise_scores && !P.dot_scores && P.D == P.Dp && P.Dv == P.Dvp) {
    if (P.Nq > 1 && in.q.stride(2) != P.D) {
      in.q = in.q.contiguous();
      P.q = view_of(in.q);
    }
    if (P.Nq > 1 && dout_c.stride(2) != P.Dv) dout_c = dout_c.contiguous();
  }
  at::Tensor out_c = rows_dense(out.to(in.q.scalar_type()));
  at::Tensor m_c = m.to(at::kFloat).contiguous(), l_c = l.to(at::kDouble).contiguous();
  TORCH_CHECK(m_c.numel() == P.B * P.H * P.Nq && l_c.numel() == m_c.numel(),
              "qkv_cpu: m and l must be (B, H, Nq)");
  at::Tensor dlse_c;
  if (dlse.has_value() && dlse->defined()) {
    dlse_c = dlse->to(at::kFloat).contiguous();
    TORCH_CHECK(dlse_c.numel() == m_c.numel(), "qkv_cpu: dlse must be (B, H, Nq)");
  }
  P.dout = view_of(dout_c);
  P.out = view_of(out_c);
  P.m = m_c.data_ptr<float>();
  P.l = l_c.data_ptr<double>();
  P.dlse = dlse_c.defined() ? dlse_c.data_ptr<float>() : nullptr;
  exact_sums(P);
  const auto opts = in.q.options();
  // uninitialised: every row is written by an item or zeroed by zero_untouched
  at::Tensor dq = empty_result({P.B, P.H, P.Nq, P.D}, opts);
  at::Tensor dk = empty_result({P.B, P.Hkv, P.Nk, P.D}, opts);
  at::Tensor dv = empty_result({P.B, P.Hkv, P.Nk, P.Dv}, opts);
  P.dq = dq.data_ptr();
  P.dk = dk.data_ptr();
  P.dv = dv.data_ptr();
  zero_untouched(P, dq, dk, dv);
  // Δ = Σ P·dP / Σ P over the rows of query tiles that hold a peaked row, from the very P and
  // dP the backward computes (a row pass before the column pass; see delta_item)
  at::Tensor delta = at::empty({P.B * P.H * P.Nq}, opts.dtype(at::kDouble));
  P.delta = delta.data_ptr<double>();
  at::Tensor peaked = at::empty({P.B * P.Hkv * P.lay.nqb}, opts.dtype(at::kByte));
  P.peaked = peaked.data_ptr<uint8_t>();
  at::Tensor bad_rows = at::empty({P.B, P.H, P.Nq}, opts.dtype(at::kBool));
  P.bad_rows = (uint8_t*)bad_rows.data_ptr<bool>();
  InterruptScope interrupt;
  {
    int32_t error = 0;
    run_parallel(call_macs(P, P.lay.row_ptr[P.lay.nqb]), P.B * P.Hkv * P.lay.nqb,
                 [&](ItemQueue* items) { K.delta(P, items, &error); });
    interrupt.finish();
    if (error) throw std::bad_alloc();
  }
  BwdState S;
  plan_backward(P, S);
  int32_t error = 0;
  run_parallel(5 * call_macs(P, P.lay.col_ptr[P.lay.nkb]) / 2, S.plan.n_items,
               [&](ItemQueue* items) { K.backward(P, S.plan, items, &error); });
  interrupt.finish();
  if (error) throw std::bad_alloc();
  poison_grads(P, bad_rows, dq, dk, dv);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace qkv_cpu

TORCH_LIBRARY(qkv_cpu, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor row_ptr, Tensor col_idx, Tensor tile_code, "
      "Tensor bits, Tensor? q_starts, Tensor? k_starts, int block_q, float scale, Tensor? slopes, "
      "float softcap, bool alibi_after_softcap, float dropout_p, int dropout_seed, "
      "bool precise_scores, str isa) "
      "-> (Tensor out, Tensor m, Tensor l, Tensor lse)",
      &qkv_cpu::forward);
  m.def(
      "backward(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor m, "
      "Tensor l, Tensor row_ptr, Tensor col_idx, Tensor tile_code, Tensor col_ptr, Tensor row_idx, "
      "Tensor tile_code_t, Tensor bits, Tensor? q_starts, Tensor? k_starts, int block_q, "
      "float scale, Tensor? slopes, float softcap, bool alibi_after_softcap, float dropout_p, "
      "int dropout_seed, bool precise_scores, str isa) -> (Tensor dq, Tensor dk, Tensor dv)",
      &qkv_cpu::backward);
  m.def("isa_supported(str isa) -> bool", &qkv_cpu::isa_supported);
  m.def("best_isa() -> str", &qkv_cpu::best_isa);
  m.def("release_results() -> int", &qkv_cpu::release_results);
  m.def("kept_result_bytes() -> int", &qkv_cpu::kept_result_bytes);
}
