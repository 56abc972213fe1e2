#pragma once
/// \file progress.hpp
/// Training progress: one line rewritten in place on a terminal, or a plain
/// line every tenth of the run when the output is a file or a pipe (CI logs).

#include <chrono>
#include <cstdio>
#include <string>

#include <unistd.h>

namespace apex::demo {

/// "1m05s", "42s".
inline std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const long s = long(seconds + 0.5);
  char buf[32];
  if (s >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%lds", s);
  return buf;
}

class ProgressBar {
 public:
  /// `total` steps; `tty` chooses in-place updates (default: whether stdout is a terminal).
  explicit ProgressBar(long total, std::string label = "train", int tty = -1)
      : total_(total), label_(std::move(label)), tty_(tty < 0 ? isatty(STDOUT_FILENO) == 1 : tty == 1),
        start_(std::chrono::steady_clock::now()) {}

  /// Reports that `done` steps are complete, with the latest loss (bits per
  /// character) and the number of tokens processed so far.
  void update(long done, double loss_bpc, double tokens) {
    const double elapsed = seconds();
    const double rate = elapsed > 0 ? tokens / elapsed : 0;
    const double eta = done > 0 ? elapsed * double(total_ - done) / double(done) : -1;
    if (tty_) {
      // Redraw at most ~10 times a second: printing is not free.
      if (done < total_ && elapsed - last_draw_ < 0.1) return;
      last_draw_ = elapsed;
      constexpr int kWidth = 28;
      const int filled = int(double(kWidth) * double(done) / double(total_));
      std::string bar(std::size_t(filled), '#');
      bar.resize(kWidth, '.');
      std::printf("\r%s [%s] %ld/%ld  loss %.3f bpc  %.1fk tok/s  ETA %s   ", label_.c_str(), bar.c_str(), done,
                  total_, loss_bpc, rate / 1000, format_duration(eta).c_str());
      if (done >= total_) std::printf("\n");
      std::fflush(stdout);
    } else {
      const long every = total_ >= 10 ? total_ / 10 : 1;
      if (done % every != 0 && done != total_) return;
      std::printf("%s step %ld/%ld  loss %.3f bpc  %.1fk tok/s  elapsed %s  ETA %s\n", label_.c_str(), done, total_,
                  loss_bpc, rate / 1000, format_duration(elapsed).c_str(), format_duration(eta).c_str());
      std::fflush(stdout);
    }
  }

  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  long total_;
  std::string label_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  double last_draw_ = -1;
};

}  // namespace apex::demo
