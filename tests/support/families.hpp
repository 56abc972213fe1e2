#pragma once
// The family fixtures tests/data/family_*.safetensors (tools/moe_families.py):
// a small MoE block of each open MoE family under its Hugging Face names,
// with a reference input `test.x`, output `test.y` and expert choice
// `test.experts` from the family's PyTorch code, in F64.

#include <apex/ffn/moe/families.hpp>
#include <apex/ffn/moe/config.hpp>
#include <apex/ffn/io/safetensors.hpp>
#include <apex/ffn/core/types.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <string>

namespace apex::test {

inline constexpr MoEFamily kFamilies[] = {MoEFamily::DeepSeekV3, MoEFamily::Mixtral, MoEFamily::Qwen2MoE,
                                          MoEFamily::Qwen3MoE, MoEFamily::OLMoE};

/// The small layer of a family fixture (its "config" metadata).
inline MoEConfig fixture_config(MoEFamily f, const safetensors::Reader& file) {
  const auto j = nlohmann::json::parse(file.metadata().at("config"));
  MoEConfig c;
  c.routing = family_routing(f);
  c.d_model = j["d"].get<Index>();
  c.d_ffn = j["f"].get<Index>();
  c.n_experts = j["E"].get<Index>();
  c.n_active = j["K"].get<Index>();
  c.d_shared_ffn = j["shared"].get<Index>();
  c.n_shared = c.d_shared_ffn > 0 ? 1 : 0;
  c.shared_expert_gate = f == MoEFamily::Qwen2MoE;
  if (j.contains("groups")) {
    c.routing.n_groups = j["groups"].get<Index>();
    c.routing.topk_group = j["topk_group"].get<Index>();
  }
  return c;
}

/// The 2-D tensor `name` of rows × cols (REQUIRE), in double.
inline Matrix<double> read_tensor(const safetensors::Reader& file, const std::string& name, Index rows, Index cols) {
  Matrix<double> m(rows, cols);
  const auto& t = file.at(name);
  REQUIRE(t.shape.size() == 2);
  REQUIRE(Index(t.shape[0]) == rows);
  REQUIRE(Index(t.shape[1]) == cols);
  file.read(t, m.data());
  return m;
}

}  // namespace apex::test
