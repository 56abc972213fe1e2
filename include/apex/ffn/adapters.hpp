#pragma once
/// \file adapters.hpp
/// Low-rank adapters (LoRA) trained on frozen layers, packed or float
/// (docs/adapters.md): `LoraMoE<Base>` over `PackedMoE` or `MoEFFN`,
/// `LoraSwiGLU<Base>` over `PackedSwiGLU` or `SwiGLU`, and the merged
/// layers (`merged_float`, `merged_packed`).

#include "adapters/lora_merge.hpp"
#include "adapters/lora_moe.hpp"
#include "adapters/lora_options.hpp"
#include "adapters/lora_swiglu.hpp"
