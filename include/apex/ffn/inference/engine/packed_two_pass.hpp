#pragma once
/// \file inference/engine/packed_two_pass.hpp
/// The forward of an expert kind whose activation needs more than the tile
/// epilogue sees (κ's per-row logit, gpt-oss's per-unit biases): the gate/up
/// panels run with the plain epilogue into [G | U] (G in lanes 0–15, U in
/// lanes 16–31 of each panel), the kind forms A from them a row at a time,
/// and the down panels run on A. This file holds what every such kind shares:
/// the per-thread scratch and the blocking of rows as packed::forward blocks
/// them (one block for m ≤ kSmallRows, decode; kRowBlock rows otherwise), so
/// each row's bits depend on that row only.

#include <algorithm>
#include <string>

#include "../../core/checked_size.hpp"
#include "../../core/errors.hpp"
#include "../../core/types.hpp"
#include "../../kernels/fused_expert.hpp"

namespace apex::detail::inference {

struct TwoPassScratch {
  packed::detail::AlignedArray<float> gu;     // rows × 32·panels: [G | U] per panel
  packed::detail::AlignedArray<float> a;      // rows × lda: A
  packed::detail::AlignedArray<float> units;  // count × f: a kind's per-unit rows
};
inline TwoPassScratch& two_pass_scratch() {
  thread_local TwoPassScratch s;
  return s;
}

/// `count` rows of f floats from the thread's scratch, row i at i·f (kept
/// between calls: a decode step allocates nothing).
inline float* unit_rows(Index count, Index f) {
  return packed::detail::grow(two_pass_scratch().units,
                              checked_product("packed expert kinds", "scratch units x d_ffn", {count, f}));
}

/// Runs `block(x_rows, r0, rows, gu, ldgu, a, lda, y_rows)` over blocks of the
/// m rows of x (row stride ldx) into y (row stride ldy); `where` names the
/// caller in errors. ConfigError for m < 0, `paired` bf16 products (the kind
/// needs G and U apart) and as packed::forward.
template <class Block>
void two_pass_forward(const char* where, const char* kind, const packed::PackedExpert& e, const float* x, Index ldx,
                      Index m, float* y, Index ldy, const packed::ForwardOptions& opt, Block&& block) {
  require_config(opt.bf16_products != packed::Bf16Products::paired, where,
                 [&] { return std::string("bf16_products = paired is not supported for ") + kind + " experts"; });
  require_config(m >= 0, where, [&] { return "row count m = " + std::to_string(m) + " is negative"; });
  packed::detail::check_forward_options(where, opt);
  if (m == 0) return;
  const Index block_rows = m <= packed::kSmallRows ? m : packed::kRowBlock;
  const Index ldgu = e.gate_up().panels() * 2 * packed::PackedExpert::kHiddenPerPanel;
  const Index lda = (e.d_ffn() + 15) / 16 * 16;  // 64-byte aligned rows
  TwoPassScratch& s = two_pass_scratch();
  float* gu = packed::detail::grow(s.gu, checked_product(where, "scratch rows x 2*panels*16", {block_rows, ldgu}));
  float* a = packed::detail::grow(s.a, checked_product(where, "scratch rows x d_ffn", {block_rows, lda}));
  for (Index r0 = 0; r0 < m; r0 += block_rows) {
    const Index rows = std::min(block_rows, m - r0);
    block(x + r0 * ldx, r0, rows, gu, ldgu, a, lda, y + r0 * ldy);
  }
}

}  // namespace apex::detail::inference
