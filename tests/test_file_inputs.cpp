// Hostile file inputs: every entry point that reads a file (load_checkpoint,
// safetensors::Reader, load_sharded_checkpoint and its index reader,
// load_family_checkpoint, the packed loaders) against paths that are no
// checkpoint — a FIFO without a writer, a link to /dev/zero, a folder,
// /dev/null, a file beyond the size caps, JSON nested without end — and the
// shard index against malformed content (duplicate keys, wrong value types)
// and shards that do not hold what it promises. Each must be a FormatError
// naming the problem, at once, with the destination left as it was. Probes
// that hung or crashed before their fix run in a forked child with a time
// limit (outcome_isolated), so a returning defect fails its own test.
#include <apex/ffn/checkpoint.hpp>
#include <apex/ffn/inference/packed_load.hpp>
#include <apex/ffn/moe.hpp>
#include <apex/ffn/name_maps.hpp>
#include <apex/ffn/sharded_checkpoint.hpp>
#include <apex/ffn/swiglu.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sweep.hpp"

using namespace apex;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

#if defined(__SANITIZE_ADDRESS__)
#define APEX_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define APEX_TEST_ASAN 1
#endif
#endif

namespace {

/// A fresh folder, removed with everything in it at scope exit.
struct Folder {
  fs::path path;
  Folder() {
    static int n = 0;
    path = fs::temp_directory_path() / ("apex_inputs_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(text.data(), std::streamsize(text.size()));
}

/// A sparse file of `size` bytes that begins with `head`: the size caps are
/// checked against fstat, so a cap can be exceeded without writing the bytes.
[[maybe_unused]] void write_sparse(const std::string& path, const std::string& head, std::uint64_t size) {
  write_text(path, head);
  REQUIRE(::truncate(path.c_str(), off_t(size)) == 0);
}

/// `depth` nested arrays, "[[[…]]]".
std::string nested_arrays(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

/// `depth` nested objects, {"x":{"x":…{}…}}.
std::string nested_objects(std::size_t depth) {
  std::string s;
  for (std::size_t i = 0; i < depth; ++i) s += "{\"x\":";
  s += "{}";
  return s + std::string(depth, '}');
}

/// A safetensors file whose header is `header` (the length prefix added).
[[maybe_unused]] std::string safetensors_bytes(const std::string& header) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
  return out + header;
}

/// The index of `swiglu_shards`: w_gate and w_up in s1, w_down in s2.
const char* const kWeightMap =
    "{\"w_gate.weight\":\"s1.safetensors\",\"w_up.weight\":\"s1.safetensors\",\"w_down.weight\":\"s2.safetensors\"}";

/// A SwiGLU(2, 3)'s tensors in two shard files of `dir` and the index
/// naming them (kWeightMap).
void swiglu_shards(const Folder& dir, SwiGLU<double>& ffn) {
  const ParamList<double> p = ffn.param_values();
  save_checkpoint(dir / "s1.safetensors", ParamList<double>{p[0], p[1]});
  save_checkpoint(dir / "s2.safetensors", ParamList<double>{p[2]});
  write_text(dir / kShardIndexName, std::string("{\"metadata\":{\"total_size\":144},\"weight_map\":") + kWeightMap + "}");
}

/// Copies of every parameter value, to prove a rejected load changed nothing.
std::vector<Matrix<double>> snapshot(const ParamList<double>& ps) {
  std::vector<Matrix<double>> out;
  for (const auto& p : ps) out.push_back(p.value());
  return out;
}
bool unchanged(const ParamList<double>& ps, const std::vector<Matrix<double>>& before) {
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (!(ps[i].value().array() == before[i].array()).all()) return false;
  return true;
}

/// Longest a rejected read may take before the test calls it blocked.
constexpr double kPromptSeconds = 2.0;

/// The address-space cap of a probe's child: a reader that reads a device
/// without end fails with bad_alloc there instead of taking the machine's
/// memory. Not under AddressSanitizer, which reserves terabytes of address
/// space at start-up (there the child's 30 s alarm is the only bound).
void cap_child_memory() {
#ifndef APEX_TEST_ASAN
  const rlim_t cap = rlim_t(4) << 30;
  rlimit r{cap, cap};
  ::setrlimit(RLIMIT_AS, &r);
#endif
}

/// outcome_isolated(call) under the memory cap; `seconds` gets how long it took.
std::string probe(const std::function<void()>& call, double& seconds) {
  const auto start = std::chrono::steady_clock::now();
  const std::string got = test::outcome_isolated([&] {
    cap_child_memory();
    call();
  });
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return got;
}

/// A probe that must be a FormatError containing every one of `names`, promptly.
void expect_prompt_format_error(const std::function<void()>& call, const std::vector<std::string>& names) {
  double seconds = 0;
  const std::string got = probe(call, seconds);
  INFO(got << " (" << seconds << " s)");
  test::expect(got, "FormatError", names);
  CHECK(seconds < kPromptSeconds);
}

}  // namespace

// ───────────────────────────── the shard index ────────────────────────────────

TEST_CASE("A deeply nested value in a shard index is a FormatError, not a stack overflow",
          "[checkpoint][regression][index]") {
  // read_shard_index (shard_index.hpp) turned every non-string metadata
  // value into a string with nlohmann::json::dump(), which recurses once per
  // level: 100,000 nested arrays in a 200 KB index overflowed the stack
  // (SIGSEGV; a stack overflow under ASan) in load_sharded_checkpoint.
  // Fixed: the index is parsed with a callback that refuses nesting beyond
  // kMaxShardIndexNesting as soon as the container opens.
  Folder dir;
  SwiGLU<double> saved(2, 3, 1), into(2, 3, 2);
  swiglu_shards(dir, saved);
  const auto before = snapshot(into.param_values());
  for (const std::string& deep : {nested_arrays(100'000), nested_objects(100'000)}) {
    write_text(dir / kShardIndexName,
               "{\"metadata\":{\"x\":" + deep + "},\"weight_map\":" + std::string(kWeightMap) + "}");
    expect_prompt_format_error([&] { load_sharded_checkpoint(dir.path.string(), into.param_values()); },
                               {"read_shard_index", kShardIndexName, "deeper than"});
    expect_prompt_format_error([&] { (void)read_shard_index(dir / kShardIndexName); }, {"deeper than"});
  }
  CHECK(unchanged(into.param_values(), before));
}

TEST_CASE("A shard index that is a FIFO is a FormatError at once instead of a hang", "[checkpoint][regression][index]") {
  // read_shard_index opened the index with std::ifstream, whose open() of a
  // named pipe waits for a writer: forever. Fixed: the index is opened like
  // a shard (safetensors::FileSource: O_NONBLOCK, then fstat on the
  // descriptor, regular files only).
  Folder dir;
  SwiGLU<double> saved(2, 3, 1), into(2, 3, 2);
  swiglu_shards(dir, saved);
  fs::remove(dir / kShardIndexName);
  REQUIRE(::mkfifo((dir / kShardIndexName).c_str(), 0600) == 0);
  const auto before = snapshot(into.param_values());
  expect_prompt_format_error([&] { load_sharded_checkpoint(dir.path.string(), into.param_values()); },
                             {"read_shard_index", kShardIndexName, "is not a regular file"});
  expect_prompt_format_error([&] { load_sharded_checkpoint(dir / kShardIndexName, into.param_values()); },
                             {"is not a regular file"});
  CHECK(unchanged(into.param_values(), before));
}

TEST_CASE("A shard index that is a link to /dev/zero is a FormatError, not a read without end",
          "[checkpoint][regression][index]") {
  // read_shard_index read the index to its end, so a link to /dev/zero grew
  // a string until memory ran out (bad_alloc under this test's 4 GiB cap).
  // Fixed: only a regular file is read (fstat on the opened descriptor).
  Folder dir;
  SwiGLU<double> saved(2, 3, 1), into(2, 3, 2);
  swiglu_shards(dir, saved);
  fs::remove(dir / kShardIndexName);
  fs::create_symlink("/dev/zero", dir / kShardIndexName);
  const auto before = snapshot(into.param_values());
  expect_prompt_format_error([&] { load_sharded_checkpoint(dir.path.string(), into.param_values()); },
                             {"read_shard_index", kShardIndexName, "is not a regular file"});
  CHECK(unchanged(into.param_values(), before));
}

TEST_CASE("A shard index beyond the size cap is a FormatError naming the cap", "[checkpoint][regression][index]") {
  // read_shard_index read an index of any size into memory (and then a copy
  // of it): a valid index followed by 100 MB of spaces loaded. Fixed: an
  // index larger than Limits::max_index_bytes (100 MB, the safetensors
  // header's cap) is refused from its fstat size, before anything is read.
  Folder dir;
  SwiGLU<double> saved(2, 3, 1), into(2, 3, 2);
  swiglu_shards(dir, saved);
  {
    std::ofstream f(dir / kShardIndexName, std::ios::binary | std::ios::app);
    const std::string spaces(1 << 20, ' ');
    for (int i = 0; i < 96; ++i) f << spaces;  // 100,663,296 bytes of whitespace after the JSON
  }
  const std::string size = std::to_string(fs::file_size(dir / kShardIndexName));
  const auto before = snapshot(into.param_values());
  expect_prompt_format_error([&] { load_sharded_checkpoint(dir.path.string(), into.param_values()); },
                             {"read_shard_index", kShardIndexName, "has " + size + " bytes, more than the limit of 100000000"});
  CHECK(unchanged(into.param_values(), before));
}

TEST_CASE("A duplicate key in a shard index is a FormatError", "[checkpoint][regression][index]") {
  // nlohmann::json keeps the last of two equal keys, so an index naming a
  // tensor twice (or holding two weight_maps) loaded the last one without a
  // word, while the safetensors header parser rejects duplicates. Fixed: the
  // index parser's callback tracks the keys of every open object.
  Folder dir;
  SwiGLU<double> saved(2, 3, 1), into(2, 3, 2);
  swiglu_shards(dir, saved);
  const auto before = snapshot(into.param_values());
  const std::string wm = kWeightMap;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"weight_map\":{\"w_down.weight\":\"s1.safetensors\"," + wm.substr(1) + "}", "'w_down.weight'"},
      {"{\"weight_map\":{\"x\":\"s1.safetensors\"},\"weight_map\":" + wm + "}", "'weight_map'"},
      {"{\"metadata\":{\"a\":\"1\",\"a\":\"2\"},\"weight_map\":" + wm + "}", "'a'"},
  };
  for (const auto& [text, key] : cases) {
    INFO(text);
    write_text(dir / kShardIndexName, text);
    expect_prompt_format_error([&] { load_sharded_checkpoint(dir.path.string(), into.param_values()); },
                               {"read_shard_index", "repeats the key " + key});
  }
  CHECK(unchanged(into.param_values(), before));
}

TEST_CASE("allow_missing lists a tensor the index names but its shard lacks", "[checkpoint][regression][index]") {
  // load_shards_into dropped the `missing` list of each shard's load: with
  // the index {a → s1, b → s2} and s2 holding only c, allow_missing = true
  // returned loaded = [a], missing = [] — b was neither loaded nor
  // reported. Fixed: a tensor the index puts in a shard that lacks it is
  // missing (listed with allow_missing, FormatError without); a shard's
  // tensors that no parameter names stay ignored, as always.
  Folder dir;
  Matrix<double> a = Matrix<double>::Constant(2, 2, 1.0), c = Matrix<double>::Constant(2, 2, 3.0);
  save_checkpoint(dir / "s1.safetensors", ParamList<double>{{"a", a.data(), nullptr, 2, 2}});
  save_checkpoint(dir / "s2.safetensors", ParamList<double>{{"c", c.data(), nullptr, 2, 2}});
  write_text(dir / kShardIndexName, R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  Matrix<double> a2 = Matrix<double>::Zero(2, 2), b2 = Matrix<double>::Zero(2, 2);
  const ParamList<double> into{{"a", a2.data(), nullptr, 2, 2}, {"b", b2.data(), nullptr, 2, 2}};
  LoadOptions lenient;
  lenient.allow_missing = true;
  const LoadResult r = load_sharded_checkpoint(dir.path.string(), into, lenient);
  CHECK(r.loaded == std::vector<std::string>{"a"});
  CHECK(r.missing == std::vector<std::string>{"b"});
  CHECK(a2 == a);
  CHECK(b2 == Matrix<double>::Zero(2, 2));
  a2.setZero();
  test::expect(test::outcome([&] { load_sharded_checkpoint(dir.path.string(), into); }), "FormatError",
               {"s2.safetensors", "missing 'b'"});
  CHECK(a2 == Matrix<double>::Zero(2, 2));  // strict and rejected: nothing written
}

TEST_CASE("The shard index parser refuses every malformed index with a FormatError naming the problem",
          "[checkpoint][sweeps][index]") {
  // parse_shard_index is where an index is trusted; read_shard_index reads a
  // file into it. Besides nesting and duplicate keys (the regressions above):
  // the shape of the document, the value types, the file names. A
  // `metadata` that is not an object and a `total_size` that is not a
  // non-negative integer were silently ignored or kept as text before, so
  // that writing such an index back changed it; they are refused now, as
  // the safetensors header parser refuses the same.
  const std::string wm = R"("weight_map":{"a":"s.safetensors"})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "not valid JSON"},
      {"{" + wm + "} x", "not valid JSON"},
      {"{" + wm + "} // comment", "not valid JSON"},
      {"{\"weight_map\":{\"\xff\":\"s\"}}", "not valid JSON"},  // not UTF-8
      {R"({"metadata":{"total_size":1e999},)" + wm + "}", "not valid JSON"},
      {"[]", "expected an object with a 'weight_map' object"},
      {R"({"metadata":{}})", "expected an object with a 'weight_map' object"},
      {R"({"weight_map":["a"]})", "expected an object with a 'weight_map' object"},
      {R"({"weight_map":{"a":1}})", "weight_map entry 'a' is not a string"},
      {R"({"weight_map":{"a":null}})", "weight_map entry 'a' is not a string"},
      {R"({"weight_map":{"a":["s"]}})", "weight_map entry 'a' is not a string"},
      {R"({"weight_map":{"a":"../s.safetensors"}})", "'../s.safetensors' is not a plain file name"},
      {R"({"weight_map":{"a":".."}})", "'..' is not a plain file name"},
      {R"({"weight_map":{"a":""}})", "'' is not a plain file name"},
      {R"({"weight_map":{"a":"/etc/passwd"}})", "is not a plain file name"},
      {R"({"weight_map":{"a":"s\u0000.safetensors"}})", "shard file name 's"},  // what() ends at the NUL
      {R"({"metadata":[],)" + wm + "}", "'metadata' is not a JSON object"},
      {R"({"metadata":"x",)" + wm + "}", "'metadata' is not a JSON object"},
      {R"({"metadata":{"total_size":-1},)" + wm + "}", "'total_size' must be a non-negative integer, got -1"},
      {R"({"metadata":{"total_size":1.5},)" + wm + "}", "'total_size' must be a non-negative integer, got 1.5"},
      {R"({"metadata":{"total_size":"144"},)" + wm + "}", "'total_size' must be a non-negative integer, got \"144\""},
      {R"({"metadata":{"total_size":18446744073709551616},)" + wm + "}", "'total_size' must be a non-negative integer"},
      {R"({"metadata":{"x":)" + nested_arrays(kMaxShardIndexNesting - 1) + "}," + wm + "}", "deeper than 16 levels"},
      {R"({"a":{"b":{"c":1},"b":2},)" + wm + "}", "repeats the key 'b' in 'a'"},
  };
  for (const auto& [text, message] : cases) {
    INFO(text);
    test::expect(test::outcome([&] { (void)parse_shard_index(text, "here"); }), "FormatError", {"here: ", message});
  }

  // Accepted: nesting up to the limit, non-string metadata kept as JSON
  // text, unknown keys of the root ignored.
  const ShardIndex ok = parse_shard_index(R"({"metadata":{"total_size":144,"n":1e300,"x":)" +
                                              nested_arrays(kMaxShardIndexNesting - 2) + R"(},"extra":[1],)" + wm + "}",
                                          "here");
  CHECK(ok.total_size == 144);
  CHECK(ok.metadata.at("n") == "1e+300");
  CHECK(ok.metadata.at("x") == nested_arrays(kMaxShardIndexNesting - 2));
  CHECK(ok.weight_map == std::map<std::string, std::string>{{"a", "s.safetensors"}});
  // What write_shard_index writes parses back to the same index.
  const ShardIndex again = parse_shard_index(shard_index_text(ok), "again");
  CHECK(again.total_size == ok.total_size);
  CHECK(again.metadata == ok.metadata);
  CHECK(again.weight_map == ok.weight_map);
}
