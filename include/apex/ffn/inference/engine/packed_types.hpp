#pragma once
/// \file inference/engine/packed_types.hpp
/// The packed layers' storage types (`PackedTypes`, the storage type →
/// packed dtype map) and what the layers built on them share: the expert
/// bytes (from the weight-type table), the row tiles their threads take, and
/// the fingerprint that tells a packed copy from a stale one.
///
/// Staleness. A packed layer is a snapshot: an optimiser step on the float
/// layer it came from does not reach it. At packing time the layer records
/// its source's shapes and a *fingerprint* — a hash of the bit patterns of up
/// to kFingerprintSamples evenly spaced entries of every parameter (and of
/// the balancing bias). `check_source(src)` throws ShapeError when the shapes
/// differ and ValueError when the fingerprint does. An optimiser step changes
/// (almost) every weight, so it is always detected; an edit of a few single
/// weights between samples is not — rebuild the packed layer after any write
/// to the source. Cost: a few thousand reads per check, independent of size.

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../../core/checked_size.hpp"
#include "../../core/errors.hpp"
#include "../../kernels/bf16_vectors.hpp"
#include "../../kernels/packed_weights.hpp"
#include "../../core/types.hpp"

namespace apex {

/// The packed dtype of a storage type (`float`, `apex::packed::bf16`: the
/// `Storage` of an entry of kernels/weight_types.hpp); a compile error for
/// any other type.
template <class Storage>
constexpr packed::Dtype packed_dtype() {
  return packed::dtype_of<Storage>();
}

/// The storage types of a packed MoE layer's experts: the routed experts'
/// and the shared experts' (a Q4_K_M file: routed {q4_k, q6_k}, shared
/// {q8_0}, say), each a gate/up and a down type. A single type or pair
/// converts to it (every expert alike).
struct PackedTypes {
  packed::ExpertDtypes routed;
  packed::ExpertDtypes shared;
  PackedTypes(packed::Dtype t) : routed(t), shared(t) {}              // NOLINT: one type for all
  PackedTypes(packed::ExpertDtypes t) : routed(t), shared(t) {}       // NOLINT
  PackedTypes(packed::ExpertDtypes r, packed::ExpertDtypes s) : routed(r), shared(s) {}
  friend bool operator==(const PackedTypes& a, const PackedTypes& b) {
    return a.routed == b.routed && a.shared == b.shared;
  }
};

/// "q8_0", or "routed q4_k/q6_k, shared q8_0" where they differ.
inline std::string packed_types_name(const PackedTypes& t) {
  return t.routed == t.shared ? packed::dtypes_name(t.routed)
                              : "routed " + packed::dtypes_name(t.routed) + ", shared " + packed::dtypes_name(t.shared);
}

namespace detail::inference {

/// Most rows of one thread task. The packed kernels give every row the same
/// bits whatever rows share its call, so the tile only balances threads:
/// small enough that a 2048-token batch of a fine-grained layer gives each
/// thread several tasks, large enough (4 blocks of packed::kRowBlock) that a
/// task amortises streaming its expert's weights.
inline constexpr Index kMaxTileRows = 256;

/// Bytes of one packed d × f SwiGLU expert of `dtypes` (the panel sizes of
/// kernels/weight_types.hpp), computed without allocating. ConfigError
/// naming `where` if the count overflows.
inline Index packed_expert_bytes(const char* where, packed::ExpertDtypes dtypes, Index d, Index f) {
  return packed::PackedExpert::bytes_for(where, dtypes, d, f);
}

/// ConfigError naming `where` and `arg` unless every expert of `list` has
/// the types of the first (a layer's routed or shared experts are one
/// kind); the types of the list, or `fallback` for an empty one.
inline packed::ExpertDtypes uniform_dtypes(const char* where, const char* arg,
                                           const std::vector<packed::PackedExpert>& list,
                                           packed::ExpertDtypes fallback) {
  if (list.empty()) return fallback;
  const packed::ExpertDtypes t = list.front().dtypes();
  for (std::size_t i = 1; i < list.size(); ++i)
    if (list[i].dtypes() != t)
      throw ConfigError(std::string(where) + ": argument '" + arg + "' mixes storage types: expert " +
                        std::to_string(i) + " is " + packed::dtypes_name(list[i].dtypes()) + ", expert 0 is " +
                        packed::dtypes_name(t));
  return t;
}

/// `weights + staging` bytes, or ConfigError `where: bytes = a + b does not
/// fit in a 64-bit index`: what check_fits compares with physical memory,
/// which an unchecked sum near 2^64 would wrap to a small total.
inline std::uint64_t checked_bytes(const char* where, std::uint64_t weights, std::uint64_t staging) {
  constexpr auto kMax = std::uint64_t(std::numeric_limits<Index>::max());
  if (weights > kMax || staging > kMax - weights)
    throw ConfigError(std::string(where) + ": bytes = " + std::to_string(weights) + " (weights) + " +
                      std::to_string(staging) + " (staging) does not fit in a 64-bit index");
  return weights + staging;
}

/// Whether the memory of two row-major blocks (rows × cols at outer stride)
/// may overlap: their address ranges intersect.
template <class A, class B>
bool overlaps(const A& a, const B& b) {
  if (a.size() == 0 || b.size() == 0) return false;
  const auto end = [](const auto& m) { return m.data() + (m.rows() - 1) * m.outerStride() + m.cols(); };
  const std::less<const float*> before;  // a total order, also across objects
  return before(a.data(), end(b)) && before(b.data(), end(a));
}

inline constexpr Index kFingerprintSamples = 64;

/// FNV-1a over (size, sampled bit patterns) of `n` floats at `p`.
inline void fingerprint_add(std::uint64_t& h, const float* p, Index n) {
  const auto mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFFu;
      h *= 0x100000001B3ull;
    }
  };
  mix(std::uint64_t(n));
  const Index step = n > kFingerprintSamples ? n / kFingerprintSamples : 1;
  for (Index i = 0; i < n; i += step) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    mix(bits);
  }
  if (n > 0) {  // the last entry always
    std::uint32_t bits;
    std::memcpy(&bits, p + n - 1, sizeof bits);
    mix(bits);
  }
}
inline constexpr std::uint64_t kFingerprintSeed = 0xCBF29CE484222325ull;

/// fn(), which packs or moves the weights of expert `index`; a ValueError
/// it throws (a weight the type cannot hold, named by matrix, row and
/// block) is thrown again naming the expert: "where: expert 3: PackedExpert:
/// w_gate row 5: packing weights as q8_0: block 2 …".
template <class Fn>
auto for_expert(const std::string& where, const char* expert, Index index, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const ValueError& e) {
    throw ValueError(where + ": " + expert + " " + std::to_string(index) + ": " + e.what());
  }
}

/// The SwiGLU weights `m` of expert `index` packed in `types`: for_expert
/// around PackedExpert, as PackedMoE::from packs (`which`: "expert", "shared expert").
template <class Swiglu>
packed::PackedExpert pack_expert(const char* which, std::size_t index, const Swiglu& m, packed::ExpertDtypes types) {
  return for_expert("PackedMoE::from", which, Index(index),
                    [&] { return packed::PackedExpert(m.w_gate(), m.w_up(), m.w_down(), types); });
}

}  // namespace detail::inference
}  // namespace apex
