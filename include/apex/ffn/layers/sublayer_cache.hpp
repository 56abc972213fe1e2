#pragma once
/// \file layers/sublayer_cache.hpp
/// What the FFN sublayer (layers/ffn_sublayer.hpp) leaves behind and how it
/// looks at the FFN it wraps: its modes, the cache of one forward and the
/// check that a cache came from a sublayer like the one reading it, and the
/// traits that tell a collective FFN (mpi/) or one with a load balancer.

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "../core/types.hpp"
#include "rms_norm.hpp"
#include "skip_gate.hpp"

namespace apex {

/// Whether a gated sublayer computes the FFN for skipped tokens (training,
/// needed by the straight-through estimator) or not (inference).
enum class SublayerMode { training, inference };

namespace detail {

/// ConfigError for a mode cast from an integer (it would be read as inference).
inline void check_mode(const char* where, SublayerMode m) {
  require_config(m == SublayerMode::training || m == SublayerMode::inference, where,
                 [&] { return "mode must be training or inference, got " + std::to_string(int(m)); });
}
namespace sublayer {

template <class F, class = void>
struct has_d_model : std::false_type {};
template <class F>
struct has_d_model<F, std::void_t<decltype(std::declval<const F&>().d_model())>> : std::true_type {};

template <class F, class = void>
struct has_observe : std::false_type {};
template <class F>
struct has_observe<F, std::void_t<decltype(std::declval<F&>().observe(std::declval<const typename F::Cache&>()))>>
    : std::true_type {};

/// FFN types whose forward, backward and observe are collective across
/// processes (`static constexpr bool kCollective = true`, e.g. the
/// expert-parallel MoE of mpi/): every process must make the same calls, so
/// the sublayer calls them also with 0 rows where it would otherwise skip,
/// and runs its own checks through their `agree_step(where, name, value, fn)`
/// (run `fn`, then agree across processes on its outcome and on `value`).
template <class F, class = void>
struct is_collective : std::false_type {};
template <class F>
struct is_collective<F, std::enable_if_t<F::kCollective>> : std::true_type {};

/// out: rows.size() × d, out_i = m_{rows_i}.
template <class T>
Matrix<T> gather(const ConstMatrixRef<T>& m, const std::vector<Index>& rows) {
  Matrix<T> out(Index(rows.size()), m.cols());
  for (Index i = 0; i < out.rows(); ++i) out.row(i) = m.row(rows[std::size_t(i)]);
  return out;
}

/// Throws unless `cache` was filled by a forward of a sublayer like the one
/// reading it (`gated`: whether that one is): gated or not alike, its kept
/// tokens ascending in [0, N), all N of them without a gate. A cache of a
/// gated sublayer that skipped tokens would otherwise give an ungated
/// backward gradients of a computation it did not do.
template <class Cache>
void check_provenance(const char* where, const Cache& cache, bool gated) {
  if (cache.gated != gated)
    throw ValueError(std::string(where) + ": argument 'cache' was filled by " +
                     (cache.gated ? "a gated" : "an ungated") + " sublayer, expected one of " +
                     (gated ? "a gated" : "an ungated") + " sublayer");
  const Index n = cache.tokens;
  Index previous = -1;
  for (Index t : cache.kept) {  // kept indices address rows of dy and dx
    if (t <= previous || t >= n)
      throw ValueError(std::string(where) + ": argument 'cache.kept' holds token " + std::to_string(t) +
                       " after " + std::to_string(previous) + ", expected ascending values in [0, " +
                       std::to_string(n) + ")");
    previous = t;
  }
  if (!gated && Index(cache.kept.size()) != n)
    throw ValueError(std::string(where) + ": argument 'cache.kept' holds " + std::to_string(cache.kept.size()) +
                     " of " + std::to_string(n) + " tokens, expected all of them for an ungated sublayer");
  if (cache.ffn_ran != !cache.kept.empty())
    throw ValueError(std::string(where) + ": argument 'cache.ffn_ran' disagrees with 'cache.kept'");
}

}  // namespace sublayer
}  // namespace detail

/// Everything one forward of an FFNSublayer leaves behind: the activations
/// backward needs (training), the keep decisions and the skip statistics (both modes).
template <class T, class FFNCache>
struct SublayerCache {
  SublayerMode mode = SublayerMode::training;
  bool gated = false;                 ///< filled by a gated sublayer
  Index tokens = 0;                   ///< N
  std::vector<Index> kept;            ///< ascending indices of the tokens with m = 1
  typename RMSNorm<T>::Cache norm;    ///< training: all N rows
  typename SkipGate<T>::Cache gate;   ///< gated only: g for every token (x, z, s in training)
  FFNCache ffn;                       ///< the FFN on the kept rows only (valid iff ffn_ran)
  bool ffn_ran = false;               ///< false when no token was kept
  Matrix<T> f;                        ///< training, gated: N × d, F = FFN(RMSNorm(x)) of every token
  T penalty = 0;                      ///< λ_skip · mean(g) to add to the loss (0 without a gate)

  Index skipped() const { return tokens - Index(kept.size()); }
  /// Skipped share of the batch, in [0, 1] (0 for an empty batch).
  double skip_rate() const { return tokens > 0 ? double(skipped()) / double(tokens) : 0.0; }
  /// m_t for every token.
  std::vector<bool> keep_mask() const {
    std::vector<bool> m(std::size_t(tokens), false);
    for (Index t : kept) m[std::size_t(t)] = true;
    return m;
  }
};

}  // namespace apex
