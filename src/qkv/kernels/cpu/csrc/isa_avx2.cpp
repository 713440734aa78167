// kernel.h compiled for AVX2 + FMA + F16C (Haswell and later, every AMD Zen).
#include <cstdint>
#include <cstdlib>
#include <immintrin.h>

#include "problem.h"

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif

namespace qkv_cpu {
namespace avx2 {
#include "simd_avx2.h"
#include "kernel.h"
const Kernels kernels = {QKV_ISA_NAME, forward_worker, backward_worker, delta_worker,
                         fwd_share_elems};
}  // namespace avx2
}  // namespace qkv_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
