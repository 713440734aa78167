// What every part of a worker's code leans on (kernel.h includes it before the step headers, in
// the path's namespace): integer min and max, −inf, 64-byte-aligned buffers, the attribute of a
// named step, and the loop in which a worker takes a call's items from its queue.

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// 64-byte-aligned memory for `bytes` (rounded up to a whole 64: aligned_alloc wants a multiple of
// the alignment, and at least one line, so that a size of 0, D = 0, is a real block)
static inline void* alloc64(int64_t bytes) {
  return aligned_alloc(64, (size_t)((imax(bytes, 1) + 63) & ~int64_t(63)));
}
static const float NEG_INF = -__builtin_inff();

// A named step of an item (fwd_item, bwd_item): inlined where it is called, so that the item
// compiles as the one function it was written as
#define QKV_STEP static inline __attribute__((always_inline))

// A worker's part of a call (Kernels): each item it takes from the queue to run(k) until none is
// left; run returns false, or a worker's buffers could not be had (fail), when out of memory:
// *error is set and the worker stops.
static void fail(int32_t* error) { __atomic_store_n(error, 1, __ATOMIC_RELAXED); }
template <class Run>
static void take_items(ItemQueue* items, int32_t* error, const Run& run) {
  for (const int me = queue_join(*items);;) {
    const int64_t k = queue_take(*items, me);
    if (k < 0) break;
    if (!run(k)) {
      fail(error);
      break;
    }
  }
}
