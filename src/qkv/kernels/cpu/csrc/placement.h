// Where the threads of one parallel call run: one thread per CPU, for the length of the call.
//
// Linux places threads by counting them, not by who they belong to. With one other CPU-bound
// process on a 2-CPU machine it often stacks a call's two threads on one CPU and leaves the
// other process a CPU of its own; neither placement is "unbalanced" by task count, so nothing
// moves, and the call runs on half a machine where a fair share is 2/3 of it (docs/cpu.md,
// Measurements behind the code). Items are pulled from one counter, so any split of the CPU time
// between the threads is used in full; what is lost is only the stacking. So when a call's
// threads are as many as the CPUs it may use, each thread claims the CPU it is on, a thread that
// finds its CPU taken moves to one no thread of the call holds, and each is held there
// (sched_setaffinity) until its part of the call ends, then given back its own affinity mask.
// Fewer threads than CPUs: nothing is pinned (the scheduler has a free CPU to move to).
// `QKV_CPU_PIN=0` turns it off (read at every call).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sched.h>
#endif

namespace qkv_cpu {

#if defined(__linux__)

class Placement {
 public:
  // Decided once per call, on the calling thread, before the parallel region.
  explicit Placement(int64_t nthreads) {
    if (nthreads < 2) return;  // a call too small to pin: no system call
    const char* env = std::getenv("QKV_CPU_PIN");
    if (env != nullptr && std::strcmp(env, "0") == 0) return;
    CPU_ZERO(&allowed_);
    if (sched_getaffinity(0, sizeof(allowed_), &allowed_) != 0) return;
    const int n = CPU_COUNT(&allowed_);
    on_ = n >= 2 && nthreads >= n;
    for (auto& word : claimed_) word = 0;
  }

  bool on() const { return on_; }

  // Held by each thread for its part of the call.
  class Pin {
   public:
    explicit Pin(Placement& p) {
      if (!p.on_) return;
      const int cpu = p.claim(sched_getcpu());
      if (cpu < 0) return;
      CPU_ZERO(&old_);
      if (sched_getaffinity(0, sizeof(old_), &old_) != 0) return;
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pinned_ = sched_setaffinity(0, sizeof(one), &one) == 0;
    }
    ~Pin() {
      if (pinned_) sched_setaffinity(0, sizeof(old_), &old_);
    }
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;

   private:
    cpu_set_t old_;
    bool pinned_ = false;
  };

 private:
  static constexpr int kWords = CPU_SETSIZE / 64;

  bool take(int cpu) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed_)) return false;
    const uint64_t bit = uint64_t(1) << (cpu % 64);
    return (__atomic_fetch_or(&claimed_[cpu / 64], bit, __ATOMIC_ACQ_REL) & bit) == 0;
  }

  // The CPU this thread is on if no other thread of the call holds it, else the next free one
  // of the allowed set; -1 when none is left.
  int claim(int current) {
    if (take(current)) return current;
    const int start = current < 0 ? 0 : current + 1;
    for (int i = 0; i < CPU_SETSIZE; ++i) {
      const int cpu = (start + i) % CPU_SETSIZE;
      if (take(cpu)) return cpu;
    }
    return -1;
  }

  cpu_set_t allowed_;
  uint64_t claimed_[kWords];
  bool on_ = false;
};

#else  // no thread placement off Linux

class Placement {
 public:
  explicit Placement(int64_t) {}
  bool on() const { return false; }
  class Pin {
   public:
    explicit Pin(Placement&) {}
  };
};

#endif

}  // namespace qkv_cpu
