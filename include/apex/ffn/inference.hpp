#pragma once
/// \file inference.hpp
/// The inference layers on packed float or bf16 weights (docs/inference.md):
/// PackedMoE, PackedSwiGLU, the packed FFN sublayer, their checkpoint
/// loaders, and the memory-fit check they use.

#include "memory_budget.hpp"
#include "inference/common.hpp"
#include "inference/packed_kappa.hpp"
#include "inference/packed_load.hpp"
#include "inference/packed_moe.hpp"
#include "inference/packed_sublayer.hpp"
#include "inference/packed_swiglu.hpp"
