#pragma once
/// \file inference/files/checkpoint/save.hpp
/// Quantized checkpoints: a PackedMoE saved with its expert weights in their
/// storage types, so a model quantized once loads again without its float
/// weights and with the same bits (`save_packed_moe`, `write_packed_moe`).
/// The format's vocabulary and its side of the load: stored.hpp.
///
/// The file (docs/checkpoints.md, "Quantized checkpoints"), under the names
/// load_packed_moe reads (core/state_names.hpp):
///
///     router.weight, expert_bias, experts.{e}.kappa_alpha / kappa_bias,
///     shared_expert_gate.weight                       F32, as the float layer's
///     experts.{e}.w_gate.weight … (a block format)    U8 [rows, row bytes]: each row
///                                                     the ggml blocks of the type
///     … (f32 / bf16)                                  F32 / BF16 [rows, cols]: the
///                                                     entry's kFileDtype
///     __metadata__: apex.quant.version = "1",
///                   apex.quant.<tensor name> = "q4_k" for every U8 tensor
///
/// A U8 tensor's bytes are the rows PackedExpert::file_rows gives: ggml's
/// blocks (GGUF's layout of a row), what ggml's quantizer gives for the float
/// weights the layer was packed from. Needs `apex::checkpoint` (nlohmann_json).

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../../../core/state_names.hpp"
#include "../../../io/safetensors.hpp"
#include "../../../kernels/weight_types.hpp"
#include "../../engine/packed_moe.hpp"
#include "stored.hpp"

namespace apex {
namespace detail::inference {

/// One matrix of an expert in stored form: `which` 0 gate, 1 up, 2 down.
/// Panel rows (file_rows) are cut to the stored row length; the bytes are
/// the host's, and the library's packed formats assume a little-endian host.
inline std::vector<std::byte> stored_matrix(const packed::PackedExpert& e, int which) {
  const Index d = e.d_model(), f = e.d_ffn();
  const packed::PanelMatrix& m = which == 2 ? e.down() : e.gate_up();
  const Index rows = which == 2 ? d : f, panel_row = m.row_bytes(), row = stored_row_bytes(m.dtype(), m.k());
  std::vector<std::byte> gate(std::size_t(f * e.gate_up().row_bytes())), up(gate.size()),
      down(std::size_t(d * e.down().row_bytes()));
  e.file_rows(gate.data(), up.data(), down.data());
  const std::vector<std::byte>& all = which == 0 ? gate : which == 1 ? up : down;
  std::vector<std::byte> out(std::size_t(rows * row));
  for (Index r = 0; r < rows; ++r) std::memcpy(out.data() + r * row, all.data() + r * panel_row, std::size_t(row));
  return out;
}

/// The three tensors of expert `e` under `q` ("experts.3."), each written
/// when its turn comes (one expert's rows in memory at a time), and the
/// metadata type of those in a block format.
inline void add_expert(std::vector<safetensors::RawTensor>& out, safetensors::Metadata& meta, const std::string& q,
                       const packed::PackedExpert& e) {
  const char* names[3] = {state_names::kGate, state_names::kUp, state_names::kDown};
  for (int w = 0; w < 3; ++w) {
    const packed::PanelMatrix& m = w == 2 ? e.down() : e.gate_up();
    const std::uint64_t rows = std::uint64_t(w == 2 ? e.d_model() : e.d_ffn()), k = std::uint64_t(m.k());
    const packed::Dtype t = m.dtype();
    safetensors::RawTensor r{q + names[w], safetensors::DType::U8, {rows, std::uint64_t(stored_row_bytes(t, m.k()))},
                             [&e, w](safetensors::ByteSink& s) {
                               const auto bytes = stored_matrix(e, w);
                               s.write(bytes.data(), bytes.size());
                             }};
    if (const std::optional<safetensors::DType> d = stored_file_dtype(t)) {  // f32, bf16: a float tensor
      r.dtype = *d;
      r.shape = {rows, k};
    } else {
      meta[kQuantKey + r.name] = packed::dtype_name(t);
    }
    out.push_back(std::move(r));
  }
}

/// Every tensor of `layer` in file order (router and its logit bias, bias,
/// routed experts with their kind's float parts, shared experts, shared gate) and the metadata naming the
/// U8 tensors' types.
template <class Layer>
std::vector<safetensors::RawTensor> packed_moe_tensors(const Layer& layer, safetensors::Metadata& meta) {
  using safetensors::DType;
  const MoEConfig& c = layer.config();
  const auto u = [](Index n) { return std::uint64_t(n); };
  std::vector<safetensors::RawTensor> out;
  out.push_back(safetensors::raw_tensor(state_names::kRouter, DType::F32, {u(c.n_experts), u(c.d_model)},
                                        layer.router().weight().data()));
  if (c.router_bias)
    out.push_back(safetensors::raw_tensor(state_names::kRouterBias, DType::F32, {u(c.n_experts)},
                                          layer.router().logit_bias().data()));
  out.push_back(safetensors::raw_tensor("expert_bias", DType::F32, {u(c.n_experts)}, layer.bias().data()));
  using Kind = typename Layer::Kind;
  const auto extra = Kind::extra_tensors(c.d_model, c.d_ffn);
  for (Index e = 0; e < c.n_experts; ++e) {
    const std::string q = state_names::routed_expert(e);
    add_expert(out, meta, q, layer.experts()[std::size_t(e)]);
    if constexpr (Layer::kHasExtra) {
      const auto rows = Kind::extra_rows(layer.extras()[std::size_t(e)]);
      for (std::size_t i = 0; i < extra.size(); ++i)
        out.push_back(safetensors::raw_tensor(q + extra[i].name, DType::F32, {1, u(extra[i].cols)}, rows[i]->data()));
    }
  }
  for (Index s = 0; s < c.n_shared; ++s)
    add_expert(out, meta, state_names::shared_expert(s), layer.shared_experts()[std::size_t(s)]);
  if (c.shared_expert_gate)
    out.push_back(safetensors::raw_tensor(state_names::kSharedGate, DType::F32, {1, u(c.d_model)},
                                          layer.shared_gate_weight().data()));
  meta[kQuantVersionKey] = kQuantVersion;
  return out;
}

}  // namespace detail::inference

/// Serialises `layer` as a quantized checkpoint (see the file comment) to
/// `out`; load_packed_moe reads it back with the same bits. The routing
/// configuration is not stored: load with the layer's MoEConfig.
template <class Storage, class Expert, class Activation>
void write_packed_moe(safetensors::ByteSink& out, const PackedMoE<Storage, Expert, Activation>& layer) {
  safetensors::Metadata meta;
  const auto tensors = detail::inference::packed_moe_tensors(layer, meta);
  safetensors::write_raw(out, tensors, meta);
}

/// Saves `layer` to `path` atomically (safetensors::write_file_atomic): a
/// reader sees the old file or the new one, and a failed save leaves `path`
/// as it was.
template <class Storage, class Expert, class Activation>
void save_packed_moe(const std::string& path, const PackedMoE<Storage, Expert, Activation>& layer) {
  safetensors::write_file_atomic(path, [&](safetensors::ByteSink& out) { write_packed_moe(out, layer); });
}

}  // namespace apex
