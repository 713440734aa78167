// kernel.h compiled for AVX2 + FMA + F16C (Haswell and later, every AMD Zen).
#define QKV_ISA avx2
#define QKV_ISA_TARGET "avx2,fma,f16c,bmi2"
#define QKV_ISA_SIMD "simd_avx2.h"
#define QKV_ISA_TILES "tiles_none.h"
#include "isa_unit.h"
