// The instruction-set paths of the compiled kernel, widest first: the one list of them. The C++
// includes this file wherever it needs the paths (problem.h declares each path's kernels,
// isa_select.cpp checks, picks and looks them up), with QKV_ISA_PATH (and, where the baseline
// needs other code, QKV_ISA_BASELINE) defined to what a line should become; isa.py reads it as
// text, so Python knows the paths without a built kernel (build.py compiles isa_<name>.cpp for
// each, crossover.py reads the stand-ins, .ci/run loops over them). No include guard: it is
// meant to be included many times, and it undefines both macros at its end.
//
//     QKV_ISA_PATH(name, default_on, stands_in)   a path compiled for x86-64 only
//     QKV_ISA_BASELINE(name)                      the build's baseline (any CPU); the last line
//
// name        the path: its namespace, and its translation unit isa_<name>.cpp, which names
//             the instructions its functions may use and its SIMD and tile layers
// default_on  the CPUs on which it is the default where they have it (best_isa, widest first):
//             any_cpu, or amd_cpu (AMD's only)
// stands_in   the path whose default crossover table it reads, having none of its own
//             (crossover.py), or empty
//
// A new path adds its line here, its isa_<name>.cpp and, in isa_select.cpp, cpu_has_<name>
// (what it needs of the CPU).

#ifndef QKV_ISA_BASELINE
#define QKV_ISA_BASELINE(name) QKV_ISA_PATH(name, any_cpu, )
#endif

QKV_ISA_PATH(amx, any_cpu, avx512)
// avx512bf16 stands before avx512 on AMD CPUs only: Zen 4 and 5 run VDPBF16PS at twice their
// float32 FMA rate, Intel's AVX512-BF16 cores at half of it (docs/cpu.md, Instruction sets),
// where widening bfloat16 to float32 is faster
QKV_ISA_PATH(avx512bf16, amd_cpu, avx512)
QKV_ISA_PATH(avx512, any_cpu, )
QKV_ISA_PATH(avx2, any_cpu, )
QKV_ISA_BASELINE(portable)

#undef QKV_ISA_PATH
#undef QKV_ISA_BASELINE
