// GGUF model files into the expert-parallel layer (mpi/gguf_checkpoint.hpp):
// for every architecture, in f32 and q8_0, every rank's parameters equal the
// single-process load_gguf_moe_float layer's, the forward equals its forward,
// each rank decodes only its own experts' slices (the routed experts read
// once over all ranks), and a file of another configuration or architecture
// is the same typed error on every rank with every layer unchanged.
#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/inference/files/gguf/save.hpp>
#include <apex/ffn/io/gguf.hpp>
#include <apex/ffn/mpi/gguf_checkpoint.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mpi_fixtures.hpp"
#include "temp_dir.hpp"

using namespace apex;
using apex::mpi::Communicator;
using EP = apex::mpi::ExpertParallelMoE<double>;

namespace {

constexpr Index kD = 64, kF = 32;  // whole Q8_0 blocks
constexpr Index kBlock = 2;        // the block index written and read
constexpr double kTol = 1e-12;     // double: relative, per tensor (as the other EP tests)

/// llama.cpp's routing of the family at test sizes (E ≥ 4: one expert per rank at least).
MoEConfig arch_config(MoEFamily fam) {
  MoEConfig c;
  c.d_model = kD, c.d_ffn = kF, c.n_experts = 8, c.n_active = 2;
  c.routing = family_routing(fam);
  if (fam == MoEFamily::Qwen2MoE) c.n_shared = 1, c.d_shared_ffn = 96, c.shared_expert_gate = true;
  if (fam == MoEFamily::DeepSeekV3) {
    c.n_experts = 16, c.routing.n_groups = 4, c.routing.topk_group = 2;
    c.n_shared = 1, c.d_shared_ffn = 64;  // expert_shared_count 2: one MLP of 2·d_ffn
  }
  return c;
}

/// Writes the family's test layer as block kBlock of `path` in `type`.
void write_file(const std::string& path, MoEFamily fam, packed::Dtype type, std::uint64_t seed) {
  MoEFFN<float> m(arch_config(fam), seed);
  if (fam == MoEFamily::DeepSeekV3) m.balancer().set_bias(test::rnd<float>(1, 16, seed + 7, 0.1));
  GgufSaveOptions o;
  o.layer = kBlock;
  o.family = fam;
  save_gguf_moe(path, m, type, o);
}

std::map<std::string, Matrix<double>> values_of(const ParamList<double>& params) {
  std::map<std::string, Matrix<double>> m;
  for (const auto& p : params) m[p.name] = p.value();
  return m;
}

/// The bytes this rank decoded of `tensor`, as expert slices (offset / slice size); -1 for a partial slice.
std::multiset<Index> experts_read(const mpi::GgufLoadResult& r, const gguf::TensorInfo& t, Index n_experts) {
  const std::size_t slice = std::size_t(t.nbytes) / std::size_t(n_experts);
  std::multiset<Index> out;
  for (const auto& s : r.decoded)
    if (s.tensor == t.name) out.insert(s.bytes == slice && s.offset % slice == 0 ? Index(s.offset / slice) : -1);
  return out;
}

}  // namespace

TEST_CASE("A GGUF block of every architecture loads into the expert-parallel layer, each rank reading its experts",
          "[mpi][gguf]") {
  test::HangGuard guard("gguf loads");
  const Communicator comm;
  test::TempDir dir;  // this rank's own copy of the file: the writer is deterministic
  std::uint64_t seed = 20;
  for (MoEFamily fam : kAllFamilies) {
    for (packed::Dtype type : {packed::Dtype::f32, packed::Dtype::q8_0}) {
      INFO(family_name(fam) << " in " << packed::dtype_name(type));
      const std::string path = dir / "layer.gguf";
      write_file(path, fam, type, seed++);
      const gguf::File file = gguf::File::open(path);
      MoEFFN<double> single = load_gguf_moe_float<double>(file, kBlock);
      const MoEConfig cfg = arch_config(fam);
      EP ep(cfg, comm, 42);
      const mpi::GgufLoadResult r = mpi::load_gguf_moe(file, ep, kBlock);

      // Every parameter equals the single-process layer's, by name; the bias too.
      const auto all = values_of(single.param_values());
      std::vector<std::string> names;
      for (const auto& [name, value] : values_of(ep.param_values())) {
        INFO(name);
        REQUIRE(all.count(name) == 1);
        CHECK(all.at(name) == value);
      }
      for (const auto& p : ep.param_values()) names.push_back(p.name);
      names.push_back("expert_bias");
      CHECK(r.loaded == names);
      CHECK(ep.balancer().bias() == single.balancer().bias());
      if (fam == MoEFamily::DeepSeekV3) CHECK(!ep.balancer().bias().isZero());

      // This rank decoded exactly its experts' slices of each 3-D tensor, once each.
      std::multiset<Index> mine;
      for (Index e = ep.first_expert(); e < ep.first_expert() + Index(ep.experts().size()); ++e) mine.insert(e);
      std::uint64_t routed_bytes = 0, file_bytes = 0;
      for (const char* base : {gguf::tensor_names::kGateExps, gguf::tensor_names::kUpExps, gguf::tensor_names::kDownExps}) {
        const gguf::TensorInfo& t = file.tensor(gguf::block_tensor(kBlock, base));
        CHECK(experts_read(r, t, cfg.n_experts) == mine);
        file_bytes += t.nbytes;
        for (const auto& s : r.decoded)
          if (s.tensor == t.name) routed_bytes += s.bytes;
      }
      std::uint64_t total = 0;  // over all ranks: the routed experts decoded once
      MPI_Allreduce(&routed_bytes, &total, 1, MPI_UINT64_T, MPI_SUM, comm.get());
      CHECK(total == file_bytes);

      // The forward on every rank's slice of one batch equals the single-process forward.
      const std::vector<Index> sizes = {5, 0, 9, 3};
      const test::Slice s = test::slice_of(comm, sizes);
      const Matrix<double> x_all = test::random_matrix(s.total, kD, 77, 1.0);
      const Matrix<double> y_ref = single.forward(x_all);
      const Matrix<double> y = ep.forward(x_all.middleRows(s.begin, s.rows));
      CHECK(test::rel_error(y, y_ref.middleRows(s.begin, s.rows)) <= kTol);
    }
  }
}

TEST_CASE("A GGUF block of another configuration or architecture is refused on every rank", "[mpi][gguf]") {
  test::HangGuard guard("rejected gguf loads");
  const Communicator comm;
  test::TempDir dir;
  const bool odd = comm.rank() == comm.size() - 1;
  const std::string qwen3 = dir / "qwen3.gguf", olmoe = dir / "olmoe.gguf", foreign = dir / "foreign.gguf";
  write_file(qwen3, MoEFamily::Qwen3MoE, packed::Dtype::q8_0, 5);
  write_file(olmoe, MoEFamily::OLMoE, packed::Dtype::q8_0, 6);
  {  // the qwen3moe file relabelled as an architecture the table lacks
    const gguf::File in = gguf::File::open(qwen3);
    gguf::Writer w;
    for (const gguf::Value& v : in.metadata())
      if (v.key() == "general.architecture") w.set_string(v.key(), "gpt2");
      else if (v.key() != "general.alignment") w.set(v.key(), v);
    for (const gguf::TensorInfo& t : in.tensors())
      w.add_tensor(t.name, t.type, t.ne, in.data(t), t.nbytes);
    w.save(foreign);
  }
  EP ep(arch_config(MoEFamily::Qwen3MoE), comm, 42);
  mpi::load_gguf_moe(qwen3, ep, kBlock);
  // Values no file holds, so that any partial load would show.
  for (const auto& p : ep.param_values()) p.value().array() += 0.125;
  ep.balancer().set_bias(test::random_matrix(1, 8, 3, 0.5));
  const auto before = values_of(ep.param_values());
  const RowVector<double> bias_before = ep.balancer().bias();
  const auto unchanged = [&] {
    CHECK(values_of(ep.param_values()) == before);
    CHECK(ep.balancer().bias() == bias_before);
  };
  // Same sizes, another routing (olmoe does not renormalise): the difference named, both values.
  test::throws<ConfigError>([&] { mpi::load_gguf_moe(olmoe, ep, kBlock); },
                            {"load_gguf_moe", "routing.renormalize 0 in the file, 1 in the layer"});
  unchanged();
  // Another width: d_ffn named with both values.
  MoEConfig wide = arch_config(MoEFamily::Qwen3MoE);
  wide.d_ffn = 2 * kF;
  EP other(wide, comm, 1);
  const auto other_before = values_of(other.param_values());
  test::throws<ConfigError>([&] { mpi::load_gguf_moe(qwen3, other, kBlock); },
                            {"d_ffn 32 in the file, 64 in the layer"});
  CHECK(values_of(other.param_values()) == other_before);
  // An architecture the table lacks on one rank only: every rank throws, none changes.
  test::throws<ConfigError>([&] { mpi::load_gguf_moe(odd ? foreign : qwen3, ep, kBlock); }, {"gpt2"});
  unchanged();
  // A file that is not there on one rank; a block past the end on every rank.
  test::throws<FormatError>([&] { mpi::load_gguf_moe(odd ? dir / "nothing.gguf" : qwen3, ep, kBlock); });
  unchanged();
  test::throws<ConfigError>([&] { mpi::load_gguf_moe(qwen3, ep, kBlock + 1); }, {"block 3"});
  unchanged();
  // A good load still works after the refusals, and gives the file's values.
  const gguf::File file = gguf::File::open(qwen3);
  mpi::load_gguf_moe(file, ep, kBlock);
  const auto ref = values_of(load_gguf_moe_float<double>(file, kBlock).param_values());
  for (const auto& [name, value] : values_of(ep.param_values())) CHECK(ref.at(name) == value);
  CHECK(ep.balancer().bias().isZero());
}
