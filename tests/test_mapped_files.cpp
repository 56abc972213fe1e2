// Mapped model files: the mapped safetensors reader gives the pread
// reader's bytes without a copy, a sharded folder opens through mappings,
// and a mapped layer's resident memory is the experts a forward touched
// (smaps Rss of the mapping's VMA: this process's resident pages).
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <apex/ffn/inference.hpp>
#include <apex/ffn/inference/files/pack_once/file.hpp>
#include <apex/ffn/io/mapped_shards.hpp>
#include <apex/ffn/io/safetensors.hpp>

#include "fixtures.hpp"
#include "packed_layers.hpp"
#include "residency.hpp"
#include "temp_dir.hpp"

using namespace apex;

TEST_CASE("the mapped reader gives the pread reader's bytes and values", "[mapped]") {
  test::TempDir dir;
  const Matrix<float> a = test::rnd<float>(3, 5, 1), b = test::rnd<float>(1, 7, 2);
  safetensors::save<float>(dir / "t.safetensors", {{"a", {3, 5}, a.data()}, {"b", {7}, b.data()}},
                           safetensors::DType::BF16, {{"k", "v"}});
  const safetensors::Reader pread(dir / "t.safetensors");
  const safetensors::Reader mapped = safetensors::Reader::map(dir / "t.safetensors");
  CHECK(pread.mapping() == nullptr);
  CHECK(pread.mapped_bytes(pread.at("a")) == nullptr);
  REQUIRE(mapped.mapping() != nullptr);
  CHECK(mapped.metadata() == pread.metadata());
  for (const char* n : {"a", "b"}) {
    const auto& t = pread.at(n);
    std::vector<unsigned char> bytes(std::size_t(t.nbytes()));
    pread.read_bytes(t, bytes.data());
    CHECK(std::memcmp(mapped.mapped_bytes(mapped.at(n)), bytes.data(), bytes.size()) == 0);
    CHECK(mapped.mapped_bytes(mapped.at(n)) == mapped.mapping()->data() + mapped.header().data_offset() + t.begin);
  }
  CHECK(mapped.matrix<float>("a") == pread.matrix<float>("a"));
  CHECK(mapped.matrix<float>("a")(1, 2) == packed::to_float(packed::to_bf16(a(1, 2))));  // fixed: bf16 of the value
}

TEST_CASE("a sharded folder opens through mappings", "[mapped]") {
  test::TempDir dir;
  const Matrix<float> a = test::rnd<float>(2, 4, 3), b = test::rnd<float>(4, 2, 4);
  safetensors::save<float>(dir / "model-00001-of-00002.safetensors", {{"x.weight", {2, 4}, a.data()}},
                           safetensors::DType::BF16);
  safetensors::save<float>(dir / "model-00002-of-00002.safetensors", {{"y.weight", {4, 2}, b.data()}},
                           safetensors::DType::BF16);
  ShardIndex index;
  index.total_size = 32;
  index.weight_map = {{"x.weight", "model-00001-of-00002.safetensors"}, {"y.weight", "model-00002-of-00002.safetensors"}};
  write_shard_index(dir / kShardIndexName, index);
  const io::MappedShards shards(dir.path.string());
  CHECK(shards.names() == std::vector<std::string>{"x.weight", "y.weight"});
  CHECK(shards.info("y.weight").shape == std::vector<std::uint64_t>{4, 2});
  const safetensors::Reader pread(dir / "model-00002-of-00002.safetensors");
  std::vector<unsigned char> want(16);
  pread.read_bytes(pread.at("y.weight"), want.data());
  CHECK(std::memcmp(shards.bytes("y.weight"), want.data(), 16) == 0);
  CHECK(shards.reader("x.weight").matrix<float>("x.weight") == safetensors::Reader(dir / "model-00001-of-00002.safetensors").matrix<float>("x.weight"));
  CHECK_THROWS_AS(shards.bytes("z.weight"), FormatError);
  // An index naming a tensor its shard lacks is refused at open.
  index.weight_map["w.weight"] = "model-00001-of-00002.safetensors";
  write_shard_index(dir / kShardIndexName, index);
  CHECK_THROWS_WITH(io::MappedShards(dir.path.string()), Catch::Contains("does not hold it"));
}

TEST_CASE("a mapped layer's resident memory is the experts a forward touched", "[mapped]") {
  test::TempDir dir;
  MoEConfig c = test::moe_config(16, 2, 0, 512, 1024);
  const auto owned = PackedMoE<packed::bf16>::from(MoEFFN<float>(c, 21));
  save_packed_layout(dir / "r.safetensors", owned);
  const auto mapped = map_packed_moe<packed::bf16>(dir / "r.safetensors", c);
  const void* base = mapped.experts()[0].gate_up().mapping()->data();
  const long long before = test::mapping_rss(base).rss;
  if (before < 0) {
    WARN("residency not checked: no /proc/self/smaps entry for the mapping");
    return;
  }
  const long long expert = (long long)owned.experts()[0].bytes(), all = (long long)owned.expert_bytes();
  INFO("Rss before " << before << ", expert " << expert << ", all experts " << all);
  CHECK(before < all / 64);  // the header and the float parts
  const Matrix<float> x = test::rnd<float>(1, 512, 4);
  const Matrix<float> y = mapped.forward(x);
  const test::Resident after = test::mapping_rss(base);
  INFO("Rss after one token " << after.rss << ", of it huge pages " << after.huge);
  // 2 experts, their pages whole; slack: the float parts and the kernel's
  // fault-around (up to 64 KiB of already-cached neighbours per fault).
  CHECK(after.rss >= 2 * expert);
  if (after.huge > 0) WARN("the file's pages are mapped as huge pages here (tmpfs huge=always?): upper bound not checked");
  else CHECK(after.rss <= 2 * expert + before + (1 << 20));
  CHECK(test::bitwise_equal(y, owned.forward(x)));
}
