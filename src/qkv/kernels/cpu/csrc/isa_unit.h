// The body of each path's isa_<name>.cpp (isa_paths.h lists the paths): kernel.h compiled for
// one instruction set, inside a namespace of its own, so that one build holds every path and
// isa_select.cpp picks one per call. A unit defines
//
//     QKV_ISA         its namespace, also the path's name (a name of isa_paths.h)
//     QKV_ISA_TARGET  the instructions its functions may use (a target pragma; absent: the
//                     build's baseline), x86-64 only
//     QKV_ISA_SIMD    its SIMD layer (simd_*.h) and QKV_ISA_TILES its tile layer (tiles_amx.h,
//                     tiles_dpbf16.h, or tiles_none.h where bfloat16 has no faster unit):
//                     together what isa_contract.h asks of a path
//
// and includes this file, which compiles kernel.h over them and exports the path's Kernels.
// The target pragma applies to the functions defined below it only; the system headers come
// first, compiled for the baseline.
#include <cstdint>
#include <cstdlib>
#if defined(QKV_ISA_TARGET) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "problem.h"

#if !defined(QKV_ISA_TARGET) || defined(__x86_64__)

// (the target list reaches the pragma through a macro argument, which expands it)
#define QKV_PRAGMA(...) _Pragma(#__VA_ARGS__)
#if defined(__clang__)
#define QKV_TARGET_PUSH(t) \
  QKV_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define QKV_TARGET_POP QKV_PRAGMA(clang attribute pop)
#else
#define QKV_TARGET_PUSH(t) QKV_PRAGMA(GCC push_options) QKV_PRAGMA(GCC target(t))
#define QKV_TARGET_POP QKV_PRAGMA(GCC pop_options)
#endif
#define QKV_STRING(x) QKV_STRING_(x)
#define QKV_STRING_(x) #x

#if defined(QKV_ISA_TARGET)
QKV_TARGET_PUSH(QKV_ISA_TARGET)
#endif

namespace qkv_cpu {
namespace QKV_ISA {
#include QKV_ISA_SIMD
#include QKV_ISA_TILES
#include "kernel.h"
const Kernels kernels = {QKV_STRING(QKV_ISA), forward_worker, backward_worker, delta_worker,
                         fwd_share_elems};
}  // namespace QKV_ISA
}  // namespace qkv_cpu

#if defined(QKV_ISA_TARGET)
QKV_TARGET_POP
#endif

#endif
