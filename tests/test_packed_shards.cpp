// load_packed_moe from Hugging Face sharded folders (model.safetensors.index.json
// and its shards, opened through mappings): the packed layer of every family
// fixture, and of a library-named layer in a block type, is the one the one
// file gives, bit for bit; a bad folder is a typed error naming the problem;
// opening the folder reads no weight (the shards' resident pages).
#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/io/mapped_shards.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "families.hpp"
#include "fixtures.hpp"
#include "packed_layers.hpp"
#include "sweep.hpp"
#include "residency.hpp"
#include "temp_dir.hpp"
#include "tensor_files.hpp"

using namespace apex;

namespace {

namespace fs = std::filesystem;
const fs::path kData = fs::path(__FILE__).parent_path() / "data";

std::string fixture_path(MoEFamily f) { return (kData / ("family_" + std::string(family_name(f)) + ".safetensors")).string(); }

/// Every bit of a packed layer: its quantized-checkpoint serialisation
/// (router, bias, every expert's panel rows, shared gate).
template <class Layer>
std::vector<unsigned char> bits(const Layer& layer) {
  safetensors::VectorSink out;
  write_packed_moe(out, layer);
  return out.bytes;
}

/// Rewrites the folder's index through `edit` (its JSON).
template <class Edit>
void edit_index(const test::TempDir& dir, Edit edit) {
  std::ifstream in(dir / kShardIndexName);
  nlohmann::json j = nlohmann::json::parse(in);
  in.close();
  edit(j);
  std::ofstream(dir / kShardIndexName) << j.dump();
}

/// `file` split over `shards` files in `folder` with an index, every tensor
/// with its stored bytes and dtype (quantized blocks stay U8) and every
/// shard with the file's metadata; tensors go round-robin in name order.
void write_raw_shards(const safetensors::Reader& file, const fs::path& folder, int shards) {
  std::vector<std::vector<safetensors::RawTensor>> parts(static_cast<std::size_t>(shards));
  ShardIndex index;
  const auto name = [&](int i) { return "part-" + std::to_string(i) + ".safetensors"; };
  int i = 0;
  for (const auto& t : file.tensors()) {
    parts[std::size_t(i)].push_back({t.name, t.dtype, t.shape, [&file, &t](safetensors::ByteSink& s) {
                                       std::vector<unsigned char> b(std::size_t(t.nbytes()));
                                       file.read_bytes(t, b.data());
                                       s.write(b.data(), b.size());
                                     }});
    index.weight_map[t.name] = name(i);
    index.total_size += t.nbytes();
    i = (i + 1) % shards;
  }
  for (int k = 0; k < shards; ++k)
    safetensors::save_raw((folder / name(k)).string(), parts[std::size_t(k)], file.metadata());
  write_shard_index((folder / kShardIndexName).string(), index);
}


}  // namespace

TEST_CASE("a family's packed layer from a sharded folder is the one file's, bit for bit", "[sharded_packed]") {
  for (MoEFamily f : test::kFamilies) {
    INFO(family_name(f));
    const safetensors::Reader file(fixture_path(f));
    const MoEConfig cfg = test::fixture_config(f, file);
    PackedLoadOptions po;
    po.prefix = file.metadata().at("prefix");
    po.family = f;
    test::TempDir dir;
    // The whole fixture: its test.* and grad.* references are the shards' other tensors, outside the prefix.
    const std::string index = test::write_sharded(file, dir.path, 3);
    const auto one_f = load_packed_moe<float>(file, cfg, po);
    const auto dir_f = load_packed_moe<float>(dir.path.string(), cfg, po);  // the folder
    const auto idx_f = load_packed_moe<float>(index, cfg, po);             // its index
    CHECK(bits(dir_f) == bits(one_f));
    CHECK(bits(idx_f) == bits(one_f));
    const auto one_b = load_packed_moe<packed::bf16>(file, cfg, po);
    const auto dir_b = load_packed_moe<packed::bf16>(dir.path.string(), cfg, po);
    CHECK(bits(dir_b) == bits(one_b));
    // The float layer the folder gives is the PyTorch reference's (fixed values, F64).
    const Index n = Index(file.at("test.x").shape[0]);
    const Matrix<float> x = test::read_tensor(file, "test.x", n, cfg.d_model).cast<float>();
    const Matrix<double> y_ref = test::read_tensor(file, "test.y", n, cfg.d_model);
    const Matrix<float> y = dir_f.forward(x);
    CHECK((y.cast<double>() - y_ref).norm() <= 1e-6 * y_ref.norm());
    CHECK(test::bitwise_equal(y, one_f.forward(x)));
    CHECK(test::bitwise_equal(dir_b.forward(x), one_b.forward(x)));
    // The fingerprint is the values': the float layer of the same checkpoint is its source.
    MoEFFN<float> moe(cfg, 7);
    LoadOptions lo;
    lo.allow_unexpected = true;
    load_family_checkpoint(file, moe, f, po.prefix, lo);
    CHECK_NOTHROW(dir_f.check_source(moe));
  }
}

TEST_CASE("library names from a sharded folder, quantized expert by expert", "[sharded_packed]") {
  MoEConfig c = test::moe_config(4, 2, 1, 64, 32);
  MoEFFN<float> moe(c, 31);
  test::TempDir dir;
  save_checkpoint(dir / "one.safetensors", moe.param_values());
  const safetensors::Reader file(dir / "one.safetensors");
  test::TempDir shards;
  test::write_sharded(file, shards.path, 3);
  for (packed::Dtype t : {packed::Dtype::q8_0, packed::Dtype::q4_0, packed::Dtype::f32}) {
    INFO(packed::dtype_name(t));
    PackedLoadOptions po;
    po.types = PackedTypes(t);
    const auto one = load_packed_moe<float>(file, c, po);
    const auto sharded = load_packed_moe<float>(shards.path.string(), c, po);
    CHECK(sharded.experts()[0].gate_up().dtype() == t);
    CHECK(bits(sharded) == bits(one));
  }
  // Straight from the float layer (not through a file): the same bits.
  CHECK(bits(load_packed_moe<packed::bf16>(shards.path.string(), c)) == bits(PackedMoE<packed::bf16>::from(moe)));
  // The sublayer and a lone SwiGLU take folders too.
  PackedLoadOptions so;
  so.prefix = "experts.1.";  // strict: the other experts' tensors lie outside it
  const auto one_sw = load_packed_swiglu<float>(file, c.d_model, c.d_ffn, so);
  const auto dir_sw = load_packed_swiglu<float>(shards.path.string(), c.d_model, c.d_ffn, so);
  const Matrix<float> x = test::rnd<float>(3, c.d_model, 5);
  CHECK(test::bitwise_equal(dir_sw.forward(x), one_sw.forward(x)));
}

TEST_CASE("a quantized checkpoint from a sharded folder keeps its blocks", "[sharded_packed]") {
  MoEConfig c = test::moe_config(4, 2, 1, 256, 32);  // q4_k rows of 256 weights, q8_0 of 32
  const auto q = PackedMoE<float>::from(MoEFFN<float>(c, 61), PackedTypes(packed::ExpertDtypes{packed::Dtype::q4_k, packed::Dtype::q8_0}));
  test::TempDir dir, shards;
  save_packed_moe(dir / "q.safetensors", q);
  const safetensors::Reader file(dir / "q.safetensors");
  write_raw_shards(file, shards.path, 3);
  const auto got = load_packed_moe<float>(shards.path.string(), c);
  CHECK(got.experts()[0].gate_up().dtype() == packed::Dtype::q4_k);
  CHECK(got.experts()[0].down().dtype() == packed::Dtype::q8_0);
  CHECK(bits(got) == bits(q));
  // Shards disagreeing on a block type: refused, naming the key.
  const std::string part = shards / "part-1.safetensors";
  const safetensors::Reader one(part);
  safetensors::Metadata meta = one.metadata();
  const std::string key = std::string("apex.quant.") + "experts.0.w_down.weight";
  REQUIRE(meta.count(key) == 1);
  meta[key] = "q4_0";
  std::vector<safetensors::RawTensor> same;
  for (const auto& t : one.tensors())
    same.push_back({t.name, t.dtype, t.shape, [&one, &t](safetensors::ByteSink& s) {
                      std::vector<unsigned char> b(std::size_t(t.nbytes()));
                      one.read_bytes(t, b.data());
                      s.write(b.data(), b.size());
                    }});
  safetensors::save_raw(part, same, meta);
  test::expect(test::outcome([&] { load_packed_moe<float>(shards.path.string(), c); }), "FormatError",
               {"disagree", key, "part-0.safetensors", "part-1.safetensors"});
}

TEST_CASE("a packed sublayer from a sharded folder", "[sharded_packed]") {
  MoEConfig c = test::moe_config(4, 2, 0, 8, 6);
  MoEFFN<float> moe(c, 41);
  RMSNorm<float> norm(c.d_model);
  ParamList<float> all;
  detail::append_prefixed(all, "layers.2.ffn.", moe.param_values());
  detail::append_prefixed(all, "layers.2.norm.", norm.param_values());
  test::TempDir dir, shards;
  save_checkpoint(dir / "one.safetensors", all);
  const safetensors::Reader file(dir / "one.safetensors");
  test::write_sharded(file, shards.path, 2);
  PackedLoadOptions po;
  po.prefix = "layers.2.";
  const auto one = load_packed_sublayer<float>(file, c, {}, po);
  const auto sharded = load_packed_sublayer<float>(shards.path.string(), c, {}, po);
  const Matrix<float> x = test::rnd<float>(3, c.d_model, 6);
  CHECK(test::bitwise_equal(sharded.forward(x), one.forward(x)));
}

TEST_CASE("bad sharded folders: typed errors naming the problem", "[sharded_packed]") {
  const MoEFamily f = MoEFamily::Qwen3MoE;
  const safetensors::Reader file(fixture_path(f));
  const MoEConfig cfg = test::fixture_config(f, file);
  PackedLoadOptions po;
  po.prefix = file.metadata().at("prefix");
  po.family = f;
  const std::string router = po.prefix + "mlp.gate.weight";
  const auto load = [&](const test::TempDir& dir, const PackedLoadOptions& o) {
    return test::outcome([&] { load_packed_moe<float>(dir.path.string(), cfg, o); });
  };
  const auto fresh = [&](test::TempDir& dir) { test::write_sharded(file, dir.path, 3); };
  const std::string shard2 = "model-00002-of-00003.safetensors";
  {  // a shard the index names is not there
    test::TempDir dir;
    fresh(dir);
    fs::remove(dir.path / shard2);
    test::expect(load(dir, po), "FormatError", {shard2});
  }
  {  // the index puts a tensor in a shard that does not hold it
    test::TempDir dir;
    fresh(dir);
    edit_index(dir, [&](nlohmann::json& j) {
      j["weight_map"][router] = j["weight_map"][router] == shard2 ? "model-00001-of-00003.safetensors" : shard2;
    });
    test::expect(load(dir, po), "FormatError", {router, "does not hold it"});
  }
  {  // a truncated shard
    test::TempDir dir;
    fresh(dir);
    fs::resize_file(dir.path / shard2, fs::file_size(dir.path / shard2) / 2);
    test::expect(load(dir, po), "FormatError", {shard2});
  }
  {  // an index naming a file outside its folder
    test::TempDir dir;
    fresh(dir);
    edit_index(dir, [&](nlohmann::json& j) { j["weight_map"][router] = "../" + shard2; });
    test::expect(load(dir, po), "FormatError", {"not a plain file name"});
  }
  {  // a tensor the layer needs that the index does not name
    test::TempDir dir;
    fresh(dir);
    edit_index(dir, [&](nlohmann::json& j) { j["weight_map"].erase(po.prefix + "mlp.experts.1.up_proj.weight"); });
    test::expect(load(dir, po), "FormatError", {"missing", "mlp.experts.1.up_proj.weight", kShardIndexName});
  }
  {  // a tensor under the prefix the layer does not name: strict unless allowed
    test::TempDir dir;
    std::vector<test::TensorData> ts = test::read_tensors(file);
    ts.push_back({po.prefix + "mlp.extra.weight", {2}, {1.0, 2.0}});
    const std::vector<unsigned char> bytes = test::write_tensors(ts);
    test::write_sharded(safetensors::Reader::from_memory(bytes.data(), bytes.size()), dir.path, 3);
    test::expect(load(dir, po), "FormatError", {"unexpected", "mlp.extra.weight"});
    PackedLoadOptions lax = po;
    lax.allow_unexpected = true;
    CHECK(load(dir, lax) == "returned");
  }
  {  // another family's folder
    const safetensors::Reader mixtral(fixture_path(MoEFamily::Mixtral));
    test::TempDir dir;
    test::write_sharded(mixtral, dir.path, 2);
    PackedLoadOptions o = po;
    o.prefix = mixtral.metadata().at("prefix");
    o.allow_unexpected = true;
    test::expect(test::outcome([&] {
                   load_packed_moe<float>(dir.path.string(), test::fixture_config(MoEFamily::Mixtral, mixtral), o);
                 }),
                 "FormatError", {kShardIndexName, "qwen3_moe name map", "mixtral's"});
  }
  {  // a folder without an index
    test::TempDir dir;
    test::expect(load(dir, po), "FormatError", {kShardIndexName});
  }
}

TEST_CASE("opening a sharded folder reads no weight and the load reads the layer's", "[sharded_packed][mapped]") {
  MoEConfig c = test::moe_config(16, 2, 0, 256, 512);  // 50 MB of F64 shards: much more than a huge page each
  MoEFFN<float> moe(c, 51);
  test::TempDir dir, shards;
  save_checkpoint(dir / "one.safetensors", moe.param_values());
  const std::string index = test::write_sharded(safetensors::Reader(dir / "one.safetensors"), shards.path, 3);
  const io::MappedShards folder(index);
  std::vector<const void*> bases;
  long long data = 0;
  for (const std::string& name : folder.names()) {
    const void* b = folder.mapping(name)->data();
    if (std::find(bases.begin(), bases.end(), b) == bases.end()) {
      bases.push_back(b);
      data += (long long)folder.mapping(name)->size();
    }
  }
  REQUIRE(bases.size() == 3);
  long long before = 0, huge = 0;
  for (const void* b : bases) {
    const test::Resident r = test::mapping_rss(b);
    if (r.rss < 0) {
      WARN("residency not checked: no /proc/self/smaps entry for a shard's mapping");
      return;
    }
    before += r.rss;
    huge += r.huge;
  }
  INFO("Rss of the three shards after opening " << before << " of " << data << " bytes");
  // The headers, and the kernel's fault-around of cached neighbours (64
  // KiB a fault) — or, where file pages are mapped 2 MiB at a time (a tmpfs
  // huge=always, large folios), the huge page under each header.
  const long long slack = huge > 0 ? (long long)bases.size() * (2 << 20) : 0;
  CHECK(before < slack + data / 64);
  CHECK(before < data / 8);
  const auto layer = detail::inference::load_packed_moe_from<PackedMoE<float>>(
      detail::inference::PackedSource(folder, index), c, PackedLoadOptions{});
  long long after = 0;
  for (const void* b : bases) after += test::mapping_rss(b).rss;
  INFO("after the load " << after);
  CHECK(after >= data * 9 / 10);  // every tensor is the layer's: all were read
  CHECK(bits(layer) == bits(PackedMoE<float>::from(moe)));
}
