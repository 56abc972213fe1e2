// Malformed safetensors files: every class of defect the reader guards
// against, the edges the format allows, the header-length cap checked before
// any allocation, every truncation of a valid file, random corruptions (only
// ever library errors), and the fuzz corpus and its regression inputs
// replayed (tests/fuzz).
#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/io/name_maps.hpp>
#include <apex/ffn/io/sharded_checkpoint.hpp>
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/layers/kappa_swiglu.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/rms_norm.hpp>
#include <apex/ffn/layers/swiglu.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "checkpoint_bytes.hpp"
#include "fuzz/fuzz_loader.hpp"
#include "fuzz/replay.hpp"
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;
namespace st = apex::safetensors;
using Catch::Matchers::Contains;
using apex::test::Bytes;
using apex::test::make_file;
using apex::test::open_memory;
using apex::test::serialise;
using apex::test::write_bytes;
using apex::test::TempDir;

namespace {

struct Bad {
  const char* what;
  Bytes bytes;
  const char* message;  // a piece of the expected FormatError message
};

std::string nested(int depth) { return std::string(std::size_t(depth), '[') + std::string(std::size_t(depth), ']'); }

std::vector<Bad> malformed_files() {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const Bytes eight(8, 0);
  Bytes huge_len(16, ' ');
  st::detail::store_le(huge_len.data(), std::uint64_t(1) << 63, 8);
  Bytes over_cap(16, ' ');
  st::detail::store_le(over_cap.data(), 200'000'000, 8);
  Bytes beyond(16, ' ');
  st::detail::store_le(beyond.data(), 9, 8);
  return {
      {"empty file", {}, "fewer than the 8-byte header length"},
      {"7 bytes", Bytes(7, 0), "fewer than the 8-byte header length"},
      {"header length 2^63", huge_len, "more than the limit"},
      {"header length over the 100 MB cap", over_cap, "more than the limit"},
      {"header length beyond the file", beyond, "has only 8 bytes after the length"},
      {"zero-length header", make_file(""), "does not start with '{'"},
      {"header not starting with {", make_file(" {}"), "does not start with '{'"},
      {"not JSON", make_file("{nope}"), "not valid JSON"},
      {"trailing garbage", make_file("{}x"), "not valid JSON"},
      // nlohmann ends its input at a NUL: without the check, what follows it went unread (serde_json, the
      // reference reader, refuses the header: "trailing characters")
      {"NUL after the object", make_file("{" + ok_entry + "}" + std::string("\0{\"b\":{}}", 9), eight), "a NUL byte"},
      {"NUL padding", make_file("{" + ok_entry + "}" + std::string(3, '\0'), eight), "a NUL byte at offset"},
      {"truncated JSON", make_file(R"({"a":{"dtype":"F32")"), "not valid JSON"},
      {"non-UTF-8 name", make_file("{\"\xff\xfe\":{}}"), "not valid JSON"},
      {"overlong UTF-8", make_file("{\"\xc0\xaf\":{}}"), "not valid JSON"},
      {"lone surrogate", make_file(R"({"\ud800":{}})"), "not valid JSON"},
      {"value without a key", make_file("{" + nested(1) + "}"), "not valid JSON"},
      {"deep nesting in metadata", make_file(R"({"__metadata__":)" + nested(100000) + "}"), "array where"},
      {"deep nesting of objects", make_file(R"({"a":{"shape":{"c":{}}}})"), "deeper than the format allows"},
      {"duplicate tensor", make_file("{" + ok_entry + "," + ok_entry + "}", eight), "repeats the key 'a'"},
      {"duplicate field", make_file(R"({"a":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})", eight),
       "repeats the key 'dtype'"},
      {"unknown field", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       "unknown field 'x'"},
      {"missing dtype", make_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight), "has no 'dtype'"},
      {"missing shape", make_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", eight), "has no 'shape'"},
      {"missing offsets", make_file(R"({"a":{"dtype":"F32","shape":[2]}})", eight), "has no 'data_offsets'"},
      {"tensor not an object", make_file(R"({"a":3})"), "not a JSON object"},
      {"unknown dtype", make_file(R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"lower-case dtype", make_file(R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"sub-byte dtype", make_file(R"({"a":{"dtype":"F4","shape":[16],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"dtype not a string", make_file(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight), "unknown or unsupported dtype"},
      {"negative dimension", make_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight), "non-negative integer"},
      {"fractional dimension", make_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight), "non-negative integer"},
      {"dimension as a string", make_file(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", eight), "non-negative integer"},
      {"dimension beyond 2^64", make_file(R"({"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})", eight),
       "non-negative integer"},
      {"dimension beyond 2^63", make_file(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", eight),
       "beyond 2^63 - 1"},
      {"element count overflows", make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,8]}})", eight),
       "element count overflows"},
      {"byte size overflows", make_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", eight),
       "byte size overflows"},
      {"huge declared size", make_file(R"({"a":{"dtype":"F64","shape":[1000000000000],"data_offsets":[0,8000000000000]}})", eight),
       "ends at byte 8000000000000"},
      {"shape not an array", make_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", eight), "not an array"},
      {"200-digit dimension", make_file(R"({"a":{"dtype":"F32","shape":[)" + std::string(200, '1') + R"(],"data_offsets":[0,8]}})", eight),
       "non-negative integer"},
      {"rank above 64", make_file(R"({"a":{"dtype":"U8","shape":[)" + [] {
                                   std::string s = "1";
                                   for (int i = 0; i < 70; ++i) s += ",1";
                                   return s;
                                 }() + R"(],"data_offsets":[0,1]}})", Bytes(1, 0)),
       "array longer than 64"},
      {"three offsets", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", eight), "[begin, end]"},
      {"end before begin", make_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight), "end < begin"},
      {"size disagrees with shape", make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight), "needs 12"},
      {"offset past the data", make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", eight), "belong to no tensor"},
      {"end past the data", make_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight), "ends at byte 16"},
      {"overlapping tensors",
       make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       "overlaps"},
      {"gap between tensors",
       make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})", eight),
       "belong to no tensor"},
      {"data not fully covered", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight),
       "cover 4 bytes of a 8-byte"},
      {"metadata not an object", make_file(R"({"__metadata__":"x"})"), "'__metadata__' is not a JSON object"},
      {"metadata value not a string", make_file(R"({"__metadata__":{"k":1}})"), "is not a string"},
      {"metadata value an object", make_file(R"({"__metadata__":{"k":{}}})"), "deeper than the format allows"},
      {"comments", make_file(R"({/*c*/})"), "not valid JSON"},
  };
}

}  // namespace

TEST_CASE("Malformed files raise FormatError", "[checkpoint][malformed]") {
  for (const Bad& bad : malformed_files()) {
    INFO(bad.what);
    try {
      open_memory(bad.bytes);
      FAIL_CHECK("accepted");
    } catch (const FormatError& e) {
      CHECK_THAT(e.what(), Contains(bad.message));
    }
    // The same through the file reader.
    TempDir dir;
    write_bytes(dir.path / "bad.safetensors", bad.bytes);
    SwiGLU<double> ffn(2, 2, 1);
    CHECK_THROWS_AS(load_checkpoint(dir / "bad.safetensors", ffn.param_values()), FormatError);
  }
}

TEST_CASE("Edge cases the format allows are accepted", "[checkpoint][malformed]") {
  // Scalars, empty tensors, zero dimensions, unused dtypes, metadata alone.
  const Bytes b = make_file(
      R"({"__metadata__":{},"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
      R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[8,8]},"i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})"
      "   ",
      Bytes(16, 0));
  const auto file = open_memory(b);
  CHECK(file.tensors().size() == 3);
  CHECK(file.matrix<double>("s").size() == 1);
  CHECK(file.at("e").numel() == 0);
  CHECK_THROWS_AS(file.matrix<double>("i"), FormatError);  // not a float type
  CHECK_THROWS_AS(file.at("nope"), FormatError);
  CHECK(open_memory(make_file("{}")).tensors().empty());
}

TEST_CASE("The header length is checked against the cap before any allocation", "[checkpoint][malformed]") {
  SwiGLU<double> ffn(8, 8, 1);
  const Bytes good = serialise(ffn.param_values());
  const std::uint64_t n = st::detail::load_le(good.data(), 8);
  st::Limits tight;
  tight.max_header_bytes = n - 1;
  CHECK_THROWS_WITH(st::Reader::from_memory(good.data(), good.size(), tight), Contains("more than the limit"));
  tight.max_header_bytes = n;
  CHECK_NOTHROW(st::Reader::from_memory(good.data(), good.size(), tight));
}

TEST_CASE("Every truncation of a valid file is rejected", "[checkpoint][malformed]") {
  SwiGLU<double> ffn(3, 2, 1);
  SaveOptions o;
  o.metadata = {{"k", "v"}};
  const Bytes good = serialise(ffn.param_values(), o);
  REQUIRE_NOTHROW(open_memory(good));
  for (std::size_t len = 0; len < good.size(); ++len) {
    INFO("length " << len);
    CHECK_THROWS_AS(st::Reader::from_memory(good.data(), len), FormatError);
  }
  // A file that shrinks after it was opened is caught when the data are read.
  TempDir dir;
  const std::string path = dir / "shrinks.safetensors";
  write_bytes(path, good);
  const st::Reader file(path);
  fs::resize_file(path, good.size() - 4);
  SwiGLU<double> other(3, 2, 2);
  CHECK_THROWS_WITH(load_checkpoint(file, other.param_values()), Contains("ended early"));
}

TEST_CASE("Random corruptions only ever raise library errors", "[checkpoint][malformed]") {
  SwiGLU<double> ffn(3, 2, 1);
  SaveOptions o;
  o.metadata = {{"format", "pt"}};
  o.dtype = st::DType::BF16;
  const Bytes good = serialise(ffn.param_values(), o);
  std::mt19937_64 gen(2024);
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    Bytes b = good;
    const int edits = 1 + int(gen() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = gen() % b.size();
      switch (gen() % 4) {
        case 0: b[at] = std::uint8_t(gen()); break;                                  // overwrite
        case 1: b[at] ^= std::uint8_t(1u << (gen() % 8)); break;                      // bit flip
        case 2: b.insert(b.begin() + std::ptrdiff_t(at), std::uint8_t(gen())); break;  // insert
        default: b.erase(b.begin() + std::ptrdiff_t(at)); break;                     // delete
      }
    }
    try {
      fuzz::exercise(b.data(), b.size());
      ++accepted;
    } catch (const Error&) {
      ++rejected;
    }  // anything else propagates and fails the test
  }
  INFO(accepted << " accepted, " << rejected << " rejected");
  CHECK(accepted > 0);  // data-only flips stay valid files
  CHECK(rejected > 0);
}

TEST_CASE("The fuzz corpus and regression inputs replay safely", "[checkpoint][fuzz]") {
  const std::size_t files = fuzz::for_each_committed_input(
      fs::path(__FILE__).parent_path(), {"fuzz/corpus", "fuzz/regressions"}, [](const fs::path& path, const std::string& bytes) {
        INFO(path.string());
        try {
          fuzz::exercise(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
        } catch (const Error&) {
        }
      });
  CHECK(files >= 10);
}
