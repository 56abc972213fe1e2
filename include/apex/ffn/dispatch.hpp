#pragma once
/// \file dispatch.hpp
/// The grouped-dispatch plan: a counting sort of (token, slot) pairs by expert.
///
/// Row r of the sorted buffers holds pair (token[r], slot[r]); expert e owns
/// the contiguous rows [offset[e], offset[e+1]). The sort is stable, so within
/// an expert rows are in token order, and the plan depends only on the
/// routing — never on thread count — which is what makes every result built
/// from it bitwise reproducible. `row_of` is the inverse map: the sorted row
/// of pair (t, k) is row_of[t·K + k].

#include <string>
#include <type_traits>
#include <vector>

#include "errors.hpp"
#include "router.hpp"
#include "types.hpp"

namespace apex {

struct DispatchPlan {
  Index n_tokens = 0, n_active = 0, n_experts = 0;
  std::vector<Index> offset;  ///< E + 1: prefix sums of per-expert counts
  std::vector<Index> token;   ///< N·K: sorted row → token
  std::vector<Index> slot;    ///< N·K: sorted row → slot k
  std::vector<Index> row_of;  ///< N·K: (t, k) → sorted row

  Index rows() const { return n_tokens * n_active; }
  Index count(Index e) const { return offset[e + 1] - offset[e]; }
  /// c_e for every expert.
  std::vector<Index> counts() const {
    std::vector<Index> c(n_experts);
    for (Index e = 0; e < n_experts; ++e) c[e] = count(e);
    return c;
  }

  /// Builds the plan from N × K expert ids in [0, n_experts). Throws
  /// ValueError for a negative n_experts or an id outside that range, and
  /// then leaves the plan empty.
  void build(const IndexMatrix& experts, Index n_experts_) {
    if (n_experts_ < 0) fail("n_experts is " + std::to_string(n_experts_) + ", expected a value >= 0");
    n_tokens = experts.rows();
    n_active = experts.cols();
    n_experts = n_experts_;
    // 1. histogram  2. exclusive prefix sum  3. stable scatter + inverse map
    offset.assign(std::size_t(n_experts) + 1, 0);
    // One unsigned compare per id covers both < 0 and ≥ E: an id outside the
    // range would write past `offset` here and past the sorted rows below.
    const auto limit = static_cast<std::make_unsigned_t<Index>>(n_experts);
    for (Index t = 0; t < n_tokens; ++t)
      for (Index k = 0; k < n_active; ++k) {
        const Index e = experts(t, k);
        if (static_cast<std::make_unsigned_t<Index>>(e) >= limit)
          fail("argument 'experts' has expert id " + std::to_string(e) + " at (" + std::to_string(t) + ", " +
               std::to_string(k) + "), expected a value in [0, " + std::to_string(n_experts) + ")");
        ++offset[std::size_t(e) + 1];
      }
    for (Index e = 0; e < n_experts; ++e) offset[e + 1] += offset[e];
    token.resize(rows());
    slot.resize(rows());
    row_of.resize(rows());
    std::vector<Index> next(offset.begin(), offset.end() - 1);
    for (Index t = 0; t < n_tokens; ++t)
      for (Index k = 0; k < n_active; ++k) {
        const Index r = next[experts(t, k)]++;
        token[r] = t;
        slot[r] = k;
        row_of[t * n_active + k] = r;
      }
  }

 private:
  /// Empties the plan and throws ValueError naming build.
  [[noreturn]] void fail(const std::string& what) {
    *this = DispatchPlan{};
    throw ValueError("DispatchPlan::build: " + what);
  }
};

}  // namespace apex
