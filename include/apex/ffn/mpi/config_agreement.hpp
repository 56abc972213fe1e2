#pragma once
/// \file mpi/config_agreement.hpp
/// Checks at construction that every rank builds the same layer.
///
/// Ranks that disagree on d_model, E, K or the scalar type would exchange
/// rows of different widths or counts for experts that do not exist: at best
/// an MPI truncation error, at worst silently wrong numbers or a hang in a
/// later collective. So a layer describes itself as text (`fingerprint`:
/// library version, layer, scalar type, expert type, every MoEConfig field
/// including every routing option, doubles as exact hex), every rank allgathers every description, and each
/// rank compares all of them to rank 0's. Every rank reaches the same
/// verdict, so on a mismatch every rank throws the same ConfigError naming
/// the first rank that differs and both descriptions. Cost: two small
/// allgathers, once per construction. What can change on one rank after
/// construction is agreed per call (exchange_limit_setting, routing_setting).

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <typeinfo>
#include <vector>

#include "../core/errors.hpp"
#include "../moe/config.hpp"
#include "../core/types.hpp"
#include "../core/version.hpp"
#include "communicator.hpp"

namespace apex::mpi {

/// The exact text of a double (hex float), so 1e-3 and 1.0000000000000002e-3 differ.
inline std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

/// Every RoutingConfig field, as text (doubles exact).
inline std::string routing_fingerprint(const RoutingConfig& r) {
  return std::string("scoring ") + scoring_name(r.scoring) + "; n_groups " + std::to_string(r.n_groups) +
         "; topk_group " + std::to_string(r.topk_group) + "; group_score " +
         (r.group_score == GroupScore::Top2Sum ? "top2_sum" : "max") + "; renormalize " +
         (r.renormalize ? "1" : "0") + "; routed_scale " + exact(r.routed_scale) + "; capacity_factor " +
         exact(r.capacity_factor);
}

/// A description of an MoE layer: equal on two ranks iff they build the same
/// layer. `extra` is appended (e.g. expert options).
template <class T, class Expert>
std::string fingerprint(const char* layer, const MoEConfig& c, const std::string& extra = {}) {
  return std::string("apex-ffn ") + std::to_string(APEX_FFN_VERSION) + "; layer " + layer + "; scalar " +
         typeid(T).name() + " (" + std::to_string(sizeof(T)) + " bytes); expert " + typeid(Expert).name() +
         "; d_model " + std::to_string(c.d_model) + "; d_ffn " + std::to_string(c.d_ffn) + "; n_experts " +
         std::to_string(c.n_experts) + "; n_active " + std::to_string(c.n_active) + "; n_shared " +
         std::to_string(c.n_shared) + "; weights_from_unbiased " + (c.weights_from_unbiased ? "1" : "0") +
         "; balancer_alpha " + exact(c.balancer_alpha) + "; " + routing_fingerprint(c.routing) + "; d_shared_ffn " +
         std::to_string(c.d_shared_ffn) + "; shared_expert_gate " + (c.shared_expert_gate ? "1" : "0") +
         "; router_bias " + (c.router_bias ? "1" : "0") + (extra.empty() ? "" : "; " + extra);
}

/// 63 bits of the FNV-1a hash of `text`: a per-call check that every rank
/// still holds the same text, without sending it.
inline std::int64_t text_hash(const std::string& text) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  return std::int64_t(h >> 1);
}

/// The per-rank settings a layer's exchanges depend on, agreed in the first
/// phase of every forward and backward (Communicator::step) — after
/// construction they can change on one rank only. The chunk limit decides
/// how many MPI calls an exchange takes (one rank chunking and another not
/// is a truncation on one and a hang on the other); the router's routing
/// options (changeable through router().set_routing) decide the routed
/// pairs, which would silently stop being MoEFFN's. Not agreed, because
/// they change neither messages nor results: the thread count (results are
/// bitwise the same on any, tested) and the phase timers.
inline Agreed exchange_limit_setting(Index limit) { return {"the exchange limit (set_exchange_limit)", limit}; }
inline Agreed routing_setting(const RoutingConfig& routing) {
  return {"the router's routing options (router().set_routing)", text_hash(routing_fingerprint(routing))};
}

/// Allgathers every rank's `text` (collective) and throws ConfigError on
/// every rank if any differs from rank 0's.
inline void agree_on_config(const Communicator& comm, const char* where, const std::string& text) {
  const int p = comm.size();
  const int len = int(text.size());
  std::vector<int> lens(static_cast<std::size_t>(p)), displs(static_cast<std::size_t>(p));
  detail::check(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm.get()), "MPI_Allgather (config)");
  int total = 0;
  for (int r = 0; r < p; ++r) {
    displs[std::size_t(r)] = total;
    total += lens[std::size_t(r)];
  }
  std::string all(std::size_t(total), '\0');
  detail::check(MPI_Allgatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR,
                               comm.get()),
                "MPI_Allgatherv (config)");
  const std::string first = all.substr(0, std::size_t(lens[0]));
  for (int r = 1; r < p; ++r) {
    const std::string other = all.substr(std::size_t(displs[std::size_t(r)]), std::size_t(lens[std::size_t(r)]));
    if (other != first)
      throw ConfigError(std::string(where) + ": the configuration differs between ranks: rank " + std::to_string(r) +
                        " has '" + other + "', rank 0 has '" + first + "'");
  }
}

}  // namespace apex::mpi
