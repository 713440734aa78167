// The choice of instruction-set path, from the table in isa_paths.h: what each path needs of
// the CPU (cpu_has_<name>), whether it is the default on this CPU, and the lookup of its
// kernels. Nothing here depends on the ISA this file is compiled for (the build's baseline).
#include <c10/util/Exception.h>

#include <cstddef>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "isa_select.h"

namespace qkv_cpu {
namespace {

#if defined(__x86_64__)
// the runtime check of a CPU feature (the argument a literal: GCC's builtin asks for one)
#define QKV_CPU_HAS(feature) __builtin_cpu_supports(feature)

// AMX-TILE, AMX-BF16 and AVX512-BF16 (CPUID leaf 7), and the OS's leave to use the tile state
// (Linux hands it to a process that asks: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)); asked
// once per process
bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tiles = (d >> 24) & 1u, tile_bf16 = (d >> 22) & 1u;
    if (!(tiles && tile_bf16 && __builtin_cpu_supports("avx512bf16"))) return false;
#if defined(__linux__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

bool amd_cpu() { return __builtin_cpu_is("amd"); }
#else  // off x86-64 only the baseline runs
#define QKV_CPU_HAS(feature) false
bool amx_usable() { return false; }
bool amd_cpu() { return false; }
#endif
bool any_cpu() { return true; }

// What each path of isa_paths.h needs of the CPU (after __builtin_cpu_init)
bool cpu_has_portable() { return true; }
bool cpu_has_avx2() { return QKV_CPU_HAS("avx2") && QKV_CPU_HAS("fma"); }
bool cpu_has_avx512() {
  return cpu_has_avx2() && QKV_CPU_HAS("avx512f") && QKV_CPU_HAS("avx512bw") &&
         QKV_CPU_HAS("avx512dq") && QKV_CPU_HAS("avx512vl");
}
bool cpu_has_avx512bf16() { return cpu_has_avx512() && QKV_CPU_HAS("avx512bf16"); }
bool cpu_has_amx() { return cpu_has_avx512() && amx_usable(); }

#define QKV_ISA_PATH(name, ...) #name,
constexpr const char* ISA_NAMES[] = {
#include "isa_paths.h"
};
constexpr size_t N_ISAS = sizeof(ISA_NAMES) / sizeof(ISA_NAMES[0]);

bool isa_known(const std::string& isa) {
  for (const char* name : ISA_NAMES)
    if (isa == name) return true;
  return false;
}

// "a, b, … or z": the paths, for an error message
std::string isa_names() {
  std::string s;
  for (size_t i = 0; i < N_ISAS; ++i) {
    if (i > 0) s += i + 1 < N_ISAS ? ", " : " or ";
    s += ISA_NAMES[i];
  }
  return s;
}

}  // namespace

bool isa_supported(const std::string& isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
#endif
#define QKV_ISA_PATH(name, ...) \
  if (isa == #name) return cpu_has_##name();
#include "isa_paths.h"
  return false;
}

std::string best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
#endif
#define QKV_ISA_PATH(name, default_on, stands_in) \
  if (default_on() && isa_supported(#name)) return #name;
#define QKV_ISA_BASELINE(name) return #name;
#include "isa_paths.h"
}

const Kernels& kernels_for(const std::string& isa) {
  TORCH_CHECK(isa_known(isa), "qkv_cpu: unknown ISA '", isa, "' (expected ", isa_names(), ")");
  TORCH_CHECK(isa_supported(isa), "qkv_cpu: this CPU lacks the instructions of the '", isa,
              "' kernel");
#if defined(__x86_64__)
#define QKV_ISA_PATH(name, ...) \
  if (isa == #name) return name::kernels;
#else
#define QKV_ISA_PATH(name, ...)
#endif
#define QKV_ISA_BASELINE(name) return name::kernels;
#include "isa_paths.h"
}

}  // namespace qkv_cpu
