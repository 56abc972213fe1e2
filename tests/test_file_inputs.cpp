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
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/inference/files/checkpoint/load.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/io/sharded_checkpoint.hpp>
#include <apex/ffn/layers/swiglu.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint_bytes.hpp"
#include "fuzz/fuzz_index.hpp"
#include "fuzz/replay.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
#define APEX_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define APEX_TEST_ASAN 1
#endif
#endif

namespace {

using test::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(text.data(), std::streamsize(text.size()));
}

/// A sparse file of `size` bytes that begins with `head`: the size caps are
/// checked against fstat, so a cap can be exceeded without writing the bytes.
void write_sparse(const std::string& path, const std::string& head, std::uint64_t size) {
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

/// The 8-byte little-endian length that starts a safetensors file.
std::string length_prefix(std::uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out;
}

/// A safetensors file whose header is `header`.
std::string safetensors_bytes(const std::string& header) { return length_prefix(header.size()) + header; }

/// The index of `swiglu_shards`: w_gate and w_up in s1, w_down in s2.
const char* const kWeightMap =
    "{\"w_gate.weight\":\"s1.safetensors\",\"w_up.weight\":\"s1.safetensors\",\"w_down.weight\":\"s2.safetensors\"}";

/// A SwiGLU(2, 3)'s tensors in two shard files of `dir` and the index
/// naming them (kWeightMap).
void swiglu_shards(const TempDir& dir, SwiGLU<double>& ffn) {
  const ParamList<double> p = ffn.param_values();
  save_checkpoint(dir / "s1.safetensors", ParamList<double>{p[0], p[1]});
  save_checkpoint(dir / "s2.safetensors", ParamList<double>{p[2]});
  write_text(dir / kShardIndexName, std::string("{\"metadata\":{\"total_size\":144},\"weight_map\":") + kWeightMap + "}");
}

using apex::test::snapshot;
using apex::test::unchanged;

/// Longest a rejected read may take before the test calls it blocked.
constexpr double kPromptReadSeconds = 2.0;

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
  CHECK(seconds < kPromptReadSeconds);
}

}  // namespace

// ───────────────────────────── the shard index ────────────────────────────────

TEST_CASE("A deeply nested value in a shard index is a FormatError, not a stack overflow",
          "[checkpoint][regression][index]") {
  // read_shard_index (io/shard_index.hpp) turned every non-string metadata
  // value into a string with nlohmann::json::dump(), which recurses once per
  // level: 100,000 nested arrays in a 200 KB index overflowed the stack
  // (SIGSEGV; a stack overflow under ASan) in load_sharded_checkpoint.
  // Fixed: the index is parsed with a callback that refuses nesting beyond
  // kMaxShardIndexNesting as soon as the container opens.
  TempDir dir;
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
  TempDir dir;
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
  TempDir dir;
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
  TempDir dir;
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
  TempDir dir;
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
  TempDir dir;
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

// ─────────────────────── every entry point, every hostile path ─────────────────

namespace {

/// A path that is no checkpoint, and what the FormatError must say of it.
struct Hostile {
  std::string what, path, message;
};

/// In `dir`: the kinds of path every reader must refuse at once — a FIFO
/// without a writer, links to /dev/zero and /dev/null, a folder — plus
/// /dev/null itself, a sparse file beyond the size cap whose first bytes
/// are `oversized_head`, and a file of nested JSON (`nested`).
std::vector<Hostile> hostile_paths(const TempDir& dir, const std::string& tag, const std::string& oversized_head,
                                   const std::string& nested, const std::string& nested_message) {
  const std::string fifo = dir / (tag + "fifo"), zero = dir / (tag + "zero"), null = dir / (tag + "null");
  const std::string folder = dir / (tag + "folder"), big = dir / (tag + "big"), deep = dir / (tag + "deep");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  fs::create_symlink("/dev/zero", zero);
  fs::create_symlink("/dev/null", null);
  fs::create_directory(folder);
  write_sparse(big, oversized_head, 200'000'000);
  write_text(deep, nested);
  return {{"a FIFO without a writer", fifo, "is not a regular file"},
          {"a link to /dev/zero", zero, "is not a regular file"},
          {"a link to /dev/null", null, "is not a regular file"},
          {"/dev/null", "/dev/null", "is not a regular file"},
          {"a folder", folder, "is not a regular file"},
          {"a file beyond the size cap", big, "more than the limit of 100000000"},
          {"deeply nested JSON", deep, nested_message}};
}

}  // namespace

TEST_CASE("Every file-reading entry point refuses what is no checkpoint with a prompt FormatError",
          "[checkpoint][sweeps][filetype]") {
  // The class behind the index's FIFO, /dev/zero, size and nesting defects,
  // swept over every public function that reads a safetensors file from a
  // path, the sharded loader reading it as a shard included. Each probe
  // runs in a forked child (30 s alarm, 4 GiB address space), so a reader
  // that blocks, reads without end or recurses without bound fails its own
  // case. mpi::load_checkpoint reads through the same readers
  // (safetensors::Reader, read_shard_index), covered here.
  TempDir dir;
  const auto files = hostile_paths(dir, "st-", length_prefix(150'000'000),
                                   safetensors_bytes("{\"__metadata__\":" + nested_objects(100'000) + "}"),
                                   "nests an object deeper than the format allows");
  SwiGLU<double> ffn(2, 3, 1);
  const MoEConfig cfg = test::moe_config(4, 2, 0, 2, 3);
  MoEFFN<double> moe(cfg, 1);
  const auto ffn_before = snapshot(ffn.param_values());
  const auto moe_before = snapshot(moe.param_values());
  for (const Hostile& h : files) {
    std::vector<std::pair<std::string, std::function<void()>>> entries = {
        {"load_checkpoint", [&] { load_checkpoint(h.path, ffn.param_values()); }},
        {"safetensors::Reader", [&] { (void)safetensors::Reader(h.path); }},
        {"load_family_checkpoint", [&] { load_family_checkpoint(h.path, moe, MoEFamily::Mixtral); }},
        {"load_packed_moe", [&] { (void)load_packed_moe<float>(h.path, cfg); }},
        {"load_packed_swiglu", [&] { (void)load_packed_swiglu<float>(h.path, 2, 3); }},
    };
    const fs::path p(h.path);
    const std::string index = dir / (p.filename().string() + ".index.json");
    if (p.parent_path() == dir.path) {  // an index may name only files in its folder
      write_text(index, "{\"weight_map\":{\"w_gate.weight\":\"" + p.filename().string() +
                            "\",\"w_up.weight\":\"x\",\"w_down.weight\":\"x\"}}");
      entries.push_back({"load_sharded_checkpoint, as a shard", [&] { load_sharded_checkpoint(index, ffn.param_values()); }});
    }
    for (const auto& [entry, call] : entries) {
      INFO(entry << " on " << h.what << " (" << h.path << ")");
      // These take a Hugging Face sharded folder too: a folder is read as
      // one, and one without an index is refused for the index it lacks.
      const bool takes_folders = entry == "load_family_checkpoint" || entry.rfind("load_packed_", 0) == 0;
      if (takes_folders && h.what == "a folder")
        expect_prompt_format_error(call, {h.path, kShardIndexName, "cannot open"});
      else
        expect_prompt_format_error(call, {h.path, h.message});
    }
  }
  CHECK(unchanged(ffn.param_values(), ffn_before));
  CHECK(unchanged(moe.param_values(), moe_before));
}

TEST_CASE("Every shard-index reader refuses an index that is no index with a prompt FormatError",
          "[checkpoint][sweeps][filetype][index]") {
  // The same kinds of path as the index of a sharded checkpoint: given as
  // the index file, and as the index inside a checkpoint's folder.
  TempDir dir;
  const auto files = hostile_paths(dir, "ix-", "{\"weight_map\":{}}",
                                   R"({"metadata":{"x":)" + nested_arrays(100'000) + R"(},"weight_map":{}})",
                                   "nests arrays or objects deeper than 16 levels");
  SwiGLU<double> ffn(2, 3, 1);
  const auto before = snapshot(ffn.param_values());
  for (const Hostile& h : files) {
    std::vector<std::pair<std::string, std::function<void()>>> entries = {
        {"read_shard_index", [&] { (void)read_shard_index(h.path); }},
    };
    // Given a folder, load_sharded_checkpoint reads the index inside it: the
    // folder kind is the second loop's.
    if (!fs::is_directory(h.path))
      entries.push_back({"load_sharded_checkpoint(index)", [&] { load_sharded_checkpoint(h.path, ffn.param_values()); }});
    for (const auto& [entry, call] : entries) {
      INFO(entry << " on " << h.what << " (" << h.path << ")");
      expect_prompt_format_error(call, {"read_shard_index('" + h.path + "')", h.message});
    }
  }
  // As the index of a folder: each kind again, in a folder of its own.
  for (const Hostile& h : files) {
    if (h.path == "/dev/null") continue;  // the same as the link to it
    const TempDir ckpt;
    const std::string index = ckpt / kShardIndexName;
    fs::rename(h.path, index);
    INFO("load_sharded_checkpoint(folder) with an index that is " << h.what);
    expect_prompt_format_error([&] { load_sharded_checkpoint(ckpt.path.string(), ffn.param_values()); },
                               {"read_shard_index('" + index + "')", h.message});
  }
  CHECK(unchanged(ffn.param_values(), before));
}

TEST_CASE("A rejected sharded load leaves every parameter as it was", "[checkpoint][sweeps][index]") {
  // load_sharded_checkpoint reads every shard into a staging copy and writes
  // the parameters only when all loaded, so a shard that fails after
  // another was read (s1 < s2: s2 loads second) changes nothing. Each way
  // the second shard or the index can be wrong.
  SwiGLU<double> saved(2, 3, 1);
  SwiGLU<double> wider(2, 4, 3);
  const std::vector<std::pair<std::string, std::function<void(const TempDir&)>>> breaks = {
      {"s2 absent", [](const TempDir& d) { fs::remove(d / "s2.safetensors"); }},
      {"s2 a FIFO", [](const TempDir& d) {
         fs::remove(d / "s2.safetensors");
         REQUIRE(::mkfifo((d / "s2.safetensors").c_str(), 0600) == 0);
       }},
      {"s2 truncated", [](const TempDir& d) { fs::resize_file(d / "s2.safetensors", fs::file_size(d / "s2.safetensors") - 8); }},
      {"s2 of another shape", [&](const TempDir& d) {
         save_checkpoint(d / "s2.safetensors", ParamList<double>{wider.param_values()[2]});
       }},
      {"s2 of an integer dtype", [](const TempDir& d) {
         write_text(d / "s2.safetensors",
                    safetensors_bytes(R"({"w_down.weight":{"dtype":"I32","shape":[2,3],"data_offsets":[0,24]}})") +
                        std::string(24, '\0'));
       }},
      {"s2 without the tensor", [](const TempDir& d) {
         Matrix<double> c = Matrix<double>::Ones(2, 3);
         save_checkpoint(d / "s2.safetensors", ParamList<double>{{"c", c.data(), nullptr, 2, 3}});
       }},
      {"the index without the tensor", [](const TempDir& d) {
         write_text(d / kShardIndexName, R"({"weight_map":{"w_gate.weight":"s1.safetensors","w_up.weight":"s1.safetensors"}})");
       }},
  };
  for (const auto& [what, bend] : breaks) {
    INFO(what);
    TempDir dir;
    swiglu_shards(dir, saved);
    bend(dir);
    SwiGLU<double> into(2, 3, 2);
    const auto before = snapshot(into.param_values());
    const auto load = [&] { load_sharded_checkpoint(dir.path.string(), into.param_values()); };
    // First in a child, where a hang or crash cannot end the run; then here,
    // where the layer can be compared.
    const std::string got = test::outcome_isolated(load);
    INFO(got);
    const bool rejected = got.rfind("FormatError: ", 0) == 0 || got.rfind("ShapeError: ", 0) == 0;
    CHECK(rejected);
    if (!rejected) continue;
    CHECK(test::outcome(load) == got);
    CHECK(unchanged(into.param_values(), before));
  }
}

TEST_CASE("The shard-index fuzz corpus and regression inputs replay safely", "[checkpoint][fuzz][index]") {
  // Each input of tests/fuzz/corpus_index/ and regressions_index/ through
  // the fuzz target's own body: it parses or throws FormatError, and what
  // it parses to survives being written back. In a forked child, so an
  // input that crashed the parser fails its case, not the run.
  const std::size_t files = fuzz::for_each_committed_input(
      fs::path(__FILE__).parent_path(), {"fuzz/corpus_index", "fuzz/regressions_index"},
      [](const fs::path& path, const std::string& bytes) {
        INFO(path.string());
        const std::string got = test::outcome_isolated([&] {
          fuzz::exercise_index(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
        });
        INFO(got);
        CHECK((got == "returned" || got.rfind("FormatError: ", 0) == 0));
      });
  CHECK(files >= 20);
}
