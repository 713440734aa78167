// Ctrl-C during a long call: while an op runs, SIGINT only sets a flag; the item queues see it
// and hand out no more items (problem.h, queue_take), so the call ends within one item per
// thread. The op then restores the process's own SIGINT handler, raises SIGINT to it (Python's
// handler marks the interrupt as pending, or whatever handler the process installed runs) and
// throws INTERRUPTED, which the Python side turns into KeyboardInterrupt. Part of the torch side
// (ops.cpp); nothing of the call's state outlives it, so the kernel is as usable as before.
#pragma once

#include <c10/util/Exception.h>

#include <csignal>
#include <cstdint>
#include <mutex>

namespace qkv_cpu {

// The message of the error an interrupted op throws (qkv/kernels/cpu/op.py looks for it)
constexpr const char* INTERRUPTED = "qkv_cpu: interrupted by SIGINT";

// Set by the handler below; read by the item queues (ItemQueue::stop points here)
inline int32_t g_interrupted = 0;

inline void on_sigint(int) { __atomic_store_n(&g_interrupted, 1, __ATOMIC_RELAXED); }

// For the duration of an op: SIGINT sets g_interrupted instead of reaching the process's handler.
// Scopes on several threads share one installation (the first installs, the last restores). A
// process that ignores SIGINT keeps ignoring it.
class InterruptScope {
 public:
  InterruptScope() {
    std::lock_guard<std::mutex> lock(mutex());
    if (depth()++ > 0) return;
    struct sigaction ours = {};
    ours.sa_handler = on_sigint;
    sigemptyset(&ours.sa_mask);
    installed() = sigaction(SIGINT, nullptr, &previous()) == 0 &&
                  previous().sa_handler != SIG_IGN && sigaction(SIGINT, &ours, nullptr) == 0;
  }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  ~InterruptScope() { leave(); }

  // At the end of the op's work: throws INTERRUPTED if SIGINT arrived during it
  void finish() {
    if (__atomic_load_n(&g_interrupted, __ATOMIC_RELAXED) == 0) return;
    leave();
    TORCH_CHECK(false, INTERRUPTED);
  }

 private:
  bool left_ = false;

  void leave() {
    if (left_) return;
    left_ = true;
    std::lock_guard<std::mutex> lock(mutex());
    if (--depth() > 0) return;
    if (!installed()) return;
    sigaction(SIGINT, &previous(), nullptr);
    if (__atomic_exchange_n(&g_interrupted, 0, __ATOMIC_RELAXED)) raise(SIGINT);  // to its owner
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static bool& installed() {
    static bool b = false;
    return b;
  }
  static struct sigaction& previous() {
    static struct sigaction s = {};
    return s;
  }
};

}  // namespace qkv_cpu
