// kernel.h compiled for AVX-512 with the AMX tile unit (Sapphire Rapids and later Xeons): the
// avx512 path, except that the products of bfloat16 inputs and the scores of float32 ones run
// on the tiles (tiles_amx.h).
// The target pragma applies to the functions defined below it only; headers come first,
// compiled for the baseline.
#include <cstdint>
#include <cstdlib>
#include <immintrin.h>

#include "problem.h"

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c,bmi2")
#endif

namespace qkv_cpu {
namespace amx {
#include "simd_avx512.h"
#undef QKV_ISA_NAME
#define QKV_ISA_NAME "amx"
#include "tiles_amx.h"
#include "kernel.h"
const Kernels kernels = {QKV_ISA_NAME, forward_worker, backward_worker, delta_worker,
                         fwd_share_elems};
}  // namespace amx
}  // namespace qkv_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
