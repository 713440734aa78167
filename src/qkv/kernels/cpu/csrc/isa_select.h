// Which instruction-set path runs (isa_paths.h lists them): the paths this CPU has, the default
// one, and a path's kernels (compiled once per path by isa_<name>.cpp).
#pragma once

#include <string>

#include "problem.h"

namespace qkv_cpu {

// Whether this CPU (and its OS) has the instructions of the path `isa` (false for no path).
bool isa_supported(const std::string& isa);

// The default path: the first of isa_paths.h, widest first, that is a default on this CPU
// (its default_on) and that this CPU has.
std::string best_isa();

// The kernels of the path `isa`; an error that says why for a path that is none, or that this
// CPU lacks.
const Kernels& kernels_for(const std::string& isa);

}  // namespace qkv_cpu
