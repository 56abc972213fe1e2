#pragma once
/// \file inference.hpp
/// The inference layers on packed float or bf16 weights (docs/inference.md):
/// PackedMoE, PackedSwiGLU, the packed FFN sublayer, and the memory-fit check
/// they use. Their checkpoint loaders are in inference/packed_load.hpp and
/// the quantized checkpoint save in inference/packed_save.hpp (both the
/// `apex::checkpoint` target, which needs nlohmann_json: not included here,
/// so that the layers need only Eigen).

#include "core/memory_budget.hpp"
#include "inference/common.hpp"
#include "inference/packed_clamped.hpp"
#include "inference/packed_expert_kind.hpp"
#include "inference/packed_kappa.hpp"
#include "inference/packed_moe.hpp"
#include "inference/packed_runner.hpp"
#include "inference/packed_sublayer.hpp"
#include "inference/packed_swiglu.hpp"
