#pragma once
/// \file checkpoint_check.hpp
/// `--checkpoint`: the trained model saved as safetensors — every parameter
/// under its state-dict name plus each MoE balancer's bias — then reloaded
/// into a differently initialised model, whose validation loss must be the
/// same. Needs the library's checkpoint support (APEX_DEMO_HAVE_CHECKPOINT).

#include <apex/ffn/io/checkpoint.hpp>
#include <apex/ffn/core/param.hpp>
#include <apex/ffn/core/types.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "evaluate.hpp"
#include "report.hpp"
#include "text_data.hpp"

namespace apex::demo {

/// Views of every MoE balancer's bias (copied into `buffers`), to save with the parameters.
inline std::vector<Param<float>> balancer_params(CharModel<float>& model, std::vector<Matrix<float>>& buffers) {
  std::vector<Param<float>> out;
  buffers.clear();
  for (auto& layer : model.moe_layers()) buffers.push_back(layer.ffn().balancer().bias());
  Index i = 0;
  for (Index l = 0; l < model.n_layers(); ++l)
    if (model.is_moe(l)) {
      auto& b = buffers[std::size_t(i++)];
      out.push_back({"layers." + std::to_string(l) + ".ffn.balancer.bias", b.data(), b.data(), b.rows(), b.cols()});
    }
  return out;
}

/// Saves `model` (trained `steps` steps from `seed`) to `path`, reloads it into a
/// model built from seed + 77 and compares the two on the first kQuickEvalTokens
/// validation characters; returns the report's sentence on it.
inline std::string save_and_reload_checkpoint(CharModel<float>& model, const std::string& path, const Corpus& corpus,
                                              std::uint64_t seed, long steps, Index pad) {
  const CharModelConfig& cfg = model.config();
  std::vector<Matrix<float>> buffers;
  ParamList<float> all = model.params();
  for (auto& b : balancer_params(model, buffers)) all.push_back(b);
  SaveOptions so;
  so.metadata = {{"vocab", corpus.vocab.chars()}, {"context", std::to_string(cfg.context)},
                 {"preset", cfg.preset.name}, {"seed", std::to_string(seed)}, {"steps", std::to_string(steps)}};
  save_checkpoint(path, all, so);
  CharModel<float> reloaded(cfg, seed + 77);
  std::vector<Matrix<float>> rbuf;
  ParamList<float> rall = reloaded.params();
  const auto rb = balancer_params(reloaded, rbuf);
  for (auto& b : rb) rall.push_back(b);
  load_checkpoint(path, rall);
  for (std::size_t i = 0; i < rbuf.size(); ++i) reloaded.moe_layers()[i].ffn().balancer().set_bias(rbuf[i]);
  const double a = evaluate(model, corpus.val, 0, kQuickEvalTokens, pad).loss;
  const double b = evaluate(reloaded, corpus.val, 0, kQuickEvalTokens, pad).loss;
  return fmt("Saved to `%s` (%.0f KiB, %zu tensors, float32). Reloaded into a freshly initialised model: "
             "validation loss %.6f vs %.6f — %s.",
             path.c_str(), double(std::filesystem::file_size(path)) / 1024.0, all.size(), a, b,
             a == b ? "identical" : "DIFFERENT");
}

}  // namespace apex::demo
