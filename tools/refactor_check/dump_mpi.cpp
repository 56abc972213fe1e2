// The expert-parallel counterpart of dump.cpp: ExpertParallelMoE (float and
// double, SwiGLU and κ-SwiGLU experts) forward and backward, every rank
// writing y, dx and its gradients into OUT_DIR as <case>.P<p>.r<rank>.*.bin.
// Includes only the umbrella headers, so it builds against old and new
// revisions alike; run under `mpirun -np P` for each P to compare
// (compare.sh with MPI=1 runs P = 2 and 3).

#include <apex/ffn.hpp>
#include <apex/ffn/mpi.hpp>

#include <cstdio>
#include <fstream>
#include <string>

#include "dump_files.hpp"

namespace {

using namespace apex;

using dump::g_dir;
using dump::put_m;
using dump::rnd;

template <class T>
void perturb(SwiGLU<T>&, std::uint64_t) {}
template <class T>
void perturb(KappaSwiGLU<T>& e, std::uint64_t seed) {
  e.kappa_alpha() = rnd<T>(1, e.d_ffn(), seed, 2.0);
  e.kappa_bias() = rnd<T>(1, e.d_ffn(), seed + 1, 1.0);
}

template <class T, class Expert>
void run(const std::string& name, int rank, int size) {
  MoEConfig c;
  c.d_model = 19;
  c.d_ffn = 37;
  c.n_experts = 6;
  c.n_active = 2;
  c.n_shared = 1;
  c.shared_expert_gate = true;
  mpi::ExpertParallelMoE<T, Expert> m(c, mpi::Communicator(MPI_COMM_WORLD), 11);
  std::uint64_t seed = 500;
  for (auto& e : m.experts()) perturb(e, seed += 2);
  const Matrix<T> x = rnd<T>(23 + rank, c.d_model, 70 + std::uint64_t(rank));
  typename mpi::ExpertParallelMoE<T, Expert>::Cache cache;
  const Matrix<T> y = m.forward(x, &cache);
  const std::string tag = name + ".P" + std::to_string(size) + ".r" + std::to_string(rank);
  put_m(tag + ".y", y);
  put_m(tag + ".dx", m.backward(rnd<T>(y.rows(), y.cols(), 90 + std::uint64_t(rank)), cache));
  for (const auto& p : m.params()) put_m(tag + ".grad." + p.name, p.grad());
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2) {
    if (rank == 0) std::fprintf(stderr, "usage: mpirun -np P %s OUT_DIR\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  g_dir = argv[1];
  run<double, SwiGLU<double>>("ep.swiglu.double", rank, size);
  run<float, SwiGLU<float>>("ep.swiglu.float", rank, size);
  run<double, KappaSwiGLU<double>>("ep.kappa.double", rank, size);
  run<float, KappaSwiGLU<float>>("ep.kappa.float", rank, size);
  MPI_Finalize();
  return 0;
}
