#pragma once
/// \file inference/files/checkpoint/save.hpp
/// Quantized checkpoints: a PackedMoE saved with its expert weights in their
/// storage types, so a model quantized once loads again without its float
/// weights and with the same bits (`save_packed_moe`, `write_packed_moe`),
/// and the format's side of the load that read.hpp runs:
/// the metadata keys, the checks of a file's stored tensors and their read.
///
/// The file (docs/checkpoints.md, "Quantized checkpoints"), under the names
/// load_packed_moe reads (core/state_names.hpp):
///
///     router.weight, expert_bias, experts.{e}.kappa_alpha / kappa_bias,
///     shared_expert_gate.weight                       F32, as the float layer's
///     experts.{e}.w_gate.weight … (a block format)    U8 [rows, row bytes]: each row
///                                                     the ggml blocks of the type
///     … (f32 / bf16)                                  F32 / BF16 [rows, cols]
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
#include "source.hpp"

namespace apex {
namespace detail::inference {

/// The metadata keys of a quantized checkpoint: a U8 tensor's type is under
/// kQuantKey + its name; the version says how to read the rest.
inline constexpr const char* kQuantKey = "apex.quant.";
inline constexpr const char* kQuantVersionKey = "apex.quant.version";
inline constexpr const char* kQuantVersion = "1";

/// Whether a matrix of type `T` is stored as U8 rows with its type in the
/// metadata: every type safetensors has no dtype of its own for here (the
/// block formats, and f16, which the safetensors codec does not convert).
template <packed::Dtype T>
inline constexpr bool kStoredAsBytes = packed::WeightType<T>::kFileDtype == nullptr;

/// The type named `name` (packed::dtype_name's spelling) among those stored
/// as U8; empty for f32, bf16 or an unknown name.
inline std::optional<packed::Dtype> block_dtype_named(const std::string& name) {
#define APEX_PACKED_BLOCK_NAMED(t)                                                                  \
  if (kStoredAsBytes<packed::Dtype::t> && name == packed::WeightType<packed::Dtype::t>::kName) \
    return packed::Dtype::t;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_BLOCK_NAMED)
#undef APEX_PACKED_BLOCK_NAMED
  return std::nullopt;
}

/// "q8_0, q4_0, …": the types stored as U8, for error messages.
inline std::string block_dtype_names() {
  std::string s;
#define APEX_PACKED_BLOCK_NAME(t)                   \
  if (kStoredAsBytes<packed::Dtype::t>) \
    s += std::string(s.empty() ? "" : ", ") + packed::WeightType<packed::Dtype::t>::kName;
  APEX_PACKED_WEIGHT_TYPES(APEX_PACKED_BLOCK_NAME)
#undef APEX_PACKED_BLOCK_NAME
  return s;
}

/// Weights a block of `t` holds (1 for f32 and bf16).
inline Index block_weights(packed::Dtype t) {
  return packed::visit_dtype(t, [](auto tag) { return packed::WeightType<decltype(tag)::value>::kBlockWeights; });
}

/// Bytes of one stored row of k weights of type `t` (k whole blocks): the
/// tensor's row in the file, which for bf16 lacks the panel row's padding
/// to an even k (PanelMatrix::row_bytes).
inline Index stored_row_bytes(packed::Dtype t, Index k) {
  return packed::visit_dtype(t, [&](auto tag) {
    using W = packed::WeightType<decltype(tag)::value>;
    return k / W::kBlockWeights * Index(sizeof(typename W::Block));
  });
}

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
    if (t == packed::Dtype::f32 || t == packed::Dtype::bf16) {
      r.dtype = t == packed::Dtype::f32 ? safetensors::DType::F32 : safetensors::DType::BF16;
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

/// A tensor a packed loader reads: its name in the file and its shape in
/// weights. `role` says which expert matrix it is (kRoutedGateUp …, -1 for
/// the router, bias, κ's and the shared gate); `stored` marks one whose
/// file tensor holds blocks (U8), checked by file_types instead of by
/// check_tensors.
struct Expected {
  std::string name;
  Index rows, cols;
  int role = -1;
  bool stored = false;
};
enum : int { kRoutedGateUp = 0, kRoutedDown = 1, kSharedGateUp = 2, kSharedDown = 3 };

/// FormatError (ConfigError for a width that is not whole blocks) unless
/// the U8 tensor `t` is `w.rows` rows of `type`'s blocks for `w.cols` weights.
inline void check_stored_shape(const std::string& where, const safetensors::TensorInfo& t, const Expected& w,
                               packed::Dtype type) {
  const Index b = block_weights(type);
  if (w.cols % b != 0)
    throw ConfigError(where + ": tensor " + safetensors::quote_name(w.name) + " holds " + packed::dtype_name(type) +
                      " blocks of " + std::to_string(b) + " weights, and the layer's rows of " + std::to_string(w.cols) +
                      " weights are not whole blocks");
  const std::vector<std::uint64_t> want{std::uint64_t(w.rows), std::uint64_t(stored_row_bytes(type, w.cols))};
  if (t.shape != want)
    throw FormatError(where + ": tensor " + safetensors::quote_name(w.name) + " is " + safetensors::shape_string(t.shape) +
                      " in the file; " + std::to_string(w.rows) + " rows of " + std::to_string(w.cols) + " " +
                      packed::dtype_name(type) + " weights are U8 " + safetensors::shape_string(want));
}

/// The experts' types a quantized checkpoint holds (U8 tensors: their
/// metadata type; F32 and F64: f32; BF16: bf16), marking its U8 tensors in
/// `want` as stored; empty for a file that is not one (no version key, no
/// U8 expert matrix), which loads as before. FormatError for a version but
/// "1", a U8 tensor without a block type, a type on a float tensor, and
/// types that differ where the layer needs one (the routed experts' gate/up,
/// their down; the same for the shared experts). Reads no tensor.
inline std::optional<PackedTypes> file_types(const std::string& where, const PackedSource& file,
                                             std::vector<Expected>& want) {
  using safetensors::DType;
  using safetensors::quote_name;
  const std::optional<std::string> version = file.metadata_value(kQuantVersionKey);
  bool quant = version.has_value();
  for (const auto& w : want)
    if (const auto* t = w.role >= 0 ? file.find(w.name) : nullptr) quant = quant || t->dtype == DType::U8;
  if (!quant) return std::nullopt;
  const auto bad_version = [&] {
    return FormatError(where + ": metadata " + quote_name(kQuantVersionKey) + " is " +
                       (!version ? std::string("missing") : quote_name(*version)) +
                       "; quantized checkpoints of version " + kQuantVersion + " load");
  };
  if (version && *version != kQuantVersion) throw bad_version();
  std::optional<packed::Dtype> types[4];
  std::string first[4];
  for (auto& w : want) {
    const auto* t = w.role >= 0 ? file.find(w.name) : nullptr;
    // missing, or of a dtype no loader takes: check_tensors names it
    if (!t || (t->dtype != DType::U8 && !safetensors::is_float_convertible(t->dtype))) continue;
    const std::optional<std::string> key = file.metadata_value(kQuantKey + w.name);
    packed::Dtype type = t->dtype == DType::BF16 ? packed::Dtype::bf16 : packed::Dtype::f32;
    if (t->dtype == DType::U8) {
      if (!key)
        throw FormatError(where + ": tensor " + quote_name(w.name) + " is U8 but the metadata names no type for it (" +
                          quote_name(kQuantKey + w.name) + ")");
      const auto b = block_dtype_named(*key);
      if (!b)
        throw FormatError(where + ": tensor " + quote_name(w.name) + " has type " + quote_name(*key) +
                          " in the metadata, which is not a type stored as U8 (" + block_dtype_names() + ")");
      type = *b;
      w.stored = true;
      check_stored_shape(where, *t, w, type);
    } else if (key) {
      throw FormatError(where + ": tensor " + quote_name(w.name) + " is " + safetensors::dtype_name(t->dtype) +
                        " but the metadata gives it the type " + quote_name(*key) + "; blocks are stored as U8");
    }
    if (!types[w.role]) {
      types[w.role] = type;
      first[w.role] = w.name;
    } else if (*types[w.role] != type) {
      throw FormatError(where + ": tensor " + quote_name(w.name) + " is " + packed::dtype_name(type) + " but " +
                        quote_name(first[w.role]) + " is " + packed::dtype_name(*types[w.role]) +
                        ": a layer's routed (and its shared) experts share one type per matrix, gate and up alike");
    }
  }
  if (!version) throw bad_version();
  const auto pick = [&](int role, packed::Dtype fallback) { return types[role] ? *types[role] : fallback; };
  const packed::ExpertDtypes routed{pick(kRoutedGateUp, packed::Dtype::f32), pick(kRoutedDown, packed::Dtype::f32)};
  // Without shared experts the layer takes the routed types for them (PackedShared).
  return PackedTypes(routed, {pick(kSharedGateUp, routed.gate_up), pick(kSharedDown, routed.down)});
}

/// Bytes of a panel's file row of k weights of `t` (PanelMatrix::row_bytes:
/// bf16 pads k to even).
inline Index panel_row_bytes(packed::Dtype t, Index k) {
  return stored_row_bytes(t, t == packed::Dtype::bf16 ? k + k % 2 : k);
}

/// The matrix `name` (rows × k weights of type t) as panel file rows in
/// `out`: a U8 tensor's blocks as they are, a float tensor's values in f32
/// or bf16 (BF16 → bf16 is exact), bf16 rows padded with a zero weight as
/// packing pads them. `staging` holds the floats of a float tensor.
inline void read_stored(const PackedSource& file, const std::string& name, packed::Dtype t, Index rows,
                        Index k, std::vector<std::byte>& out, std::vector<float>& staging) {
  const safetensors::TensorInfo& info = file.at(name);
  const Index row = panel_row_bytes(t, k);
  out.assign(std::size_t(rows * row), std::byte{0});
  if (info.dtype == safetensors::DType::U8) return file.read_bytes(name, out.data());  // stored row = panel row
  staging.resize(std::size_t(rows * k));
  file.read(name, staging.data());
  for (Index r = 0; r < rows; ++r)
    for (Index j = 0; j < k; ++j) {
      const float x = staging[std::size_t(r * k + j)];
      if (t == packed::Dtype::f32) {
        std::memcpy(out.data() + r * row + 4 * j, &x, 4);
      } else {
        const packed::bf16 v = packed::to_bf16(x);
        std::memcpy(out.data() + r * row + 2 * j, &v, 2);
      }
    }
}

/// One expert's panel rows, reused from expert to expert.
struct StoredStaging {
  std::vector<std::byte> gate, up, down;
  std::vector<float> floats;
};

/// The expert at `p` of a quantized checkpoint (file_types checked it):
/// its matrices' bits moved into the panels, not re-quantized.
template <class Name>
packed::PackedExpert read_stored_expert(const PackedSource& file, const Name& name, const std::string& p,
                                        Index d, Index f, packed::ExpertDtypes t, StoredStaging& s) {
  read_stored(file, name(p + state_names::kGate), t.gate_up, f, d, s.gate, s.floats);
  read_stored(file, name(p + state_names::kUp), t.gate_up, f, d, s.up, s.floats);
  read_stored(file, name(p + state_names::kDown), t.down, d, f, s.down, s.floats);
  return packed::PackedExpert::from_file_rows(d, f, t, s.gate.data(), s.up.data(), s.down.data());
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
