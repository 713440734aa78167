// The ops' arguments read into what the kernel takes (problem.h), each checked on the way, with
// the error a caller sees ("qkv_cpu: …") where one is wrong.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "problem.h"

namespace qkv_cpu {

// `t` itself where its last dim is dense, else a contiguous copy (the kernel reads rows)
at::Tensor rows_dense(const at::Tensor& t);

// The data and strides of a (B, H, N, D) tensor whose last dim is dense
View view_of(const at::Tensor& t);

// The block layout of a call from its tile lists (forward CSR, and the backward's transposed
// one where col_ptr is defined), their tile codes, the bits of the PARTIAL tiles and the tile
// origins (q_starts, k_starts: both or neither), each checked against the problem's sizes.
Layout layout_of(const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& code,
                 const at::Tensor& col_ptr, const at::Tensor& row_idx, const at::Tensor& code_t,
                 const at::Tensor& bits, const std::optional<at::Tensor>& q_starts,
                 const std::optional<at::Tensor>& k_starts, int64_t bq, int64_t Nq, int64_t Nk,
                 int64_t B, int64_t H, int64_t Hkv);

// A call's Problem (all but its layout and its outputs) and the tensors its views point into.
struct Inputs {
  Problem P{};
  at::Tensor q, k, v, slopes;
};

Inputs inputs_of(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                 double scale, const std::optional<at::Tensor>& slopes, double softcap,
                 bool alibi_after_softcap, double dropout_p, int64_t dropout_seed,
                 bool precise_scores);

}  // namespace qkv_cpu
