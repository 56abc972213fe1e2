#pragma once
/// \file adapters/peft_files.hpp
/// A model's LoRA adapters (adapters/lora_moe.hpp) saved as, and loaded
/// from, the folder peft's `save_pretrained` writes: `adapter_config.json`
/// and `adapter_model.safetensors`, so that
/// `PeftModel.from_pretrained(base_model, folder)` loads what the library
/// saved and computes the same outputs, and the library loads what peft
/// saved (docs/adapters.md#peft-adapter-files):
///
///     const apex::PeftNames names = apex::PeftNames::of(apex::MoEFamily::Qwen3MoE);
///     apex::save_peft_adapter("adapter", {apex::peft_layer(0, l0), apex::peft_layer(1, l1)}, {names});
///
///     apex::LoraMoE<Base> layer(std::move(base), apex::peft_lora_options("adapter", 3, names), rng);
///     apex::load_peft_adapter("adapter", 3, layer, {names});
///
///     adapters/peft_config.hpp   adapter_config.json: what is read, what is refused
///     adapters/peft_names.hpp    the tensor names and layouts per family (PeftNames)
///     adapters/peft_tensors.hpp  peft's stacked layout to and from the per-expert (A, B)
///     adapters/peft_layers.hpp   which layers fit which layout
///     adapters/peft_save.hpp     save_peft_adapter, peft_tensors
///     adapters/peft_load.hpp     load_peft_adapter, peft_lora_options

#include "peft_config.hpp"
#include "peft_load.hpp"
#include "peft_names.hpp"
#include "peft_save.hpp"
