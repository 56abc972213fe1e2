// Atomic saves (io/file/atomic_save.hpp): a save replaces the previous
// checkpoint whole, a failed save (injected at every step) keeps it and
// leaves no temporary file, an unwritable or missing folder is a FormatError,
// and the temporary file's name fits the folder's limit whenever the
// target's does (names of up to 255 bytes).
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
#include "sweep.hpp"
#include "temp_dir.hpp"

using namespace apex;
namespace fs = std::filesystem;
namespace st = apex::safetensors;
using Catch::Matchers::Contains;
using apex::test::Bytes;
using apex::test::read_bytes;
using apex::test::TempDir;

TEST_CASE("Saving replaces the previous checkpoint atomically", "[checkpoint][atomic]") {
  TempDir dir;
  const std::string path = dir / "ckpt.safetensors";
  SwiGLU<double> a(4, 3, 1), b(4, 3, 2), c(4, 3, 3);
  save_checkpoint(path, a.param_values());
  save_checkpoint(path, b.param_values());
  load_checkpoint(path, c.param_values());
  CHECK(c.w_down() == b.w_down());
  CHECK(dir.entries() == 1);
  // A bare file name saves into the working directory's folder ".".
  const auto cwd = fs::current_path();
  fs::current_path(dir.path);
  save_checkpoint("bare.safetensors", a.param_values());
  fs::current_path(cwd);
  CHECK(fs::exists(dir / "bare.safetensors"));
}

TEST_CASE("A failed save keeps the previous checkpoint and leaves no temporary file", "[checkpoint][atomic]") {
  TempDir dir;
  const std::string path = dir / "ckpt.safetensors";
  SwiGLU<double> old_layer(4, 3, 1);
  save_checkpoint(path, old_layer.param_values());
  const Bytes old_bytes = read_bytes(path);

  SECTION("the writer throws midway") {
    struct Boom : std::runtime_error {
      using std::runtime_error::runtime_error;
    };
    CHECK_THROWS_AS(st::write_file_atomic(path,
                                          [](st::ByteSink& out) {
                                            const Bytes half(100, 0xAB);
                                            out.write(half.data(), half.size());
                                            throw Boom("simulated failure");
                                          }),
                    Boom);
  }
  SECTION("the file system refuses the data (file size limit)") {
    // RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk fails with
    // ENOSPC — even for root. SIGXFSZ would kill the process: ignore it.
    SwiGLU<double> big(64, 128, 2);  // ~200 KB of F64
    struct rlimit saved {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = saved;
    small.rlim_cur = 16 * 1024;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    bool threw = false;
    std::string what;
    try {
      save_checkpoint(path, big.param_values());
    } catch (const FormatError& e) {
      threw = true;
      what = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    CHECK(threw);
    CHECK_THAT(what, Contains("cannot write"));
  }
  SECTION("the rename fails (the target became a folder)") {
    const std::string folder = dir / "taken";
    fs::create_directories(fs::path(folder) / "inside");
    CHECK_THROWS_AS(save_checkpoint(folder, old_layer.param_values()), FormatError);
    CHECK(fs::is_directory(folder));
    fs::remove_all(folder);
  }
  CHECK(read_bytes(path) == old_bytes);
  CHECK(dir.entries() == 1);
}

TEST_CASE("Saving into an unwritable or missing folder raises FormatError", "[checkpoint][atomic]") {
  SwiGLU<double> ffn(2, 2, 1);
  CHECK_THROWS_WITH(save_checkpoint("/nonexistent-apex-folder/x.safetensors", ffn.param_values()),
                    Contains("cannot create a temporary file"));
  // /proc/self exists and takes no new files, whoever we are (root included).
  CHECK_THROWS_AS(save_checkpoint("/proc/self/x.safetensors", ffn.param_values()), FormatError);
  CHECK_THROWS_AS(save_checkpoint("", ffn.param_values()), FormatError);
  if (::geteuid() != 0) {  // permission bits do not stop root
    TempDir dir;
    fs::permissions(dir.path, fs::perms::owner_read | fs::perms::owner_exec);
    CHECK_THROWS_AS(save_checkpoint(dir / "x.safetensors", ffn.param_values()), FormatError);
    fs::permissions(dir.path, fs::perms::owner_all);
    CHECK(dir.entries() == 0);
  }
}

TEST_CASE("A file name of up to 255 bytes saves and loads, leaving no temporary file",
          "[checkpoint][regression][atomic]") {
  // write_file_atomic (io/file/atomic_save.hpp) named its temporary file
  // "." + name + ".tmp.<pid>.<n>", some 20 bytes longer than the target, so
  // a valid 250-byte name failed with FormatError ("File name too long")
  // (issue 17, defect 4). Fixed: where the temporary name would not fit the
  // folder's limit, its copy of the target name is shortened; pid and
  // counter keep it unique. A name beyond the limit is rejected up front.
  TempDir dir;
  const long name_max = ::pathconf(dir.path.c_str(), _PC_NAME_MAX);
  REQUIRE(name_max == 255);  // Linux file systems; the sizes below assume it
  SwiGLU<double> saved(3, 4, 1);
  for (std::size_t len : {std::size_t(250), std::size_t(255)}) {
    INFO(len << "-byte name");
    const std::string path = dir / (std::string(len - 12, 'c') + ".safetensors");
    SwiGLU<double> loaded(3, 4, 2);
    save_checkpoint(path, saved.param_values());
    save_checkpoint(path, saved.param_values());  // and over an existing file
    load_checkpoint(path, loaded.param_values());
    CHECK(loaded.w_down() == saved.w_down());
    CHECK(dir.entries() == 1);
    fs::remove(path);
  }
  CHECK_THROWS_WITH(save_checkpoint(dir / std::string(256, 'c'), saved.param_values()),
                    Contains("256 bytes") && Contains("255"));
  CHECK(dir.entries() == 0);
}

TEST_CASE("Every temporary name fits the folder's limit whenever the target's name does", "[checkpoint][sweep][atomic]") {
  // temp_name is the one place a temporary name is made. Swept over name
  // limits (POSIX's minimum 14, eCryptfs' 143, Linux's 255), every target
  // length up to the limit, one- to four-byte UTF-8 characters, and the
  // widest pid and counter: the name fits, is hidden, ends in the unique
  // ".tmp.<pid>.<n>", keeps a whole-character prefix of the target, and is
  // exactly ".<name>.tmp.<pid>.<n>" whenever that fits.
  std::vector<std::string> failures;
  for (const std::size_t name_max : {std::size_t(14), std::size_t(143), std::size_t(255)})
    for (const std::string ch : {"a", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80"})  // a é € 😀
      for (const unsigned long long pid : {1ull, 4194304ull})
        for (const unsigned long long n : {0ull, 4294967295ull}) {
          const std::string suffix = ".tmp." + std::to_string(pid) + "." + std::to_string(n);
          if (1 + suffix.size() > name_max) continue;  // no name could fit
          std::string name;
          while (name.size() + ch.size() <= name_max) {
            name += ch;
            const std::string tmp = io::detail::temp_name(name, pid, n, name_max);
            const std::string kept = tmp.substr(1, tmp.size() - 1 - suffix.size());
            const bool fits_whole = 1 + name.size() + suffix.size() <= name_max;
            const bool ok = tmp.size() <= name_max && tmp.front() == '.' &&
                            tmp.compare(tmp.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                            name.compare(0, kept.size(), kept) == 0 && kept.size() % ch.size() == 0 &&
                            (!fits_whole || kept == name);
            if (!ok) failures.push_back(std::to_string(name_max) + ": " + name + " -> " + tmp);
          }
        }
  INFO((failures.empty() ? std::string() : failures.front()));
  CHECK(failures.empty());

  // And through the file system: saves at lengths up to the limit land,
  // load back, and leave only the checkpoint behind.
  TempDir dir;
  REQUIRE(::pathconf(dir.path.c_str(), _PC_NAME_MAX) == 255);
  SwiGLU<double> saved(2, 3, 1);
  for (std::size_t len : {1, 100, 200, 220, 230, 235, 236, 237, 238, 239, 240, 245, 250, 254, 255}) {
    INFO(len << "-byte name");
    const std::string path = dir / std::string(len, 'k');
    SwiGLU<double> loaded(2, 3, 2);
    save_checkpoint(path, saved.param_values());
    load_checkpoint(path, loaded.param_values());
    CHECK(loaded.w_down() == saved.w_down());
    CHECK(dir.entries() == 1);
    fs::remove(path);
  }
}
