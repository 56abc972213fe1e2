#pragma once
/// \file report.hpp
/// Writing the demo's results: a CSV log with one row per training step and
/// a small Markdown builder for `report.md` (which is also printed).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace apex::demo {

/// printf-style formatting of one value into a std::string.
template <class... Args>
std::string fmt(const char* format, Args... args) {
  const int n = std::snprintf(nullptr, 0, format, args...);
  if (n <= 0) return {};
  std::string s(std::size_t(n) + 1, '\0');
  std::snprintf(s.data(), s.size(), format, args...);
  s.resize(std::size_t(n));
  return s;
}

/// A CSV file with a fixed header; NaN values are written as empty cells.
class CsvLog {
 public:
  CsvLog(const std::string& path, const std::vector<std::string>& columns) : out_(path), columns_(columns.size()) {
    if (!out_) throw std::runtime_error("CsvLog: cannot write '" + path + "'");
    for (std::size_t i = 0; i < columns.size(); ++i) out_ << (i ? "," : "") << columns[i];
    out_ << '\n';
  }
  void row(const std::vector<double>& values) {
    if (values.size() != columns_) throw std::logic_error("CsvLog::row: wrong number of values");
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (i) out_ << ',';
      if (std::isfinite(values[i])) out_ << fmt("%.6g", values[i]);
    }
    out_ << '\n';
  }
  void flush() { out_.flush(); }

 private:
  std::ofstream out_;
  std::size_t columns_;
};

/// Accumulates Markdown text.
class Markdown {
 public:
  Markdown& heading(int level, const std::string& text) {
    s_ << std::string(std::size_t(level), '#') << ' ' << text << "\n\n";
    return *this;
  }
  Markdown& para(const std::string& text) {
    s_ << text << "\n\n";
    return *this;
  }
  Markdown& bullet(const std::string& text) {
    s_ << "- " << text << '\n';
    return *this;
  }
  Markdown& end_list() {
    s_ << '\n';
    return *this;
  }
  Markdown& table(const std::vector<std::string>& header, const std::vector<std::vector<std::string>>& rows) {
    auto line = [&](const std::vector<std::string>& cells) {
      s_ << '|';
      for (const auto& c : cells) s_ << ' ' << c << " |";
      s_ << '\n';
    };
    line(header);
    s_ << '|';
    for (std::size_t i = 0; i < header.size(); ++i) s_ << (i ? " ---: |" : " --- |");
    s_ << '\n';
    for (const auto& r : rows) line(r);
    s_ << '\n';
    return *this;
  }
  Markdown& code(const std::string& text) {
    s_ << "```text\n" << text << (text.empty() || text.back() != '\n' ? "\n" : "") << "```\n\n";
    return *this;
  }
  Markdown& image(const std::string& alt, const std::string& path) {
    s_ << "![" << alt << "](" << path << ")\n\n";
    return *this;
  }
  std::string str() const { return s_.str(); }

 private:
  std::ostringstream s_;
};

/// Mean of `v[first, last)`, NaN when empty.
inline double mean_of(const std::vector<double>& v, std::size_t first = 0, std::size_t last = std::size_t(-1)) {
  last = std::min(last, v.size());
  if (first >= last) return NAN;
  double s = 0;
  for (std::size_t i = first; i < last; ++i) s += v[i];
  return s / double(last - first);
}

/// Trailing moving average over `window` values (shorter at the start).
inline std::vector<double> moving_average(const std::vector<double>& v, std::size_t window) {
  std::vector<double> out(v.size());
  double s = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    s += v[i];
    if (i >= window) s -= v[i - window];
    out[i] = s / double(std::min(i + 1, window));
  }
  return out;
}

}  // namespace apex::demo
