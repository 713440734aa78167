// Memory for large results (the output, dq, dk, dv of 8 MiB or more): mapped in 2 MiB-aligned
// blocks marked for transparent huge pages, and kept for reuse when their tensor is freed.
//
// Fresh memory is expensive to touch the first time: the kernel maps and zeroes it page by page
// (in a VM the host may fault it in again as well, since freed memory goes back to it). glibc
// maps every block above 32 MiB afresh and unmaps it on free, so a call whose output is that big
// pays the first touch on every call, even when the previous call's output of the same size was
// just freed (a vision tower's layers, a training loop's steps). Here a freed block of the same
// rounded size is handed to the next result instead: at most MAX_BLOCKS blocks and CAP_BYTES in
// all are kept, oldest unmapped first; `release()` (qkv.kernels.cpu.release_cached_results)
// unmaps every kept block. The memory of a reused block is not zeroed, as at::empty's is not.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include <sys/mman.h>

namespace qkv_cpu {

class ResultMemory final : public c10::Allocator {
 public:
  static constexpr size_t HUGE_PAGE = size_t(2) << 20;
  static constexpr size_t FROM_BYTES = size_t(8) << 20;  // smaller results: torch's allocator
  static constexpr size_t CAP_BYTES = size_t(1) << 30;
  static constexpr size_t MAX_BLOCKS = 8;

  // One per process, never destroyed: a tensor may be freed during interpreter shutdown.
  static ResultMemory& instance() {
    static ResultMemory* memory = new ResultMemory();
    return *memory;
  }

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &c10::detail::deleteNothing, cpu);
    const size_t bytes = (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    Block* b = take(bytes);
    if (b == nullptr) b = map(bytes);
    return c10::DataPtr(b->ptr, b, &give_back, cpu);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }

  // Unmap every kept block; the bytes unmapped.
  int64_t release() {
    std::vector<Block*> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      drop.swap(kept_);
      kept_bytes_ = 0;
    }
    int64_t freed = 0;
    for (Block* b : drop) {
      freed += (int64_t)b->bytes;
      unmap(b);
    }
    return freed;
  }

  int64_t kept_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return (int64_t)kept_bytes_;
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };

  ResultMemory() = default;

  static Block* map(size_t bytes) {
    // Over-map by one huge page and trim, so the block starts on a 2 MiB boundary.
    const size_t span = bytes + HUGE_PAGE;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "qkv_cpu: out of memory mapping a result of ", bytes, " bytes");
    const uintptr_t lo = (uintptr_t)raw, start = (lo + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    if (start > lo) munmap(raw, start - lo);
    const uintptr_t end = start + bytes, hi = lo + span;
    if (hi > end) munmap((void*)end, hi - end);
#if defined(MADV_HUGEPAGE)
    madvise((void*)start, bytes, MADV_HUGEPAGE);  // advice: failure changes nothing
#endif
    return new Block{(void*)start, bytes};
  }

  static void unmap(Block* b) {
    munmap(b->ptr, b->bytes);
    delete b;
  }

  Block* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = kept_.size(); i-- > 0;) {  // the most recently freed first
      if (kept_[i]->bytes != bytes) continue;
      Block* b = kept_[i];
      kept_.erase(kept_.begin() + (std::ptrdiff_t)i);
      kept_bytes_ -= bytes;
      return b;
    }
    return nullptr;
  }

  static void give_back(void* ctx) { instance().put((Block*)ctx); }

  void put(Block* b) {
    std::vector<Block*> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (b->bytes > CAP_BYTES) {
        drop.push_back(b);
      } else {
        kept_.push_back(b);
        kept_bytes_ += b->bytes;
        while (kept_bytes_ > CAP_BYTES || kept_.size() > MAX_BLOCKS) {
          drop.push_back(kept_.front());
          kept_bytes_ -= kept_.front()->bytes;
          kept_.erase(kept_.begin());
        }
      }
    }
    for (Block* d : drop) unmap(d);
  }

  std::mutex mutex_;
  std::vector<Block*> kept_;  // oldest first
  size_t kept_bytes_ = 0;
};

}  // namespace qkv_cpu
