// kernel.h compiled for AVX-512 with AVX512-BF16 and no tile unit (AMD Zen 4 and Zen 5, Intel
// Cooper Lake): the avx512 path, except that the products of bfloat16 inputs run on the
// dot-product instruction (tiles_dpbf16.h).
#define QKV_ISA avx512bf16
#define QKV_ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,bmi2"
#define QKV_ISA_SIMD "simd_avx512.h"
#define QKV_ISA_TILES "tiles_dpbf16.h"
#include "isa_unit.h"
