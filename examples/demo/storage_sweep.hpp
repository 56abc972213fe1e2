#pragma once
/// \file storage_sweep.hpp
/// The trained model with every FFN sublayer packed in each storage type of
/// the packed engine — f32, bf16 and ggml's block formats q8_0, q4_0, q4_k,
/// q6_k, mxfp4 — each scored on the validation text against the float
/// model. A block format holds whole blocks of the reduction length (d_model
/// for gate/up, d_ffn for down): 32 weights for q8_0, q4_0 and mxfp4, 256 for
/// q4_k and q6_k. Where the model's widths are not whole blocks the packing
/// refuses with a ConfigError, and the sweep records the type as not
/// applicable with that reason instead of failing.

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/types.hpp>
#include <apex/ffn/kernels/dtype.hpp>
#include <apex/ffn/kernels/weight_types.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "char_model.hpp"
#include "evaluate.hpp"
#include "packed_char_model.hpp"
#include "packed_run.hpp"
#include "report.hpp"
#include "run_log.hpp"

namespace apex::demo {

/// One storage type's packed copy, scored.
struct StorageLoss {
  std::string type;         ///< the type's name: "f32", "bf16", "q8_0", …
  bool applicable = false;  ///< false: the widths are not whole blocks of the type
  std::string reason;       ///< why not, when not applicable (the packing's ConfigError)
  EvalResult eval;          ///< when applicable: the scored text, skip gates as learned
  std::size_t ffn_bytes = 0;  ///< packed FFN weights of all sublayers, padding included
  double seconds = 0;         ///< packing and evaluation
};

/// Every storage type's row, in the engine's order (kernels/dtype.hpp).
struct StorageSweep {
  double float_loss = 0;       ///< the float (training-layer) model on the same text
  std::size_t float_bytes = 0;  ///< its FFN weights in float: w_gate, w_up, w_down of every SwiGLU
  std::size_t ffn_weights = 0;  ///< how many FFN weights that is
  std::vector<StorageLoss> rows;
  /// The row of `type`, nullptr if the sweep has none.
  const StorageLoss* find(const std::string& type) const {
    for (const StorageLoss& r : rows)
      if (r.type == type) return &r;
    return nullptr;
  }
};

/// The part of `e.what()` after the "where: " prefix of require_config.
inline std::string config_reason(const ConfigError& e) {
  const std::string what = e.what();
  const auto colon = what.find(": ");
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

/// What the sweep scores: positions `first … first + count − 1` of `text`.
struct SweepText {
  const std::vector<Index>& text;
  Index first = 0;
  Index count = 0;
  Index pad = 0;
  Index chunk_len = 256;
  Index chunks = 4;
};

/// Packs every FFN sublayer of `trained` in `Storage` and scores it on `on`;
/// not applicable when the packing refuses the widths.
template <class Storage>
StorageLoss measure_storage(const CharModel<float>& trained, const SweepText& on, int threads) {
  StorageLoss r;
  r.type = packed::WeightType<packed::dtype_of<Storage>()>::kName;
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<PackedCharModel<Storage>> m;
  try {
    m.emplace(pack_model<Storage>(trained));
  } catch (const ConfigError& e) {
    r.reason = config_reason(e);
    return r;
  }
  r.applicable = true;
  m->set_threads(threads);
  for (auto& s : m->dense_layers()) r.ffn_bytes += s.ffn().bytes();
  for (auto& s : m->moe_layers()) r.ffn_bytes += s.ffn().expert_bytes();
  r.eval = evaluate(*m, on.text, on.first, on.count, on.pad, on.chunk_len, on.chunks);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

/// Float FFN weights of `model`: w_gate, w_up, w_down of every dense FFN and every (routed or shared) expert.
inline std::size_t float_ffn_weights(const CharModel<float>& model) {
  const ModelPreset& p = model.config().preset;
  const std::size_t swiglu = 3 * std::size_t(p.d_model) * std::size_t(p.d_ffn);
  return swiglu * (model.dense_layers().size() + model.moe_layers().size() * std::size_t(p.n_experts + p.n_shared));
}

/// Every storage type of the engine, packed from `trained` and scored on `on`
/// against `float_loss` (the float model on the same text). `reuse`, the
/// demo's --packed copy when it scored the same text, stands in for its own
/// type's row instead of packing and scoring that type twice.
inline StorageSweep run_storage_sweep(const CharModel<float>& trained, const SweepText& on, int threads,
                                      double float_loss, const std::optional<PackedRun>& reuse = std::nullopt) {
  StorageSweep s;
  s.float_loss = float_loss;
  s.ffn_weights = float_ffn_weights(trained);
  s.float_bytes = s.ffn_weights * sizeof(float);
  const auto add = [&](auto tag) {
    using Storage = typename decltype(tag)::type;
    const std::string name = packed::WeightType<packed::dtype_of<Storage>()>::kName;
    if (reuse && (reuse->weights == name || (reuse->weights == "float" && name == "f32"))) {
      StorageLoss r;
      r.type = name;
      r.applicable = true;
      r.eval = reuse->eval;
      r.ffn_bytes = reuse->ffn_bytes;
      r.seconds = reuse->seconds;
      s.rows.push_back(r);
      return;
    }
    s.rows.push_back(measure_storage<Storage>(trained, on, threads));
  };
  add(std::common_type<float>{});
  add(std::common_type<packed::bf16>{});
  add(std::common_type<packed::q8_0>{});
  add(std::common_type<packed::q4_0>{});
  add(std::common_type<packed::q4_k>{});
  add(std::common_type<packed::q6_k>{});
  add(std::common_type<packed::mxfp4>{});
  return s;
}

/// Bits of storage per FFN weight of a row (block scales and padding included).
inline double bits_per_weight(const StorageSweep& s, const StorageLoss& r) {
  return s.ffn_weights ? 8.0 * double(r.ffn_bytes) / double(s.ffn_weights) : 0.0;
}

/// The sweep as plain text lines, for the console.
inline std::string storage_sweep_summary(const StorageSweep& s) {
  std::string out = fmt("validation loss with every FFN sublayer packed, by storage type (float model %.6f nats/char, "
                        "FFN weights %.0f KiB):\n",
                        s.float_loss, double(s.float_bytes) / 1024.0);
  for (const StorageLoss& r : s.rows) {
    if (!r.applicable) {
      out += fmt("  %-6s not applicable: %s\n", r.type.c_str(), r.reason.c_str());
      continue;
    }
    out += fmt("  %-6s %.6f nats/char  (%+.6f vs float)  %7.1f KiB  %5.2f bits/weight\n", r.type.c_str(), r.eval.loss,
               r.eval.loss - s.float_loss, double(r.ffn_bytes) / 1024.0, bits_per_weight(s, r));
  }
  return out;
}

/// The sweep's table and note for report.md.
inline void report_storage_sweep(Markdown& md, const StorageSweep& s) {
  md.heading(3, "FFN weights by storage type");
  std::vector<std::vector<std::string>> rows = {
      {"float (training layers)", fmt("%.0f", double(s.float_bytes) / 1024.0), "32.00", fmt("%.6f", s.float_loss), "—",
       fmt("%.4f", s.float_loss / kLn2)}};
  for (const StorageLoss& r : s.rows) {
    if (!r.applicable) {
      rows.push_back({"`" + r.type + "`", "—", "—", "not applicable: " + r.reason, "—", "—"});
      continue;
    }
    rows.push_back({"`" + r.type + "`", fmt("%.0f", double(r.ffn_bytes) / 1024.0), fmt("%.2f", bits_per_weight(s, r)),
                    fmt("%.6f", r.eval.loss), fmt("%+.6f", r.eval.loss - s.float_loss), fmt("%.4f", r.eval.bpc())});
  }
  md.para("Every FFN sublayer packed in each storage type of the packed engine (`pack_model<Storage>`: routers, "
          "balancing bias, κ, norms and skip gates stay float), scored on the same validation positions. Bytes are "
          "the packed FFN weights of all sublayers (block scales included); bits/weight divides them by the FFN "
          "weight count. The block formats also quantize the activations entering each product (q8_0 blocks of 32 "
          "for q8_0, q4_0 and mxfp4; q8_K blocks of 256 for q4_k and q6_k). A block format needs d_model and d_ffn "
          "in whole blocks (32 weights; 256 for the K-quants).");
  md.table({"FFN storage", "KiB", "bits/weight", "nats/char", "Δ vs float (nats)", "bits/char"}, rows);
}

}  // namespace apex::demo
