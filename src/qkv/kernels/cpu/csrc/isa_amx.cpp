// kernel.h compiled for AVX-512 with the AMX tile unit (Sapphire Rapids and later Xeons): the
// avx512 path, except that the products of bfloat16 inputs and the scores of float32 ones run
// on the tiles (tiles_amx.h).
#define QKV_ISA amx
#define QKV_ISA_TARGET \
  "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c,bmi2"
#define QKV_ISA_SIMD "simd_avx512.h"
#define QKV_ISA_TILES "tiles_amx.h"
#include "isa_unit.h"
