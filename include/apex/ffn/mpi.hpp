#pragma once
/// \file mpi.hpp
/// Expert parallelism over MPI (target apex::mpi; docs/expert_parallel.md).
/// This umbrella includes the headers under mpi/, one per concept:
///
///     communicator.hpp        Communicator (a duplicated MPI_Comm), error agreement, MpiError
///     alltoallv.hpp           alltoall_counts, alltoallv with int-count chunking
///     fixed_order_sum.hpp     fixed_order_sum, sum_gradients, StepGradientSum (rank-order sums)
///     config_agreement.hpp    fingerprint, agree_on_config
///     expert_shard.hpp        ExpertShard: contiguous, near-equal expert shards
///     exchange_plan.hpp       ExchangePlan (moe/row_exchange.hpp): counts_by_owner, exchange_rows
///     exchange_runner.hpp     the MoE pipeline's runner: rows to the experts' owners and back
///     global_capacity.hpp     global_capacity_drops: the capacity limit on all ranks' batch
///     rank_memory.hpp         a rank's weight bytes, for the memory-fit checks
///     expert_parallel_moe.hpp ExpertParallelMoE<T, Expert>
///     expert_parallel_lora.hpp ExpertParallelLora<Base>: LoRA adapters on frozen experts, sharded
///     kappa_regulariser.hpp   κ-SwiGLU's layer-wide regulariser across ranks
///
/// Sharded checkpoints (mpi/expert_parallel_checkpoint.hpp) and the open
/// families' Hugging Face checkpoints (mpi/family_checkpoint.hpp) also need
/// apex::checkpoint and are not included here; nor is a GGUF model file's
/// MoE block into the layer (mpi/gguf_checkpoint.hpp, load_gguf_moe).

#include "mpi/alltoallv.hpp"
#include "mpi/communicator.hpp"
#include "mpi/config_agreement.hpp"
#include "mpi/exchange_plan.hpp"
#include "mpi/exchange_runner.hpp"
#include "mpi/expert_parallel_lora.hpp"
#include "mpi/expert_parallel_moe.hpp"
#include "mpi/expert_shard.hpp"
#include "mpi/fixed_order_sum.hpp"
#include "mpi/global_capacity.hpp"
#include "mpi/kappa_regulariser.hpp"
#include "mpi/rank_memory.hpp"
