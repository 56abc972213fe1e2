#pragma once
/// \file optim/schedule.hpp
/// The learning-rate schedule of most LLM pre-training runs: a linear warmup
/// then a cosine decay to a floor. For step s (from 0), W = warmup, S = total:
///
///     lr(s) = peak · (s + 1) / W                                   s < W
///     lr(s) = peak · (f + (1 − f) · ½ (1 + cos(π · p)))            s ≥ W
///             p = min(1, (s − W) / max(1, S − W)),  f = floor_fraction
///
/// so the first step already trains (peak / W, not 0), the peak is reached at
/// step W − 1 and again, as the cosine's start, at W; the floor f·peak is
/// reached at step S and kept after it. Up to step S this is PyTorch's
/// `SequentialLR([LinearLR(start_factor = 1/W, total_iters = W − 1),
/// CosineAnnealingLR(T_max = S − W, eta_min = f·peak)], milestones = [W])`
/// (tests/test_optim.cpp compares the two; past S, PyTorch's cosine rises
/// again, this one keeps the floor).

#include <algorithm>
#include <cmath>
#include <string>

#include "../core/errors.hpp"
#include "../core/scalar_range.hpp"

namespace apex {

/// The learning rate at `step` (see the file comment). ConfigError naming
/// the argument unless step ≥ 0, total ≥ 1, warmup ≥ 0, peak finite and
/// ≥ 0, floor_fraction in [0, 1]. A warmup longer than total (a short run)
/// is allowed: the run then ends inside the warmup.
inline double warmup_cosine(long step, long total, long warmup, double peak, double floor_fraction = 0.1) {
  constexpr const char* where = "warmup_cosine";
  detail::require_config(step >= 0, where, "step must be >= 0, got " + std::to_string(step));
  detail::require_config(total >= 1, where, "total must be >= 1, got " + std::to_string(total));
  detail::require_config(warmup >= 0, where, "warmup must be >= 0, got " + std::to_string(warmup));
  detail::require_config(std::isfinite(peak) && peak >= 0, where,
                         "peak must be finite and >= 0, got " + detail::number(peak));
  detail::require_config(floor_fraction >= 0 && floor_fraction <= 1, where,
                         "floor_fraction must lie in [0, 1], got " + detail::number(floor_fraction));
  if (step < warmup) return peak * double(step + 1) / double(warmup);
  const double span = double(std::max(1L, total - warmup));
  const double p = std::min(1.0, double(step - warmup) / span);
  return peak * (floor_fraction + (1.0 - floor_fraction) * 0.5 * (1.0 + std::cos(3.141592653589793 * p)));
}

}  // namespace apex
