// How a call's work is cut and run: the work plans (rows and columns of tiles cut into items,
// the backward's chunks of key-tile columns and the slots of their dQ partials) and one parallel
// region per call on torch's own thread pool, whose threads take the items from the call's queue.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "interrupt.h"
#include "placement.h"
#include "problem.h"

namespace qkv_cpu {

// Below this many multiply-adds a call runs on the calling thread: a parallel region costs
// more than it saves there, and under load its end can wait a whole scheduler slice for a
// descheduled thread.
constexpr int64_t INLINE_BELOW = int64_t(1) << 23;
// From this many multiply-adds the threads are held one per CPU (placement.h): a few system
// calls per thread, small beside such a call, against running on half the machine when Linux
// stacks them (docs/cpu.md, Measurements behind the code).
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

// A call's forward plan and the memory it points into
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

// A call's backward plan and the memory it points into
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

// Rows of tiles become items; a row holding more than its share of the work (long key ranges
// with few query tiles: decoding) is split into pieces merged by their lse.
void plan_forward(const Problem& P, FwdState& S);

// Key-tile columns cut into chunks of about equal work, one item per (b, kv head, chunk), and
// the slots of the dQ partials of query tiles that several chunks reach (see BwdPlan).
void plan_backward(const Problem& P, BwdState& S);

}  // namespace qkv_cpu
