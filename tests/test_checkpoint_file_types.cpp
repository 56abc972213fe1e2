// Checkpoint paths that are no regular file (io/file/posix_file.hpp):
// a FIFO without a writer, and every other kind of file on every read path,
// is a FormatError at once, never a blocked open, with the destination left
// as it was. Each probe runs under a watchdog that releases a blocked reader.
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
using apex::test::snapshot;
using apex::test::unchanged;
using apex::test::TempDir;

namespace {

using Clock = std::chrono::steady_clock;

/// Longest a rejected open may take before the test calls it blocked.
constexpr double kPromptSeconds = 2.0;
/// When the watchdog starts releasing readers blocked in open() of a FIFO.
constexpr double kWatchdogSeconds = 4.0;

/// Runs `call` under a watchdog for the FIFO `fifo`, so that a reader
/// blocked in open() (waiting for a writer that never comes) cannot hang the
/// suite: after kWatchdogSeconds the watchdog opens and closes the write end
/// every 50 ms — non-blocking, so it cannot block itself; ENXIO while no
/// reader waits — which releases the reader (and gives a blocked read EOF).
/// Returns the seconds `call` took; `what` gets its outcome, e.g.
/// "FormatError: safetensors: file '…' is not a regular file".
double run_with_fifo_watchdog(const std::string& fifo, const std::function<void()>& call, std::string& what) {
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    const auto start = Clock::now();
    while (!done) {
      if (std::chrono::duration<double>(Clock::now() - start).count() > kWatchdogSeconds) {
        const int wfd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (wfd >= 0) ::close(wfd);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  const auto start = Clock::now();
  try {
    call();
    what = "returned";
  } catch (const FormatError& e) {
    what = std::string("FormatError: ") + e.what();
  } catch (const std::exception& e) {
    what = std::string("another exception: ") + e.what();
  } catch (...) {
    what = "a non-standard exception";
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  done = true;
  watchdog.join();
  return seconds;
}

}  // namespace

TEST_CASE("Loading from a FIFO raises FormatError at once instead of blocking", "[checkpoint][regression][filetype]") {
  // FileSource (io/file/posix_file.hpp): open(path, O_RDONLY) of a named
  // pipe waits for a writer before fstat can show it is no regular file, so
  // load_checkpoint on a FIFO blocked forever (issue 17, defect 3). Fixed:
  // the path is opened with O_NONBLOCK, which returns at once, and rejected
  // by fstat on that descriptor unless it is a regular file; only then is
  // O_NONBLOCK cleared for the reads.
  TempDir dir;
  const std::string fifo = dir / "pipe.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  SwiGLU<double> ffn(2, 3, 1);
  const auto before = snapshot(ffn.param_values());
  std::string what;
  const double seconds = run_with_fifo_watchdog(fifo, [&] { load_checkpoint(fifo, ffn.param_values()); }, what);
  INFO(what);
  CHECK(seconds < kPromptSeconds);
  CHECK_THAT(what, Contains("FormatError") && Contains("is not a regular file") && Contains("pipe.safetensors"));
  CHECK(unchanged(ffn.param_values(), before));
}

// The class behind defects 3 and 4 of issue 17, swept rather than sampled:
// every path a load opens is proven a regular file before any call that can
// block, and every temporary name a save makes is bounded by the folder's
// name limit.

TEST_CASE("Every read path rejects what is not a regular file without blocking", "[checkpoint][sweep][filetype]") {
  // Each public entry point that takes a path, against each kind of file
  // that is not a regular one. A reader that blocks is released by the
  // FIFO watchdog and fails on time.
  TempDir dir;
  const std::string fifo = dir / "pipe";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string link = dir / "link-to-pipe";
  fs::create_symlink(fifo, link);
  const std::string folder = dir / "folder";
  fs::create_directories(folder);
  const std::string dangling = dir / "dangling";
  fs::create_symlink(dir / "absent", dangling);
  const std::string socket_path = dir / "socket";
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(sock >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(socket_path.size() < sizeof addr.sun_path);
  std::copy(socket_path.begin(), socket_path.end(), addr.sun_path);
  REQUIRE(::bind(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);

  struct Kind {
    const char* what;
    std::string path;
    const char* message;
  };
  const std::vector<Kind> kinds = {
      {"a FIFO", fifo, "is not a regular file"},
      {"a symbolic link to a FIFO", link, "is not a regular file"},
      {"a folder", folder, "is not a regular file"},
      {"a character device", "/dev/null", "is not a regular file"},
      {"a socket", socket_path, "cannot open"},  // open() of a socket fails: ENXIO
      {"a dangling symbolic link", dangling, "cannot open"},
  };
  SwiGLU<double> ffn(2, 3, 1);
  const auto before = snapshot(ffn.param_values());
  LoadOptions lenient;
  lenient.allow_missing = lenient.allow_unexpected = true;
  for (const Kind& k : kinds) {
    const std::vector<std::pair<const char*, std::function<void()>>> entries = {
        {"load_checkpoint(path)", [&] { load_checkpoint(k.path, ffn.param_values()); }},
        {"load_checkpoint(path, lenient)", [&] { load_checkpoint(k.path, ffn.param_values(), lenient); }},
        {"safetensors::Reader(path)", [&] { (void)st::Reader(k.path); }},
        {"safetensors::FileSource(path)", [&] { (void)st::FileSource(k.path); }},
    };
    for (const auto& [entry, call] : entries) {
      INFO(entry << " on " << k.what << " (" << k.path << ")");
      std::string what;
      const double seconds = run_with_fifo_watchdog(fifo, call, what);
      INFO(what);
      CHECK(seconds < kPromptSeconds);
      CHECK_THAT(what, Contains("FormatError") && Contains(k.message) && Contains(k.path));
    }
  }
  CHECK(unchanged(ffn.param_values(), before));
  ::close(sock);

  // Saves never open their target: a FIFO there is replaced by the file,
  // and a FIFO where the folder should be is refused (O_DIRECTORY), both at once.
  std::string what;
  CHECK(run_with_fifo_watchdog(fifo, [&] { save_checkpoint(fifo, ffn.param_values()); }, what) < kPromptSeconds);
  CHECK(what == "returned");
  CHECK(fs::is_regular_file(fifo));
  const std::string other_fifo = dir / "pipe2";
  REQUIRE(::mkfifo(other_fifo.c_str(), 0600) == 0);
  CHECK(run_with_fifo_watchdog(other_fifo, [&] { save_checkpoint(other_fifo + "/x.safetensors", ffn.param_values()); },
                               what) < kPromptSeconds);
  CHECK_THAT(what, Contains("FormatError") && Contains("pipe2"));
}
