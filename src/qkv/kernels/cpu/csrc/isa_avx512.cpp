// kernel.h compiled for AVX-512 (F, BW, DQ, VL).
#define QKV_ISA avx512
#define QKV_ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi2"
#define QKV_ISA_SIMD "simd_avx512.h"
#define QKV_ISA_TILES "tiles_none.h"
#include "isa_unit.h"
