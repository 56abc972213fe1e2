// What dump.cpp and dump_mpi.cpp share: one file of raw bytes per array
// (row-major, contiguous) in the output folder, and seeded inputs.
#pragma once

#include <apex/ffn.hpp>

#include <cstdint>
#include <fstream>
#include <string>

namespace dump {

inline std::string g_dir;  ///< the output folder
inline int g_files = 0;    ///< files written so far

inline void put(const std::string& name, const void* p, std::size_t bytes) {
  std::ofstream f(g_dir + "/" + name + ".bin", std::ios::binary);
  f.write(static_cast<const char*>(p), std::streamsize(bytes));
  ++g_files;
}

template <class M>
void put_m(const std::string& name, const M& m) {
  using S = typename M::Scalar;
  const apex::Matrix<S> c = m;  // row-major, contiguous
  put(name, c.data(), std::size_t(c.size()) * sizeof(S));
}

/// r × c uniform in [−scale, scale], drawn in double from `seed`, then cast.
template <class T>
apex::Matrix<T> rnd(apex::Index r, apex::Index c, std::uint64_t seed, double scale = 1.0) {
  apex::Rng rng(seed);
  apex::Matrix<double> m(r, c);
  apex::fill_uniform(m, rng, scale);
  return m.cast<T>();
}

}  // namespace dump
