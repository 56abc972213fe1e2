#pragma once
/// \file inference.hpp
/// The inference layers on packed float or bf16 weights (docs/inference.md):
/// PackedMoE, PackedSwiGLU, the packed FFN sublayer, and the memory-fit check
/// they use. Their checkpoint loaders are in inference/files/checkpoint/load.hpp and
/// the quantized checkpoint save in inference/files/checkpoint/save.hpp (both the
/// `apex::checkpoint` target, which needs nlohmann_json: not included here,
/// so that the layers need only Eigen).

#include "core/memory_budget.hpp"
#include "inference/engine/packed_types.hpp"
#include "inference/engine/expert_kind.hpp"
#include "inference/engine/expert_kinds.hpp"
#include "inference/engine/packed_moe.hpp"
#include "inference/engine/packed_runner.hpp"
#include "inference/engine/packed_sublayer.hpp"
#include "inference/engine/packed_swiglu.hpp"
