// The torch side of qkv's compiled CPU kernel: the ops `torch.ops.qkv_cpu.*`, their argument
// checks, the work plans (how rows and columns of tiles are cut into items), one parallel region
// per call on torch's own thread pool, and the choice of the ISA kernel (kernel.h compiled for
// AVX-512 with the AMX tiles, AVX-512, AVX2 or the baseline). Nothing here depends on the ISA.
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "interrupt.h"
#include "placement.h"
#include "problem.h"

#if defined(__linux__)
#include "results.h"
#endif

namespace qkv_cpu {
namespace {

#if defined(__x86_64__)
// AMX-TILE, AMX-BF16 and AVX512-BF16 (CPUID leaf 7), and the OS's leave to use the tile state
// (Linux hands it to a process that asks: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)); asked
// once per process
bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tiles = (d >> 24) & 1u, tile_bf16 = (d >> 22) & 1u;
    if (!(tiles && tile_bf16 && __builtin_cpu_supports("avx512bf16"))) return false;
#if defined(__linux__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return false;
#endif
  }();
  return ok;
}
#endif

bool isa_supported(const std::string& isa) {
  if (isa == "portable") return true;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (isa == "avx512") return avx512;
  if (isa == "avx512bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
  if (isa == "amx") return avx512 && amx_usable();
#endif
  return false;
}

// The widest path, except that avx512bf16 stands before avx512 on AMD CPUs only: Zen 4 and 5 run
// VDPBF16PS at twice their float32 FMA rate, Intel's AVX512-BF16 cores at half of it (measured
// on a Sapphire Rapids core, 110 against 220 GFLOP/s), where widening to float32 is faster.
std::string best_isa() {
  if (isa_supported("amx")) return "amx";
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd") && isa_supported("avx512bf16")) return "avx512bf16";
#endif
  for (const char* isa : {"avx512", "avx2"})
    if (isa_supported(isa)) return isa;
  return "portable";
}

const Kernels& kernels_for(const std::string& isa) {
  TORCH_CHECK(isa == "amx" || isa == "avx512bf16" || isa == "avx512" || isa == "avx2" ||
                  isa == "portable",
              "qkv_cpu: unknown ISA '", isa, "' (expected amx, avx512bf16, avx512, avx2 or portable)");
  TORCH_CHECK(isa_supported(isa), "qkv_cpu: this CPU lacks the instructions of the '", isa,
              "' kernel");
#if defined(__x86_64__)
  if (isa == "amx") return amx::kernels;
  if (isa == "avx512bf16") return avx512bf16::kernels;
  if (isa == "avx512") return avx512::kernels;
  if (isa == "avx2") return avx2::kernels;
#endif
  return portable::kernels;
}

int32_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DT_F32;
    case at::kBFloat16: return DT_BF16;
    case at::kHalf: return DT_F16;
    default: TORCH_CHECK(false, "qkv_cpu: unsupported dtype ", t.scalar_type());
  }
  return DT_F32;
}

// the kernel reads rows: the last dim must be dense
at::Tensor rows_dense(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

View view_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

void check_index(const at::Tensor& t, at::ScalarType st, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == st && t.is_contiguous() && t.dim() == 1,
              "qkv_cpu: ", name, " must be a contiguous 1-D CPU tensor of ", st);
}

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

struct Inputs {
  Problem P{};
  at::Tensor q, k, v, slopes;
};

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

int64_t target_items() { return std::max<int64_t>(16, 4 * (int64_t)at::get_num_threads()); }

// Below this many multiply-adds a call runs on the calling thread: a parallel region costs
// more than it saves there, and under load its end can wait a whole scheduler slice for a
// descheduled thread.
constexpr int64_t INLINE_BELOW = int64_t(1) << 23;
// From this many multiply-adds (about a millisecond on 2 CPUs) the threads are held one per CPU
// (placement.h): a few system calls per thread, against a 2x loss when Linux stacks them.
constexpr int64_t PIN_FROM = int64_t(1) << 26;

// Run `work(&queue)` on every thread of torch's pool (one parallel region), the queue holding
// items 0 … n_items − 1; each call takes items until none is left, so a thread that gets less
// CPU simply takes fewer.
template <class Work>
void run_parallel(int64_t macs, int64_t n_items, const Work& work) {
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  ItemQueue queue;
  if (nt == 1 || macs < INLINE_BELOW) {
    queue_init(queue, n_items, 1);
    queue.stop = &g_interrupted;
    work(&queue);
    return;
  }
  queue_init(queue, n_items, nt);
  queue.stop = &g_interrupted;
  Placement place(macs >= PIN_FROM ? nt : 0);
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    Placement::Pin pin(place);
    for (int64_t t = begin; t < end; ++t) work(&queue);
  });
}

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

// ---------------------------------------------------------------------------- forward plan

// A plan's items: those of the state that owns them
template <class Plan, class Item>
void point_at_items(Plan& plan, const std::vector<Item>& items) {
  plan.items = items.data();
  plan.n_items = (int64_t)items.size();
}

struct FwdState {
  std::vector<FwdItem> items;
  std::vector<int32_t> nsplit, done;
  std::vector<int8_t> v_finite;
  std::vector<int32_t> kstate;
  std::vector<uint64_t> kbadv;
  std::vector<double> kmaxv;
  at::Tensor kparts;  // uninitialised: each tile's parts are written before its state says so
  std::vector<int64_t> part_base;
  std::vector<float> part_m;
  std::vector<double> part_l, part_acc;
  FwdPlan plan{};
};

// Rows of tiles become items; a row holding more than its share of the work (long key ranges
// with few query tiles: decoding) is split into pieces merged by their lse.
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
  point_at_items(F, S.items);
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

// ---------------------------------------------------------------------------- backward plan

struct BwdState {
  std::vector<BwdItem> items;
  std::vector<int32_t> chunk_j, t_tile, t_first, t_last, t_flush, local, chunk_live, done;
  std::vector<int64_t> chunk_t, t_slot, q_ptr, q_slots;
  // dQ partials: every slot is written whole (one pass of heads at a time) before it is read, so
  // it is not cleared first (a cleared vector cost a memset of up to STORE_CAP bytes a call)
  std::unique_ptr<double[]> store;
  BwdPlan plan{};
};

constexpr int64_t STORE_CAP = int64_t(128) << 20;  // bytes of dQ partials a call may hold

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
// they leave the core's cache between columns, and the backward ran up to 1.4× slower than the
// same heads without grouping. Passes of fewer heads keep them in cache, at the price of packing
// K_j, V_j once per pass and holding dK_j, dV_j of the chunk's columns between passes. Chosen from
// the shape alone (not the thread count), so that a call's bits never depend on the machine.
constexpr int64_t DQ_CACHE = int64_t(1) << 20;  // bytes of live dQ tiles a pass aims to stay in
constexpr int64_t DKV_CAP = int64_t(256) << 20;  // most bytes of kept dK_j, dV_j (all columns)

int64_t backward_heads(const Problem& P) {
  const Layout& L = P.lay;
  const int64_t head = L.nqb * L.bq * P.Dp * 8;  // one head's dQ tiles, if every tile is live
  if (P.G == 1 || head * P.G <= DQ_CACHE) return P.G;
  if (L.nkb * BK * (P.Dp + P.Dvp) * 8 > DKV_CAP) return P.G;  // a chunk's are at most these
  return std::max<int64_t>(1, std::min<int64_t>(P.G, DQ_CACHE / head));
}

void plan_backward(const Problem& P, BwdState& S) {
  const Layout& L = P.lay;
  const int64_t BH = P.B * P.Hkv;
  int64_t nonempty = 0;
  for (int64_t j = 0; j < L.nkb; ++j) nonempty += L.col_ptr[j + 1] > L.col_ptr[j];
  // Chunks per (b, kv head): enough items to share, counted in query heads (an item holds the G
  // heads of its group), but at least a quarter as many items (one a thread beyond 4 threads, so
  // that the cut depends on the problem alone up to 4). Each further chunk adds a dQ partial of
  // every query tile it reaches (G heads of them): counted in kv heads, GQA 14:2 at N = 2048 cut
  // its columns in 8 chunks where 2 do, held 81 MB of partials against 20 MB, and ran 1.25×
  // slower (interleaved, 2-core AMD EPYC).
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
  BwdPlan& Bp = S.plan;
  Bp.heads = backward_heads(P);
  point_at_items(Bp, S.items);
  Bp.chunk_j = S.chunk_j.data();
  Bp.chunk_t = S.chunk_t.data();
  Bp.t_tile = S.t_tile.data();
  Bp.t_first = S.t_first.data();
  Bp.t_last = S.t_last.data();
  Bp.t_slot = S.t_slot.data();
  Bp.t_flush = S.t_flush.data();
  Bp.local = S.local.data();
  Bp.chunk_live = S.chunk_live.data();
  Bp.q_ptr = S.q_ptr.data();
  Bp.q_slots = S.q_slots.data();
  Bp.done = S.done.data();
  Bp.store = S.store.get();
}

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
  // instead (GQA 14:2, D = 64, N = 8192 causal forward + backward: 0.92× → 1.08× SDPA).
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
