// Malformed GGUF files (io/gguf.hpp): each is a FormatError whose message
// names the problem — never a crash, a hang or an allocation sized by a
// count the file cannot back. The files are written field by field
// (support/gguf_bytes.hpp), independently of gguf::Writer.
#include <apex/ffn/io/gguf.hpp>

#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gguf_bytes.hpp"
#include "temp_dir.hpp"

using namespace apex;
using test::gguf_file;
using test::GgufBytes;
using test::kv_str;
using test::kv_u32;
using test::tensor_info;

namespace {

std::string rejection(const std::string& bytes, const gguf::Limits& limits = {}) {
  try {
    gguf::File::from_memory(bytes.data(), bytes.size(), limits);
  } catch (const FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a FormatError: ") + e.what();
  }
  return "accepted";
}

// A file with the architecture key and one f32 [2] tensor "a" whose info
// is `info` (data: 8 bytes at 0, then 64 bytes of slack).
std::string with_info(const std::string& info, std::uint64_t n_tensors = 1) {
  return gguf_file(n_tensors, 1, kv_str("general.architecture", "x"), info, std::string(72, '\x11'));
}
// A file whose only pair is `kv`.
std::string with_kv(const std::string& kv) { return gguf_file(0, 1, kv, "", ""); }

}  // namespace

TEST_CASE("gguf the small hand-written file is valid", "[gguf]") {
  const std::string b = test::small_gguf();
  REQUIRE(b.size() == 226);
  const auto f = test::open_bytes(b);
  CHECK(f.data_offset() == 160);
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.tensors()[1].offset == 32);
  CHECK(f.tensors()[1].nbytes == 34);
  CHECK(f.data(f.tensors()[1])[0] == static_cast<unsigned char>(32 * 7 + 1));
}

TEST_CASE("gguf a file truncated at any byte is a FormatError", "[gguf]") {
  const std::string b = test::small_gguf();
  for (std::size_t n = 0; n < b.size(); ++n) {
    INFO("truncated to " << n << " bytes");
    const std::string got = rejection(b.substr(0, n));
    CHECK(got.rfind("gguf: memory buffer: ", 0) == 0);
  }
}

TEST_CASE("gguf magic, version and byte order are checked", "[gguf]") {
  std::string b = test::small_gguf();
  b[3] = 'G';
  CHECK(rejection(b) == "gguf: memory buffer: magic is 'GGUG', expected 'GGUF'");
  const auto version = [](std::uint32_t v) { return gguf_file(0, 0, "", "", "", 32, v); };
  CHECK(rejection(version(1)) ==
        "gguf: memory buffer: GGUF version 1 (32-bit counts) is not supported; convert the file to version 3");
  CHECK(rejection(version(4)) == "gguf: memory buffer: GGUF version 4 is not supported (versions 2 and 3 are)");
  CHECK(rejection(version(0)) == "gguf: memory buffer: GGUF version 0 is not supported (versions 2 and 3 are)");
  CHECK_THAT(rejection(version(0x03000000u)), Catch::Contains("the file is big-endian"));
  CHECK(test::open_bytes(version(2)).version() == 2);
  CHECK(test::open_bytes(version(3)).version() == 3);
}

TEST_CASE("gguf counts the file cannot hold are refused before anything is sized from them", "[gguf]") {
  const std::uint64_t huge = 1ull << 63;
  CHECK_THAT(rejection(gguf_file(0, huge, "", "", "")), Catch::Contains("metadata pairs, above the limit"));
  CHECK_THAT(rejection(gguf_file(huge, 0, "", "", "")), Catch::Contains("tensors, above the limit"));
  gguf::Limits open;
  open.max_kv = open.max_tensors = UINT64_MAX;
  CHECK_THAT(rejection(gguf_file(0, huge, "", "", ""), open), Catch::Contains("cannot fit in the"));
  CHECK_THAT(rejection(gguf_file(UINT64_MAX, 0, "", "", ""), open), Catch::Contains("cannot fit in the"));
  // An array count, a string length.
  CHECK_THAT(rejection(with_kv(GgufBytes().str("k").u32(9).u32(8).u64(huge).b)),
             Catch::Contains("key 'k' is an array of 9223372036854775808 string elements, more than"));
  CHECK_THAT(rejection(with_kv(GgufBytes().str("k").u32(8).u64(1000).raw("abc").b)),
             Catch::Contains("a string value (1000 bytes at offset 45) is past the end of the 64-byte file"));
  CHECK_THAT(rejection(GgufBytes().raw("GGUF").u32(3).u64(0).u64(1).u64(UINT64_MAX).raw("abcdefgh").b),
             Catch::Contains("a metadata key at offset 24 has length 18446744073709551615, above the limit"));
  gguf::Limits small;
  small.max_string_bytes = 4;
  CHECK_THAT(rejection(with_kv(kv_str("k", "hello")), small), Catch::Contains("above the limit of 4"));
  small.max_array_elements = 3;
  const std::string two_arrays = gguf_file(0, 2, GgufBytes().str("a").u32(9).u32(0).u64(2).u8(1).u8(2).b +
                                                     GgufBytes().str("b").u32(9).u32(0).u64(2).u8(1).u8(2).b,
                                           "", "");
  CHECK_THAT(rejection(two_arrays, small), Catch::Contains("key 'b' brings the file's array elements above the limit of 3"));
  CHECK(rejection(two_arrays) == "accepted");
}

TEST_CASE("gguf malformed metadata is a FormatError naming the key", "[gguf]") {
  CHECK_THAT(rejection(with_kv(GgufBytes().str("k").u32(13).u32(0).b)), Catch::Contains("key 'k' has unknown value type 13"));
  CHECK_THAT(rejection(with_kv(GgufBytes().str("k").u32(9).u32(77).u64(0).b)),
             Catch::Contains("key 'k' is an array of unknown value type 77"));
  CHECK_THAT(rejection(with_kv(GgufBytes().str("k").u32(7).u8(2).b)), Catch::Contains("key 'k' has a bool of byte value 2"));
  CHECK_THAT(rejection(with_kv(GgufBytes().str("").u32(4).u32(0).b)), Catch::Contains("metadata key 0 is empty"));
  CHECK_THAT(rejection(gguf_file(0, 2, kv_u32("k", 1) + kv_u32("k", 2), "", "")),
             Catch::Contains("metadata key 'k' appears twice"));
  // Arrays nest up to the limit (4), not beyond.
  const auto nested = [](int depth) {
    GgufBytes g;
    g.str("k").u32(9);
    for (int i = 1; i < depth; ++i) g.u32(9).u64(1);
    g.u32(4).u64(1).u32(5);
    return with_kv(g.b);
  };
  CHECK(rejection(nested(4)) == "accepted");
  CHECK_THAT(rejection(nested(5)), Catch::Contains("key 'k' nests arrays deeper than the limit of 4"));
  CHECK(test::open_bytes(nested(4)).at("k")[0][0][0][0].as<int>() == 5);
}

TEST_CASE("gguf general.alignment must be a u32 power of two", "[gguf]") {
  const auto aligned = [](const std::string& kv) { return gguf_file(0, 1, kv, "", ""); };
  CHECK_THAT(rejection(aligned(kv_u32("general.alignment", 0))), Catch::Contains("alignment 0 is not a power of 2"));
  CHECK_THAT(rejection(aligned(kv_u32("general.alignment", 3))), Catch::Contains("alignment 3 is not a power of 2"));
  CHECK_THAT(rejection(aligned(GgufBytes().str("general.alignment").u32(5).u32(32).b)),
             Catch::Contains("key 'general.alignment' must be u32, is i32"));
  CHECK(test::open_bytes(aligned(kv_u32("general.alignment", 4096))).alignment() == 4096);
  // A power of two beyond the limit (a fuzzer's 2^31: writing the file again would pad by 2 GiB).
  CHECK_THAT(rejection(aligned(kv_u32("general.alignment", 1u << 31))),
             Catch::Contains("alignment 2147483648 exceeds the limit of 1048576 (Limits::max_alignment)"));
}

TEST_CASE("gguf malformed tensor infos are a FormatError naming the tensor", "[gguf]") {
  CHECK(rejection(with_info(tensor_info("a", {2}, 0, 0))) == "accepted");
  CHECK_THAT(rejection(with_info(tensor_info("a", {2}, 4, 0))), Catch::Contains("tensor 'a' has unknown ggml type 4"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {2}, 43, 0))), Catch::Contains("tensor 'a' has unknown ggml type 43"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {1, 1, 1, 1, 2}, 0, 0))),
             Catch::Contains("tensor 'a' has 5 dimensions, at most 4"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {1ull << 63}, 24, 0))),
             Catch::Contains("tensor 'a' [9223372036854775808] has an extent 9223372036854775808 above INT64_MAX"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {1ull << 32, 1ull << 32}, 24, 0))),
             Catch::Contains("tensor 'a' [4294967296, 4294967296] has more than INT64_MAX elements"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {1ull << 61}, 28, 0))), Catch::Contains("size in bytes above 2^64"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {33, 2}, 8, 0))),
             Catch::Contains("tensor 'a' [33, 2] of type q8_0 has rows of 33 elements, not a multiple of its block of 32"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {2}, 0, 0) + tensor_info("a", {2}, 0, 32), 2)),
             Catch::Contains("tensor 'a' appears twice"));
  CHECK_THAT(rejection(with_info(tensor_info("", {2}, 0, 0))), Catch::Contains("tensor 0 has an empty name"));
  CHECK_THAT(rejection(with_info(tensor_info(std::string(64, 'n'), {2}, 0, 0))),
             Catch::Contains("has 64 bytes, above the limit of 63"));
  // An empty tensor (an extent 0) is valid whatever the other extents are.
  const auto f = test::open_bytes(with_info(tensor_info("a", {0, 1ull << 62, 1ull << 62}, 0, 0)));
  CHECK(f.tensors()[0].nbytes == 0);
}

TEST_CASE("gguf tensor offsets must follow in order each padded to the alignment", "[gguf]") {
  const auto two = [](std::uint64_t off_a, std::uint64_t off_b) {
    return with_info(tensor_info("a", {2}, 0, off_a) + tensor_info("b", {2}, 0, off_b), 2);
  };
  CHECK(rejection(two(0, 32)) == "accepted");
  CHECK_THAT(rejection(two(0, 8)), Catch::Contains("tensor 'b' has offset 8, expected 32: it is not a multiple of the alignment"));
  CHECK_THAT(rejection(two(0, 0)), Catch::Contains("tensor 'b' has offset 0, expected 32: it overlaps the tensor before it"));
  CHECK_THAT(rejection(two(0, 64)), Catch::Contains("tensor 'b' has offset 64, expected 32: it leaves a gap"));
  CHECK_THAT(rejection(two(32, 0)), Catch::Contains("tensor 'a' has offset 32, expected 0"));
  CHECK_THAT(rejection(with_info(tensor_info("a", {64}, 0, 0))),
             Catch::Contains("tensor 'a' (256 bytes at data offset 0) extends past the end of the"));
  // The padding after the last tensor need not be there (llama.cpp's mapped loader asks no more).
  std::string b = test::small_gguf();
  CHECK(rejection(b) == "accepted");
  // Padding before the data section past the end of the file.
  CHECK_THAT(rejection(gguf_file(1, 0, "", tensor_info("a", {0}, 0, 0), "").substr(0, 60)),
             Catch::Contains("the data section (aligned to 32) would start past the end of the 60-byte file"));
}

TEST_CASE("gguf paths that are not regular files are refused at once", "[gguf]") {
  test::TempDir dir;
  const std::string fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  // The message names the GGUF reader and the file (the file layer under it
  // is shared with safetensors, whose name it once gave).
  const std::vector<std::pair<std::string, std::string>> cases = {{fifo, "is not a regular file"},
                                                                  {"/dev/zero", "is not a regular file"},
                                                                  {dir.path.string(), "is not a regular file"},
                                                                  {dir / "missing.gguf", "cannot open file"}};
  for (const auto& [path, why] : cases) {
    INFO(path);
    CHECK_THROWS_AS(gguf::File::open(path), FormatError);
    CHECK_THROWS_WITH(gguf::File::open(path), Catch::StartsWith("gguf: ") && Catch::Contains(why) &&
                                                  Catch::Contains("'" + path + "'") && !Catch::Contains("safetensors"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  // So does a save that cannot create its file.
  const std::string unsaved = (dir.path / "no-such-folder" / "x.gguf").string();
  CHECK_THROWS_WITH(gguf::Writer().save(unsaved), Catch::StartsWith("gguf: cannot create a temporary file") &&
                                                      Catch::Contains("'" + unsaved + "'"));
  const std::string empty = dir / "empty.gguf";
  { std::FILE* f = std::fopen(empty.c_str(), "wb"); std::fclose(f); }
  CHECK_THROWS_WITH(gguf::File::open(empty), Catch::Contains("the magic (4 bytes at offset 0) is past the end of the 0-byte file"));
}
