// kernel.h compiled for the baseline of the build (SSE2 on x86-64): runs on any CPU.
#define QKV_ISA portable
#define QKV_ISA_SIMD "simd_portable.h"
#define QKV_ISA_TILES "tiles_none.h"
#include "isa_unit.h"
