// Sharded checkpoints of the expert-parallel layer: round trips, loads into
// a single-process layer and from one, resharding to fewer ranks, and
// atomicity when one rank fails.
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/expert_parallel_checkpoint.hpp>
#include <apex/ffn/mpi/family_checkpoint.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/io/sharded_checkpoint.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

#include "mpi_fixtures.hpp"
#include "tensor_files.hpp"

using namespace apex;
using apex::mpi::Communicator;
using EP = apex::mpi::ExpertParallelMoE<double>;
namespace fs = std::filesystem;

namespace {

/// A fresh folder every rank sees (rank 0 creates it), removed at the end.
struct SharedFolder {
  Communicator comm;
  std::string path;
  SharedFolder() {
    char buf[256] = {};
    if (comm.rank() == 0) {
      std::string tmpl = (fs::temp_directory_path() / "apex_mpi_ckpt_XXXXXX").string();
      REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
      tmpl.copy(buf, sizeof buf - 1);
    }
    MPI_Bcast(buf, int(sizeof buf), MPI_CHAR, 0, comm.get());
    path = buf;
  }
  ~SharedFolder() {
    comm.barrier();
    if (comm.rank() == 0) fs::remove_all(path);
  }
  std::set<std::string> files() const {
    std::set<std::string> s;
    for (const auto& e : fs::directory_iterator(path)) s.insert(e.path().filename().string());
    return s;
  }
};

/// Values of every parameter by name.
std::map<std::string, Matrix<double>> values_of(const ParamList<double>& params) {
  std::map<std::string, Matrix<double>> m;
  for (const auto& p : params) m[p.name] = p.value();
  return m;
}

/// Changes every parameter and the bias; a replicated tensor the same way on
/// every rank (the seed depends on its name only).
void perturb(EP& ep, std::uint64_t seed) {
  for (const auto& p : ep.params()) {
    std::uint64_t h = seed;
    for (char ch : p.name) h = h * 131 + std::uint64_t(ch);
    p.value() += test::random_matrix(p.rows, p.cols, h, 0.1);
  }
  RowVector<double> b = test::random_matrix(1, ep.config().n_experts, seed, 0.5);
  ep.balancer().set_bias(b);
}

}  // namespace

TEST_CASE("A sharded checkpoint round-trips and loads into a single-process layer", "[mpi]") {
  SharedFolder dir;
  const Communicator& comm = dir.comm;
  const MoEConfig cfg = test::moe_config(7, 2, 1, 6, 8);
  EP ep(cfg, comm, 1);
  perturb(ep, 50);
  mpi::save_checkpoint(dir.path, ep);
  if (comm.rank() == 0) {
    // The index names every tensor once; one file per rank.
    const ShardIndex index = read_shard_index(dir.path + "/" + kShardIndexName);
    CHECK(index.weight_map.size() == MoEFFN<double>(cfg).params().size() + 1);  // and expert_bias
    CHECK(index.files().size() == std::size_t(comm.size()));
    CHECK(index.metadata.at("ranks") == std::to_string(comm.size()));
    CHECK(index.total_size > 0);
  }

  // Round trip into a fresh layer on the same ranks.
  EP back(cfg, comm, 99);
  mpi::load_checkpoint(dir.path, back);
  CHECK(values_of(back.params()) == values_of(ep.params()));
  CHECK(back.balancer().bias() == ep.balancer().bias());

  // Into a single-process MoEFFN (with the bias, as docs/checkpoints.md carries it).
  MoEFFN<double> single(cfg, 7);
  RowVector<double> bias(cfg.n_experts);
  ParamList<double> state = single.params();
  state.push_back({"expert_bias", bias.data(), nullptr, 1, bias.cols()});
  const LoadResult r = load_sharded_checkpoint(dir.path, state);
  CHECK(r.loaded.size() == state.size());
  CHECK(bias == ep.balancer().bias());
  const auto all = values_of(single.params());
  for (const auto& [name, value] : values_of(ep.params())) CHECK(all.at(name) == value);
}

TEST_CASE("A single-process checkpoint loads into any number of ranks, a sharded one into fewer", "[mpi]") {
  SharedFolder dir;
  const Communicator& comm = dir.comm;
  const MoEConfig cfg = test::moe_config(8, 2, 2, 6, 8);
  MoEFFN<double> single(cfg, 3);  // the same on every rank
  for (const auto& p : single.params()) p.value() *= 1.5;
  const std::string file = dir.path + "/single.safetensors";
  if (comm.rank() == 0) save_checkpoint(file, single.params());
  comm.barrier();
  EP ep(cfg, comm, 42);
  mpi::load_checkpoint(file, ep);
  const auto all = values_of(single.params());
  for (const auto& [name, value] : values_of(ep.params())) CHECK(all.at(name) == value);

  // Resharding: the P-rank checkpoint into layers of 1 rank and of ⌈P/2⌉ ranks.
  mpi::save_checkpoint(dir.path + "", ep);
  for (int groups : {comm.size(), 2}) {
    MPI_Comm sub;
    MPI_Comm_split(comm.get(), comm.rank() % groups, comm.rank(), &sub);
    {
      const Communicator c(sub);
      EP part(cfg, c, 77);
      mpi::load_checkpoint(dir.path, part);
      for (const auto& [name, value] : values_of(part.params())) CHECK(all.at(name) == value);
    }
    MPI_Comm_free(&sub);
  }
}

TEST_CASE("A save that fails on one rank leaves the previous checkpoint whole", "[mpi]") {
  SharedFolder dir;
  const Communicator& comm = dir.comm;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 6, 8);
  EP ep(cfg, comm, 1);
  mpi::save_checkpoint(dir.path, ep);
  comm.barrier();
  const auto before_files = dir.files();
  const auto saved = values_of(ep.params());
  comm.barrier();  // every rank's snapshot before any rank starts the next save

  perturb(ep, 70);
  SaveOptions bad;
  if (comm.rank() == comm.size() - 1) bad.dtype = safetensors::DType::I32;  // this rank cannot write
  test::throws<ValueError>([&] { mpi::save_checkpoint(dir.path, ep, bad); }, {"I32"});
  comm.barrier();
  CHECK(dir.files() == before_files);  // no new shard left, none removed
  EP back(cfg, comm, 5);
  mpi::load_checkpoint(dir.path, back);
  CHECK(values_of(back.params()) == saved);

  // A load that fails on one rank changes no rank's layer.
  const std::string missing = comm.rank() == 0 ? dir.path + "/nothing-here" : dir.path;
  const auto current = values_of(ep.params());
  test::throws<FormatError>([&] { mpi::load_checkpoint(missing, ep); });
  CHECK(values_of(ep.params()) == current);

  // A later successful save replaces the old shards.
  mpi::save_checkpoint(dir.path, ep);
  comm.barrier();
  if (comm.rank() == 0) {
    const auto now = dir.files();
    for (const auto& f : before_files)
      if (f != kShardIndexName) CHECK(now.count(f) == 0);
    CHECK(now.size() == std::size_t(comm.size()) + 1);
  }
}

TEST_CASE("A sharded checkpoint of a layer with a gated, wider shared expert round-trips", "[mpi]") {
  SharedFolder dir;
  const Communicator& comm = dir.comm;
  MoEConfig cfg = test::moe_config(7, 2, 1, 6, 8);
  cfg.routing.scoring = Scoring::SoftmaxAll;
  cfg.routing.renormalize = false;
  cfg.d_shared_ffn = 11;
  cfg.shared_expert_gate = true;
  EP ep(cfg, comm, 1);
  perturb(ep, 51);
  mpi::save_checkpoint(dir.path, ep);

  EP back(cfg, comm, 99);
  mpi::load_checkpoint(dir.path, back);
  CHECK(values_of(back.params()) == values_of(ep.params()));
  CHECK(back.balancer().bias() == ep.balancer().bias());

  // Into MoEFFN by its own names: shared_expert_gate.weight and the 11-wide shared expert included.
  MoEFFN<double> single(cfg, 7);
  RowVector<double> bias(cfg.n_experts);
  ParamList<double> state = single.params();
  state.push_back({"expert_bias", bias.data(), nullptr, 1, bias.cols()});
  const LoadResult r = load_sharded_checkpoint(dir.path, state);
  CHECK(r.loaded.size() == state.size());
  CHECK(bias == ep.balancer().bias());
  const auto all = values_of(single.params());
  REQUIRE(all.count("shared_expert_gate.weight") == 1);
  for (const auto& [name, value] : values_of(ep.params())) CHECK(all.at(name) == value);
}

TEST_CASE("A save into different folders on different ranks is refused and keeps the checkpoint", "[mpi][regression]") {
  test::HangGuard guard("save into different folders");
  SharedFolder a, b;
  const Communicator& comm = a.comm;
  if (comm.size() == 1) return;  // nothing can differ
  const MoEConfig cfg = test::moe_config(7, 2, 1, 6, 8);
  EP ep(cfg, comm, 1);
  perturb(ep, 52);
  mpi::save_checkpoint(a.path, ep);
  const auto saved = values_of(ep.params());
  comm.barrier();
  const auto files_a = a.files(), files_b = b.files();
  comm.barrier();  // every rank's snapshot before the next save
  perturb(ep, 53);
  for (const bool rank0_elsewhere : {false, true}) {
    INFO("rank 0 passes " << (rank0_elsewhere ? "B, the others A" : "A, the others B"));
    const bool in_b = (comm.rank() == 0) == rank0_elsewhere;
    test::throws<FormatError>([&] { mpi::save_checkpoint(in_b ? b.path : a.path, ep); },
                              {"every rank must pass the same folder"});
    comm.barrier();
    CHECK(a.files() == files_a);  // no shard added or removed, the index unchanged
    CHECK(b.files() == files_b);
    EP back(cfg, comm, 9);
    mpi::load_checkpoint(a.path, back);
    CHECK(values_of(back.params()) == saved);
  }
  // The same folder under another name on some ranks is the same folder.
  const std::string alias = a.path + "/./";
  mpi::save_checkpoint(comm.rank() == 0 ? a.path : alias, ep);
  EP back(cfg, comm, 9);
  mpi::load_checkpoint(a.path, back);
  CHECK(values_of(back.params()) == values_of(ep.params()));
  comm.barrier();
  CHECK(a.files().size() == std::size_t(comm.size()) + 1);  // the new shards and the index, nothing else
}

TEST_CASE("The committing rank checks every shard the new index names", "[mpi][regression]") {
  SharedFolder dir;
  if (dir.comm.rank() != 0) return;  // a local check of rank 0
  const fs::path folder = dir.path;
  for (const char* name : {"s1.safetensors", "s2.safetensors"}) {
    std::FILE* f = std::fopen((folder / name).c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fputs("0123456789", f);
    std::fclose(f);
  }
  CHECK_NOTHROW(mpi::detail::check_shards("t", folder, {{"s1.safetensors", 10}, {"s2.safetensors", 10}}));
  test::throws<FormatError>([&] { mpi::detail::check_shards("t", folder, {{"s1.safetensors", 10}, {"s3.safetensors", 10}}); },
                            {"s3.safetensors", "does not exist"});
  test::throws<FormatError>([&] { mpi::detail::check_shards("t", folder, {{"s2.safetensors", 11}}); },
                            {"s2.safetensors", "10 bytes", "expected 11"});
}

TEST_CASE("A rejected load leaves every rank's layer as it was", "[mpi]") {
  test::HangGuard guard("rejected loads");
  SharedFolder dir;
  const Communicator& comm = dir.comm;
  const bool odd = comm.rank() == comm.size() - 1;
  const MoEConfig cfg = test::moe_config(6, 2, 1, 6, 8);
  EP ep(cfg, comm, 1);
  perturb(ep, 54);
  const std::string good = dir.path + "/good", wide = dir.path + "/wide";
  if (comm.rank() == 0) {
    fs::create_directory(good);
    fs::create_directory(wide);
  }
  comm.barrier();
  mpi::save_checkpoint(good, ep);
  MoEConfig wider = cfg;
  wider.d_ffn += 1;
  EP other(wider, comm, 2);
  mpi::save_checkpoint(wide, other);  // every expert tensor of another shape
  // A single-process file whose bias holds a NaN, every weight fine.
  const std::string nan_bias = dir.path + "/nan_bias.safetensors";
  if (comm.rank() == 0) {
    MoEFFN<double> single(cfg, 3);
    RowVector<double> bias = RowVector<double>::Zero(cfg.n_experts);
    bias(1) = std::nan("");
    ParamList<double> state = single.params();
    state.push_back({"expert_bias", bias.data(), nullptr, 1, bias.cols()});
    save_checkpoint(nan_bias, state);
  }
  comm.barrier();
  perturb(ep, 55);  // differs from every file
  const auto before = values_of(ep.params());
  const RowVector<double> bias_before = ep.balancer().bias();
  const auto unchanged = [&] {
    CHECK(values_of(ep.params()) == before);
    CHECK(ep.balancer().bias() == bias_before);
  };
  test::throws<FormatError>([&] { mpi::load_checkpoint(odd ? dir.path + "/nothing-here" : good, ep); });
  unchanged();
  test::throws<Error>([&] { mpi::load_checkpoint(odd ? wide : good, ep); });
  unchanged();
  test::throws<ValueError>([&] { mpi::load_checkpoint(odd ? nan_bias : good, ep); }, {"expert_bias"});
  unchanged();
  test::throws<ValueError>([&] { mpi::load_checkpoint(nan_bias, ep); }, {"expert_bias"});
  unchanged();
  // A shard of the good checkpoint cut short: whichever ranks read it fail, no rank changes.
  comm.barrier();
  if (comm.rank() == 0) {
    const ShardIndex index = read_shard_index(good + "/" + kShardIndexName);
    const std::string shard = good + "/" + index.weight_map.at("router.weight");
    fs::resize_file(shard, fs::file_size(shard) / 2);
  }
  comm.barrier();
  test::throws<FormatError>([&] { mpi::load_checkpoint(good, ep); });
  unchanged();
}

TEST_CASE("A family's Hugging Face checkpoint, one file or shards, loads into the expert-parallel layer", "[mpi][families]") {
  SharedFolder dir;
  const Communicator& comm = dir.comm;
  const std::string prefix = "model.layers.2.";
  for (MoEFamily f : {MoEFamily::DeepSeekV3, MoEFamily::Qwen2MoE, MoEFamily::Qwen3MoE, MoEFamily::OLMoE,
                      MoEFamily::Mixtral}) {
    INFO(family_name(f));
    MoEConfig cfg = family_preset(f);
    cfg.d_model = 6, cfg.d_ffn = 4, cfg.n_experts = 8, cfg.n_active = 2;
    if (cfg.n_shared) cfg.d_shared_ffn = 5;
    if (f == MoEFamily::DeepSeekV3) cfg.routing.n_groups = 4, cfg.routing.topk_group = 2;
    MoEFFN<double> single(cfg, 3);  // the same on every rank
    single.balancer().set_bias(test::random_matrix(1, cfg.n_experts, 9, 0.3));
    const std::string file = dir.path + "/" + family_name(f) + ".safetensors";
    const std::string folder = dir.path + "/" + family_name(f) + "-hf";
    if (comm.rank() == 0) {
      save_family_checkpoint(file, single, f, prefix);
      fs::create_directories(folder);
      test::write_sharded(safetensors::Reader(file), folder, 3);
    }
    comm.barrier();
    const auto all = values_of(single.params());
    for (const std::string& path : {file, folder}) {
      INFO(path);
      EP ep(cfg, comm, 42);
      const LoadResult r = mpi::load_family_checkpoint(path, ep, f, prefix);
      // This rank read its own tensors only: its experts and the replicated ones.
      CHECK(r.loaded.size() == ep.param_values().size() + (f == MoEFamily::DeepSeekV3 ? 1 : 0));
      for (const auto& [name, value] : values_of(ep.params())) CHECK(all.at(name) == value);
      if (f == MoEFamily::DeepSeekV3) CHECK(ep.balancer().bias() == single.balancer().bias());
      else CHECK(ep.balancer().bias().isZero());
    }
  }
  // Another family's names: refused on every rank, the layer unchanged.
  MoEConfig cfg = family_preset(MoEFamily::Qwen3MoE);
  cfg.d_model = 6, cfg.d_ffn = 4, cfg.n_experts = 8, cfg.n_active = 2;
  EP ep(cfg, comm, 42);
  const auto before = values_of(ep.params());
  test::throws<FormatError>(
      [&] { mpi::load_family_checkpoint(dir.path + "/mixtral.safetensors", ep, MoEFamily::Qwen3MoE, prefix); },
      {"load_family_checkpoint", "another family", "mixtral's"});
  CHECK(values_of(ep.params()) == before);
}
