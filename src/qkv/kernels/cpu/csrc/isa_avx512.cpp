// kernel.h compiled for AVX-512 (F, BW, DQ, VL). The target pragma applies to the functions
// defined below it only; headers come first, compiled for the baseline.
#include <cstdint>
#include <cstdlib>
#include <immintrin.h>

#include "problem.h"

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi2")
#endif

namespace qkv_cpu {
namespace avx512 {
#include "simd_avx512.h"
#include "kernel.h"
const Kernels kernels = {QKV_ISA_NAME, forward_worker, backward_worker, delta_worker,
                         fwd_share_elems};
}  // namespace avx512
}  // namespace qkv_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
