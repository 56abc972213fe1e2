// Timed driver for ExpertParallelMoE (Google Benchmark does not fit MPI:
// every rank must run the same iterations). Each rank brings `--tokens`
// tokens (weak scaling); the driver reports, over `--reps` repetitions after
// one warm-up, the median of each phase (routing, exchange, expert compute,
// combine, replicated-gradient sum), the slowest rank's, for forward and for
// forward+backward, and the bytes each rank sent to other ranks per token.
// The baseline in the same binary is data parallelism: every rank holds all
// experts (MoEFFN) and runs its own tokens; for training it must then sum
// every expert's gradient across ranks (timed as MPI_Allreduce).
//
//     mpiexec -n 2 bench_expert_parallel --preset small --tokens 512 --reps 7
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>
#include <apex/ffn/mpi/fixed_order_sum.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace apex;
using T = float;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// The slowest rank's value (collective).
double slowest(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

struct Row {
  std::vector<double> route, exchange, experts, combine, reduce, total, bytes;
  void add(const mpi::PhaseTimes& t, double seconds) {
    route.push_back(t.route);
    exchange.push_back(t.exchange);
    experts.push_back(t.experts);
    combine.push_back(t.combine);
    reduce.push_back(t.reduce);
    total.push_back(seconds);
    bytes.push_back(t.bytes_sent);
  }
};

/// The command line: `--preset NAME --tokens N --reps R --experts E --label L`.
struct Args {
  std::string preset = "small";
  Index tokens = 512, reps = 7;
  Index n_experts = -1;  ///< > 0: overrides the preset's expert count
  const char* label = "";
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--preset")) a.preset = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tokens")) a.tokens = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) a.reps = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--experts")) a.n_experts = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--label")) a.label = argv[i + 1];
  }
  return a;
}

/// Per repetition: the expert-parallel layer's forward and forward+backward
/// phases, and the data-parallel baseline's forward, whole step and the
/// gradient allreduce within it.
struct Timings {
  Row fwd, step;
  std::vector<double> dp_fwd, dp_step, dp_allreduce;
};

/// One repetition of the expert-parallel layer: forward, then forward and
/// backward, each after a barrier; recorded when `keep` (not the warm-up).
void time_ep(mpi::ExpertParallelMoE<T>& ep, const Matrix<T>& x, const Matrix<T>& dy, bool keep, Timings& t) {
  typename mpi::ExpertParallelMoE<T>::Cache c;
  ep.reset_phase_times();
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  ep.forward(x, &c);
  double t1 = MPI_Wtime();
  if (keep) t.fwd.add(ep.phase_times(), t1 - t0);
  ep.reset_phase_times();
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = MPI_Wtime();
  ep.forward(x, &c);
  ep.backward(dy, c);
  t1 = MPI_Wtime();
  if (keep) t.step.add(ep.phase_times(), t1 - t0);
}

/// One repetition of the data-parallel baseline: forward, backward, and the
/// allreduce of every expert's gradient (`grads`) that training would need.
void time_dp(MoEFFN<T>& dp, const Matrix<T>& x, const Matrix<T>& dy, std::vector<T>& grads, bool keep, Timings& t) {
  typename MoEFFN<T>::Cache dc;
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  dp.forward(x, &dc);
  const double t1 = MPI_Wtime();
  dp.backward(dy, dc);
  const double t2 = MPI_Wtime();
  MPI_Allreduce(MPI_IN_PLACE, grads.data(), int(grads.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  const double t3 = MPI_Wtime();
  if (keep) {
    t.dp_fwd.push_back(t1 - t0);
    t.dp_step.push_back(t3 - t0);
    t.dp_allreduce.push_back(t3 - t2);
  }
}

/// Prints one phase row: the slowest rank's median of each phase (collective).
void report_row(const char* what, const Row& row, const Args& a, int rank, int size) {
  const double ms = 1e3;
  const double total = slowest(median(row.total)), route = slowest(median(row.route)),
               exch = slowest(median(row.exchange)), exp = slowest(median(row.experts)),
               comb = slowest(median(row.combine)), red = slowest(median(row.reduce));
  const double bytes = slowest(median(row.bytes)) / double(a.tokens);
  if (rank == 0)
    std::printf("%-12s P=%d %-14s tokens/rank=%-6ld total %8.2f ms | route %7.2f exchange %7.2f experts %8.2f "
                "combine %7.2f grad-sum %6.2f ms | sent %8.0f B/token\n",
                what, size, a.label, long(a.tokens), total * ms, route * ms, exch * ms, exp * ms, comb * ms, red * ms,
                bytes);
}

/// The exchange alone: one forward's rows (N·K rows of d, split evenly
/// over the ranks) through alltoallv after a barrier, so no rank waits
/// for another's compute. Gives the transport's bandwidth for the model.
void bench_exchange(const mpi::Communicator& comm, const MoEConfig& cfg, const Args& a, int rank, int size) {
  const Index rows = a.tokens * cfg.n_active, per = rows / size;
  std::vector<Index> counts(static_cast<std::size_t>(size), per * cfg.d_model);
  std::vector<T> out(static_cast<std::size_t>(rows * cfg.d_model), T(1)), in(out.size());
  std::vector<double> raw;
  for (Index r = 0; r <= a.reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    mpi::alltoallv(comm, out.data(), counts, in.data(), counts);
    if (r > 0) raw.push_back(MPI_Wtime() - t0);
  }
  const double t = slowest(median(raw));
  const double sent = double(per * cfg.d_model) * sizeof(T) * double(size - 1);
  if (rank == 0)
    std::printf("%-12s P=%d %-14s one alltoallv of %.2f MB sent per rank: %7.3f ms, %6.2f GB/s per rank\n",
                "exchange", size, a.label, sent / 1e6, t * 1e3, t > 0 ? sent / t / 1e9 : 0.0);
}

/// The replicated gradients' sum alone: fixed rank order against
/// MPI_Allreduce on the same buffer (router + shared experts).
void bench_grad_sum(const mpi::Communicator& comm, mpi::ExpertParallelMoE<T>& ep, const Args& a, int rank, int size) {
  Index n = 0;
  for (const auto& p : ep.replicated_params()) n += p.size();
  std::vector<T> x(static_cast<std::size_t>(n), T(1)), y(x);
  std::vector<double> fixed, any;
  for (Index r = 0; r <= a.reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    mpi::fixed_order_sum(comm, x.data(), n);
    const double t1 = MPI_Wtime();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t2 = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, y.data(), int(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const double t3 = MPI_Wtime();
    if (r > 0) {
      fixed.push_back(t1 - t0);
      any.push_back(t3 - t2);
    }
  }
  const double tf = slowest(median(fixed)), ta = slowest(median(any));
  if (rank == 0)
    std::printf("%-12s P=%d %-14s %.2f MB: fixed_order_sum %7.3f ms, MPI_Allreduce %7.3f ms\n", "grad sum", size,
                a.label, double(n) * sizeof(T) / 1e6, tf * 1e3, ta * 1e3);
}

/// Times both layouts over `a.reps` repetitions after one warm-up and prints
/// every row (all collective).
void run(const MoEConfig& cfg, const Args& a, int rank, int size) {
  mpi::Communicator comm;
  mpi::ExpertParallelMoE<T> ep(cfg, comm, 1);
  MoEFFN<T> dp(cfg, 1);  // data-parallel baseline: all experts on every rank
  Rng rng(100 + std::uint64_t(rank));
  Matrix<T> x(a.tokens, cfg.d_model), dy(a.tokens, cfg.d_model);
  fill_uniform(x, rng, 1.0);
  fill_uniform(dy, rng, 1.0);
  Index expert_scalars = 0;
  for (const auto& p : dp.params()) expert_scalars += p.size();
  std::vector<T> grads(static_cast<std::size_t>(expert_scalars));

  Timings t;
  for (Index r = 0; r <= a.reps; ++r) {  // r = 0: warm-up
    time_ep(ep, x, dy, r > 0, t);
    time_dp(dp, x, dy, grads, r > 0, t);
  }
  if (rank == 0)
    std::printf("# %s preset: d=%ld f=%ld E=%ld K=%ld S=%ld, float, OMP threads/rank=%s\n", a.preset.c_str(),
                long(cfg.d_model), long(cfg.d_ffn), long(cfg.n_experts), long(cfg.n_active), long(cfg.n_shared),
                std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "default");
  report_row("EP forward", t.fwd, a, rank, size);
  report_row("EP fwd+bwd", t.step, a, rank, size);
  bench_exchange(comm, cfg, a, rank, size);
  bench_grad_sum(comm, ep, a, rank, size);
  const double f = slowest(median(t.dp_fwd)), s = slowest(median(t.dp_step)), ar = slowest(median(t.dp_allreduce));
  if (rank == 0)
    std::printf("%-12s P=%d %-14s tokens/rank=%-6ld forward %8.2f ms | fwd+bwd+allreduce %8.2f ms (allreduce of %ld "
                "grads %7.2f ms)\n",
                "DP baseline", size, a.label, long(a.tokens), f * 1e3, s * 1e3, long(expert_scalars), ar * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const Args a = parse_args(argc, argv);
  MoEConfig cfg = ModelPreset::by_name(a.preset).moe();
  if (a.n_experts > 0) cfg.n_experts = a.n_experts;
  run(cfg, a, rank, size);
  MPI_Finalize();
  return 0;
}
