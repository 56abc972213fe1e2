#pragma once
/// \file mpi/expert_parallel_checkpoint.hpp
/// Checkpoints of an ExpertParallelMoE: a sharded save (each rank writes its
/// experts, rank 0 also the replicated tensors and the index, Hugging Face's
/// `model.safetensors.index.json`) and a load from a sharded checkpoint
/// written by any number of ranks or from a single-process file, so a
/// checkpoint moves between P ranks, P′ ranks and one process.
/// Needs apex::mpi and apex::checkpoint. The folder must be one file system
/// that every rank sees (a local folder on one machine, a shared file system
/// on a cluster).
///
/// Tensor names are MoEFFN's (`router.weight`, `experts.{e}.…`,
/// `shared_experts.{s}.…`) plus the balancing bias `expert_bias` [E], as
/// docs/checkpoints.md saves it, so `load_sharded_checkpoint(folder, params)`
/// of mpi/expert_parallel_checkpoint.hpp loads the result into a single-process layer.
///
/// Atomic save, in agreed steps: (0) every rank was given rank 0's folder
/// (a token file, checkpoint_folder.hpp); (1) every rank writes its shard
/// under a name no earlier save used (`model-<tag>-0000r-of-0000P.safetensors`,
/// the tag from rank 0's clock and pid); (2) if any rank failed, every rank
/// removes its new file and throws — the previous index and its files are
/// untouched; (3) rank 0 checks that every new shard is in its folder with
/// the size its writer reported, writes the new index atomically (the
/// commit point), and only then removes the files the previous index
/// named. A crash before (3) leaves the previous checkpoint whole, plus
/// unreferenced new files.

#include <mpi.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../io/checkpoint.hpp"
#include "../core/errors.hpp"
#include "../core/state_names.hpp"
#include "../io/sharded_checkpoint.hpp"
#include "checkpoint_folder.hpp"
#include "communicator.hpp"
#include "expert_parallel_moe.hpp"

namespace apex::mpi {

namespace detail {

/// This rank's tensors: its param_values() (values only: a checkpoint never
/// allocates gradients) and, on every rank, a view of `bias` named
/// `expert_bias` (only rank 0 saves it).
template <class T, class Expert>
ParamList<T> state_of(ExpertParallelMoE<T, Expert>& layer, RowVector<T>& bias) {
  ParamList<T> state = layer.param_values();
  state.push_back(Param<T>{"expert_bias", bias.data(), nullptr, 1, bias.cols()});
  return state;
}

/// Collects every rank's `text` on rank 0, in rank order (collective).
inline std::vector<std::string> gather_text(const Communicator& comm, const std::string& text) {
  const int p = comm.size(), len = int(text.size());
  std::vector<int> lens(static_cast<std::size_t>(p)), displs(static_cast<std::size_t>(p));
  check(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm.get()), "MPI_Gather (checkpoint)");
  int total = 0;
  for (int r = 0; r < p; ++r) {
    displs[std::size_t(r)] = total;
    total += lens[std::size_t(r)];
  }
  std::string all(std::size_t(comm.rank() == 0 ? total : 0), '\0');
  check(MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, comm.get()),
        "MPI_Gatherv (checkpoint)");
  std::vector<std::string> out;
  if (comm.rank() == 0)
    for (int r = 0; r < p; ++r) out.push_back(all.substr(std::size_t(displs[std::size_t(r)]), std::size_t(lens[std::size_t(r)])));
  return out;
}

/// A name no earlier save used: rank 0's clock and pid, on every rank (collective).
inline std::string save_tag(const Communicator& comm) {
  char tag[32] = {};
  if (comm.rank() == 0)
    std::snprintf(tag, sizeof tag, "%llx%x",
                  static_cast<unsigned long long>(std::chrono::system_clock::now().time_since_epoch().count()),
                  static_cast<unsigned>(::getpid()));
  check(MPI_Bcast(tag, int(sizeof tag), MPI_CHAR, 0, comm.get()), "MPI_Bcast (checkpoint tag)");
  return tag;
}

/// The shard file of rank r (0-based) of p in the save `tag`.
inline std::string shard_file(const std::string& tag, int r, int p) {
  char f[96];
  std::snprintf(f, sizeof f, "model-%s-%05d-of-%05d.safetensors", tag.c_str(), r + 1, p);
  return f;
}

/// What a rank wrote: its tensor names ('\n'-terminated), their data bytes
/// and the file's size.
struct ShardReport {
  std::string names;
  std::uint64_t tensor_bytes = 0, file_bytes = 0;
};

/// Writes this rank's shard to `path`: its experts, and on rank 0 also the
/// replicated tensors and `expert_bias` (1-D). Not collective.
template <class T, class Expert>
ShardReport write_shard(const std::string& path, ExpertParallelMoE<T, Expert>& layer, const SaveOptions& options) {
  const bool first = layer.comm().rank() == 0;
  RowVector<T> bias = layer.balancer().bias();
  ParamList<T> state;
  for (const auto& prm : state_of(layer, bias))
    if (first || prm.name.rfind(state_names::kRoutedPrefix, 0) == 0) state.push_back(prm);  // replicated tensors: rank 0 only
  SaveOptions o = options;
  if (first) o.shapes["expert_bias"] = {std::uint64_t(bias.cols())};
  apex::save_checkpoint(path, state, o);
  ShardReport report;
  const std::size_t item = safetensors::dtype_size(o.dtype.value_or(safetensors::dtype_of<T>()));
  for (const auto& prm : state) {
    report.names += prm.name + "\n";
    report.tensor_bytes += std::uint64_t(prm.size()) * item;
  }
  report.file_bytes = std::uint64_t(std::filesystem::file_size(path));
  return report;
}

/// Every rank's report on rank 0, in rank order (collective); empty elsewhere.
inline std::vector<ShardReport> gather_reports(const Communicator& comm, const ShardReport& mine) {
  const std::vector<std::string> names = gather_text(comm, mine.names);
  const std::uint64_t sizes[2] = {mine.tensor_bytes, mine.file_bytes};
  std::vector<std::uint64_t> all(comm.rank() == 0 ? std::size_t(2 * comm.size()) : 0);
  check(MPI_Gather(sizes, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, 0, comm.get()), "MPI_Gather (checkpoint)");
  std::vector<ShardReport> out(names.size());
  for (std::size_t r = 0; r < out.size(); ++r) out[r] = {names[r], all[2 * r], all[2 * r + 1]};
  return out;
}

/// The files the index in `folder` names, or none if there is no readable index.
inline std::set<std::string> indexed_files(const std::filesystem::path& folder) {
  std::set<std::string> files;
  std::error_code ec;
  const std::filesystem::path index_path = folder / kShardIndexName;
  if (std::filesystem::exists(index_path, ec)) try {
      for (const auto& f : read_shard_index(index_path.string()).files()) files.insert(f);
    } catch (const FormatError&) {
      // an unreadable old index: its files are left alone
    }
  return files;
}

/// Rank 0's commit: checks that every shard of `reports` is in `folder`
/// with its size, then writes the index atomically. Returns the files the
/// previous index named.
inline std::set<std::string> commit_index(const char* where, const std::filesystem::path& folder,
                                          const std::string& tag, const std::vector<ShardReport>& reports,
                                          const SaveOptions& options) {
  const int p = int(reports.size());
  std::vector<std::pair<std::string, std::uint64_t>> shards;
  ShardIndex index;
  for (int r = 0; r < p; ++r) {
    const std::string file = shard_file(tag, r, p);
    shards.emplace_back(file, reports[std::size_t(r)].file_bytes);
    index.total_size += reports[std::size_t(r)].tensor_bytes;
    const std::string& list = reports[std::size_t(r)].names;
    for (std::size_t at = 0, nl; (nl = list.find('\n', at)) != std::string::npos; at = nl + 1)
      index.weight_map[list.substr(at, nl - at)] = file;
  }
  check_shards(where, folder, shards);
  index.metadata["format"] = "apex-ffn";
  index.metadata["ranks"] = std::to_string(p);
  for (const auto& [k, v] : options.metadata) index.metadata[k] = v;
  std::set<std::string> previous = indexed_files(folder);
  write_shard_index((folder / kShardIndexName).string(), index);
  return previous;
}

}  // namespace detail

/// Saves `layer` as a sharded checkpoint in `folder` (which must exist, the
/// same folder on every rank): one safetensors file per rank and the index.
/// Collective. `options` as save_checkpoint (dtype, metadata; `expert_bias`
/// is saved 1-D). On any rank's failure every rank throws (FormatError for
/// I/O and for a folder that is not rank 0's — checkpoint_folder.hpp — the
/// errors of save_checkpoint) and the previous checkpoint in `folder` is
/// intact.
template <class T, class Expert>
void save_checkpoint(const std::string& folder, ExpertParallelMoE<T, Expert>& layer, const SaveOptions& options = {}) {
  namespace fs = std::filesystem;
  constexpr const char* where = "apex::mpi::save_checkpoint";
  const Communicator& comm = layer.comm();
  const int p = comm.size(), me = comm.rank();
  const std::string tag = detail::save_tag(comm);
  detail::agree_on_folder(comm, where, folder, tag);  // before anything is written
  const fs::path path = fs::path(folder) / detail::shard_file(tag, me, p);
  bool written = false;
  try {
    detail::ShardReport report;  // 1. every rank writes its shard under a fresh name
    comm.step(where, [&] {
      written = true;  // from the first byte on, the file is ours to remove
      report = detail::write_shard(path.string(), layer, options);
    });
    // 2. rank 0 learns every rank's shard, checks them and commits the index
    const std::vector<detail::ShardReport> reports = detail::gather_reports(comm, report);
    std::set<std::string> previous;
    comm.step(where, [&] {
      if (me == 0) previous = detail::commit_index(where, folder, tag, reports, options);
    });
    // 3. committed: the previous index's files go (best effort)
    for (const auto& f : previous)
      if (f.rfind("model-" + tag + "-", 0) != 0) ::unlink((fs::path(folder) / f).c_str());
  } catch (...) {
    if (written) ::unlink(path.c_str());
    throw;
  }
}

namespace detail {

/// What a load reads: this rank's tensors under the file's names, the
/// balancing bias's name in the file ("" for none), and the check of the
/// file's names that runs before any tensor is read (a family's rule, or
/// none). load_checkpoint and load_family_checkpoint differ only in this.
struct NamedLoad {
  std::function<void(const std::string& where, const safetensors::Reader&)> check_file = nullptr;
  std::function<void(const std::string& where, const ShardIndex&)> check_index = nullptr;
};

/// The collective, all-or-nothing load of `params` (this rank's tensors, as
/// the file names them, viewing the layer) and of the bias `bias_name`.
template <class T, class Expert>
LoadResult load_named(const char* where, const std::string& path, ExpertParallelMoE<T, Expert>& layer,
                      const ParamList<T>& params, const std::string& bias_name, const NamedLoad& checks,
                      const LoadOptions& options) {
  RowVector<T> bias = layer.balancer().bias();
  LoadResult result;
  std::optional<apex::detail::Staged<T>> staged;
  bool has_bias = false;
  layer.comm().step(where, [&] {
    ParamList<T> wanted = params;
    if (apex::detail::is_sharded_path(path)) {
      const std::string index_path = shard_index_path(path);
      const ShardIndex index = read_shard_index(index_path, options.limits);
      if (checks.check_index) checks.check_index(std::string(where) + "('" + index_path + "')", index);
      has_bias = !bias_name.empty() && index.weight_map.count(bias_name) > 0;
      if (has_bias) wanted.push_back(Param<T>{bias_name, bias.data(), nullptr, 1, bias.cols()});
      staged.emplace(wanted);
      result = apex::detail::load_shards_into(index_path, index, staged->views, options);
    } else {
      const safetensors::Reader file(path, options.limits);
      if (checks.check_file) checks.check_file(std::string(where) + "(" + file.source().description() + ")", file);
      has_bias = !bias_name.empty() && file.header().find(bias_name) != nullptr;
      if (has_bias) wanted.push_back(Param<T>{bias_name, bias.data(), nullptr, 1, bias.cols()});
      staged.emplace(wanted);
      LoadOptions o = options;
      o.allow_unexpected = true;  // the other ranks' experts
      result = apex::load_checkpoint(file, staged->views, o);
    }
    if (has_bias) apex::detail::check_finite(where, bias_name.c_str(), staged->values.back());
  });
  // Every rank has its tensors staged: commit.
  ParamList<T> target = params;
  if (has_bias) target.push_back(Param<T>{bias_name, bias.data(), nullptr, 1, bias.cols()});
  staged->commit(target, result.loaded);
  if (has_bias) layer.balancer().set_bias(bias);
  return result;
}

}  // namespace detail

/// Loads `layer` from `path`: a sharded checkpoint (its folder or index,
/// written by any number of ranks) or one safetensors file (a single-process
/// save, every rank reading the tensors it holds). `expert_bias`, if
/// present, sets the balancer's bias. Collective and all-or-nothing across
/// ranks: every rank reads into staging copies, all agree, then all commit;
/// on any rank's failure every rank throws and no layer changes. Errors as
/// load_checkpoint (strict: every parameter of this rank must be there).
template <class T, class Expert>
LoadResult load_checkpoint(const std::string& path, ExpertParallelMoE<T, Expert>& layer,
                           const LoadOptions& options = {}) {
  return detail::load_named("apex::mpi::load_checkpoint", path, layer, layer.param_values(), "expert_bias", {},
                            options);
}

}  // namespace apex::mpi
