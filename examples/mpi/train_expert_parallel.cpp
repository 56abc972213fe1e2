// Trains a skip-gated MoE sublayer with expert parallelism for a few steps
// and checks every step against the same sublayer trained in one process on
// the concatenated batch.
//
//     mpiexec -n 2 ./train_expert_parallel            (one machine)
//     mpiexec -n 16 --hostfile hosts ./train_expert_parallel  (a cluster)
//
// Each rank owns half of the routed experts and brings its own tokens. The
// loss is the mean squared error over every rank's tokens, so each rank's
// ∂L/∂y is (y − target) / N_total. After backward:
//   - the MoE's router and shared experts hold gradients already summed over
//     ranks (in rank order, so every rank has the same bits);
//   - the sublayer's norm and skip gate are plain data-parallel replicas:
//     mpi::sum_gradients adds their gradients across ranks;
//   - each rank's experts have the gradients of every token routed to them.
// Plain SGD then keeps every replica identical on every rank.
#include <apex/ffn/layers/ffn_sublayer.hpp>
#include <apex/ffn/moe/moe_ffn.hpp>
#include <apex/ffn/mpi/expert_parallel_moe.hpp>
#include <apex/ffn/mpi/fixed_order_sum.hpp>
#include <apex/ffn/layers/skip_gate.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

using namespace apex;
using T = double;
using EP = mpi::ExpertParallelMoE<T>;

namespace {

/// The same pseudo-random batch on every rank: `total` tokens of width d.
Matrix<T> global_batch(Index total, Index d, std::uint64_t seed) {
  Rng rng(seed);
  Matrix<T> m(total, d);
  fill_uniform(m, rng, 1.0);
  return m;
}

template <class Layer>
void sgd(Layer& layer, T lr) {
  for (const auto& p : layer.params()) p.value() -= lr * p.grad();
}

/// A small layer: 8 experts (or one per rank beyond 8), 2 active, 1 shared.
MoEConfig layer_config(int ranks) {
  MoEConfig cfg;
  cfg.d_model = 32;
  cfg.d_ffn = 64;
  cfg.n_experts = std::max(8, ranks);
  cfg.n_active = 2;
  cfg.n_shared = 1;
  cfg.balancer_alpha = 1e-2;
  return cfg;
}

SkipGateConfig gate_config(const MoEConfig& cfg) {
  SkipGateConfig gate;
  gate.d_model = cfg.d_model;
  gate.hidden = 8;
  gate.threshold = 0.9;  // about half the tokens skip the FFN at initialisation
  return gate;
}

/// Rank r brings 24 + 8r tokens, rows [begin, begin + mine) of the whole
/// batch of `total`; every rank can rebuild the whole batch.
struct TokenSlice {
  Index total = 0, begin = 0, mine = 0;
};

TokenSlice token_slice(int rank, int ranks) {
  TokenSlice s;
  for (int r = 0; r < ranks; ++r) {
    if (r == rank) s.begin = s.total;
    s.total += 24 + 8 * r;
  }
  s.mine = 24 + 8 * rank;
  return s;
}

/// One SGD step of `layer` on rows `x` → `target` of a batch of `total`
/// tokens; returns the loss of the whole batch. With `comm`, the rows are
/// this rank's: its share of ∂L/∂y is (y − target) / total, and the loss and
/// the `data_parallel` replicas' gradients are summed over the ranks.
template <class Layer>
double train_step(Layer& layer, const Matrix<T>& x, const Matrix<T>& target, Index total, T lr,
                  const mpi::Communicator* comm, ParamList<T>* data_parallel, typename Layer::Cache& cache) {
  layer.zero_grad();
  const Matrix<T> y = layer.forward(x, &cache);
  double loss = 0.5 * (y - target).squaredNorm() / double(total);
  if (comm) MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, comm->get());
  layer.backward((y - target) / T(total), cache);
  if (comm) mpi::sum_gradients(*comm, *data_parallel);
  layer.observe(cache);
  sgd(layer, lr);
  layer.ffn().balancer().update();
  return loss;
}

/// The largest relative difference, over every rank, of a parameter this
/// rank holds from the reference's of the same name.
template <class Layer, class Reference>
double max_relative_difference(Layer& layer, Reference& reference, const mpi::Communicator& comm) {
  std::map<std::string, Param<T>> ref;
  for (const auto& p : reference.params()) ref.emplace(p.name, p);
  double diff = 0;
  for (const auto& p : layer.params()) {
    const auto r = ref.at(p.name).value();
    diff = std::max(diff, double((p.value() - r).cwiseAbs().maxCoeff() / std::max<T>(r.cwiseAbs().maxCoeff(), 1e-300)));
  }
  MPI_Allreduce(MPI_IN_PLACE, &diff, 1, MPI_DOUBLE, MPI_MAX, comm.get());
  return diff;
}

/// Five steps expert-parallel against one process; the worst relative
/// parameter difference (1 if a loss or a balancer bias differs).
double compare_training(const mpi::Communicator& comm) {
  const int rank = comm.rank();
  const MoEConfig cfg = layer_config(comm.size());
  const SkipGateConfig gate = gate_config(cfg);
  const TokenSlice slice = token_slice(rank, comm.size());
  const Index total = slice.total;

  FFNSublayer<T, EP> layer(cfg.d_model, EP(cfg, comm, 1), SkipGate<T>(gate, 2));
  FFNSublayer<T, MoEFFN<T>> reference(cfg.d_model, MoEFFN<T>(cfg, 1), SkipGate<T>(gate, 2));
  ParamList<T> data_parallel;  // the sublayer's own replicas: norm and gate
  for (const auto& p : layer.params())
    if (p.name.rfind("ffn.", 0) != 0) data_parallel.push_back(p);

  const T lr = 0.05;
  double worst = 0;
  for (int step = 0; step < 5; ++step) {
    const Matrix<T> x_all = global_batch(total, cfg.d_model, 100 + std::uint64_t(step));
    const Matrix<T> target_all = global_batch(total, cfg.d_model, 200 + std::uint64_t(step));
    const Matrix<T> x = x_all.middleRows(slice.begin, slice.mine);
    const Matrix<T> target = target_all.middleRows(slice.begin, slice.mine);

    typename FFNSublayer<T, EP>::Cache cache;  // expert parallel: this rank's tokens
    const double loss = train_step(layer, x, target, total, lr, &comm, &data_parallel, cache);
    typename FFNSublayer<T, MoEFFN<T>>::Cache rc;  // one process: the concatenated batch
    const double loss_ref = train_step(reference, x_all, target_all, total, lr, nullptr, nullptr, rc);

    const double diff = max_relative_difference(layer, reference, comm);
    const bool same_bias = layer.ffn().balancer().bias() == reference.ffn().balancer().bias();
    worst = std::max(worst, diff);
    if (rank == 0)
      std::printf("step %d  loss %.9f (one process %.9f)  skipped %.0f%% on rank 0  max relative parameter "
                  "difference %.2e  bias %s\n",
                  step, loss, loss_ref, 100.0 * cache.skip_rate(), diff, same_bias ? "identical" : "DIFFERS");
    if (!same_bias || std::abs(loss - loss_ref) > 1e-12 * std::abs(loss_ref)) worst = 1;
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int status = 0;
  try {
    mpi::Communicator comm;
    const double worst = compare_training(comm);
    if (comm.rank() == 0)
      std::printf("%d ranks: %s\n", comm.size(), worst <= 1e-10 ? "matches the single-process layer" : "MISMATCH");
    status = worst <= 1e-10 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_expert_parallel: %s\n", e.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
