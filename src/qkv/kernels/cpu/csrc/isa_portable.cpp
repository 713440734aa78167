// kernel.h compiled for the baseline of the build (SSE2 on x86-64): runs on any CPU.
#include <cstdint>
#include <cstdlib>

#include "problem.h"

namespace qkv_cpu {
namespace portable {
#include "simd_portable.h"
#include "kernel.h"
const Kernels kernels = {QKV_ISA_NAME, forward_worker, backward_worker, delta_worker,
                         fwd_share_elems};
}  // namespace portable
}  // namespace qkv_cpu
