#pragma once
/// \file inference/files/gguf/load.hpp
/// MoE layers straight from a llama.cpp GGUF model file
/// (docs/model_files.md#moe-layers-from-gguf-files):
///
///     apex::gguf::File file = apex::gguf::File::open("Qwen3-30B-A3B-Q4_K_M.gguf");
///     auto moe = apex::load_gguf_moe(file, 7);            // PackedMoE in the file's types
///     auto sub = apex::load_gguf_sublayer(file, 7);       // with blk.7.ffn_norm
///     auto ref = apex::load_gguf_moe_float<float>(file, 7);  // MoEFFN, dequantized
///     auto oss = apex::load_gguf_moe<float, ClampedSwiGLU<float>>(gpt_oss_file, 7);
///     auto oss_ref = apex::load_gguf_moe_float<float, ClampedSwiGLU<float>>(gpt_oss_file, 7);  // GptOssMoE
///
/// The expert type is a template parameter (SwiGLU by default); its kind
/// (inference/engine/expert_kind.hpp) must be the architecture's
/// (io/gguf_architectures.hpp `experts`: gpt-oss's are ClampedSwiGLU), else
/// ConfigError naming both. A kind's float parts
/// (gpt-oss's `ffn_{gate,up,down}_exps.bias`) and the router's logit bias
/// (`ffn_gate_inp.bias`) are decoded to float, α and L come from the row.
///
/// The architecture (io/gguf_architectures.hpp) gives the layer's keys,
/// tensors and routing; every check (inference/files/gguf/check.hpp) runs on
/// metadata and tensor infos before the first weight is touched, and a
/// loader returns a new layer, so a rejected load changes nothing the caller
/// holds. The experts' bytes are moved from the mapping into packed panels
/// of the file's types without re-quantization; a block whose values would
/// not be finite (an fp16 scale that is Inf or NaN, an MXFP4 exponent whose
/// largest code overflows float) is a ValueError naming the expert, matrix,
/// row and block as it moves (docs/quantized_formats.md#scale-range). The
/// router, selection bias, shared gate and norm are decoded to float,
/// whatever their type, by the table entry of the type (decode_rows), which
/// refuses such a block the same way, naming the tensor, row and block. A
/// router weight or bias with NaN or Inf is a ValueError (the float layer
/// rejects the logits it would give).
///
/// The MoE pipeline knows nothing of GGUF: these loaders only assemble a
/// PackedMoE / MoEFFN from parts.

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../../../core/errors.hpp"
#include "../../../core/state_names.hpp"
#include "../../../layers/ffn_sublayer.hpp"
#include "../../../moe/moe_ffn.hpp"
#include "check.hpp"
#include "../../engine/packed_moe.hpp"
#include "../../engine/packed_sublayer.hpp"

namespace apex {

namespace detail::gguf_moe {

/// The first byte of tensor t in the file (the mapping).
inline const std::byte* bytes_of(const gguf::File& file, const Tensor& t) {
  return reinterpret_cast<const std::byte*>(file.data(*t.info));
}

/// `rows` rows × `cols` of tensor t as floats (rows × cols, row-major),
/// starting at row `row0` of its flattened rows. ValueError naming `where`,
/// the tensor, row and block for a block whose values would not be finite
/// (decode_rows).
inline Matrix<float> decode(const std::string& where, const gguf::File& file, const Tensor& t, Index row0, Index rows,
                            Index cols) {
  Matrix<float> m(rows, cols);
  const std::size_t row_bytes = std::size_t(t.info->nbytes / t.info->rows());
  decode_rows(t.info->type, bytes_of(file, t) + std::size_t(row0) * row_bytes, rows, cols, m.data(),
              where + ": tensor '" + t.info->name + "'", row0);
  return m;
}

/// The router weight (E × d) and selection bias (1 × E); ValueError for NaN or Inf.
inline std::pair<Matrix<float>, RowVector<float>> router_and_bias(const std::string& where, const gguf::File& file,
                                                                  const Plan& p) {
  const MoEConfig& c = p.config;
  Matrix<float> router = decode(where, file, p.router, 0, c.n_experts, c.d_model);
  RowVector<float> bias = RowVector<float>::Zero(c.n_experts);
  if (p.bias.info) bias = decode(where, file, p.bias, 0, 1, c.n_experts);
  for (const auto& [name, ok] : {std::pair<const char*, bool>{gguf::tensor_names::kRouter, router.allFinite()},
                                 {gguf::tensor_names::kProbsBias, bias.allFinite()}})
    if (!ok)
      throw ValueError(where + ": tensor '" + gguf::block_tensor(p.layer, name) +
                       "' contains NaN or Inf (the float layer rejects the router logits it would give)");
  return {std::move(router), std::move(bias)};
}

/// ValueError naming tensor t unless its decoded rows m are finite.
inline void check_finite_tensor(const std::string& where, const Tensor& t, const Matrix<float>& m, const char* why) {
  if (!m.allFinite()) throw ValueError(where + ": tensor '" + t.info->name + "' contains NaN or Inf (" + why + ")");
}

/// The router's logit bias b_r (1 × E): `ffn_gate_inp.bias`, or empty
/// without architecture.router_bias. ValueError for NaN or Inf.
inline RowVector<float> logit_bias(const std::string& where, const gguf::File& file, const Plan& p) {
  if (!p.router_bias.info) return {};
  RowVector<float> b = decode(where, file, p.router_bias, 0, 1, p.config.n_experts);
  check_finite_tensor(where, p.router_bias, b, "the float layer rejects the router logits it would give");
  return b;
}

/// Expert e's float parts (1 × cols each, the plan's order). ValueError for NaN or Inf.
inline std::vector<RowVector<float>> extra_rows(const std::string& where, const gguf::File& file, const Plan& p, Index e) {
  std::vector<RowVector<float>> rows;
  for (const Tensor& t : p.extras) {
    const Index cols = Index(t.info->ne[0]);
    rows.push_back(decode(where, file, t, e, 1, cols));
    check_finite_tensor(where, t, rows.back(), "an expert's bias must be finite");
  }
  return rows;
}

/// The rows of one tensor that hold one parameter: rows row0 … row0 + rows − 1
/// of its flattened rows (cols weights each), decoded as rows × cols.
struct Slice {
  const Tensor* tensor = nullptr;
  Index row0 = 0, rows = 0, cols = 0;
  /// Its bytes in the tensor's data: [offset, offset + bytes).
  std::size_t offset() const { return std::size_t(row0) * row_bytes(); }
  std::size_t bytes() const { return std::size_t(rows) * row_bytes(); }
  std::size_t row_bytes() const { return std::size_t(tensor->info->nbytes / tensor->info->rows()); }
};

/// Where MoEFFN's parameter `name` (core/state_names.hpp) lies in the file:
/// routed expert e is the contiguous slice e of each 3-D tensor (ggml ne
/// [d, f, E]: rows e·f … of gate and up, e·d … of down), the one shared
/// expert the 2-D tensors. ConfigError for a name the block has no tensor
/// for (a κ expert's gates, a second shared expert), naming it.
inline Slice slice_of(const std::string& where, const Plan& p, const std::string& name) {
  namespace sn = state_names;
  const MoEConfig& c = p.config;
  const Index d = c.d_model, f = c.d_ffn, fs = c.shared_ffn();
  if (name == sn::kRouter) return {&p.router, 0, c.n_experts, d};
  if (name == sn::kRouterBias && p.router_bias.info) return {&p.router_bias, 0, 1, c.n_experts};
  if (name == sn::kSharedGate && c.shared_expert_gate) return {&p.shared_gate, 0, 1, d};
  const auto projection = [&](const std::string& w, const Tensor& g, const Tensor& u, const Tensor& dn, Index e,
                              Index width) -> Slice {
    if (w == sn::kGate) return {&g, e * width, width, d};
    if (w == sn::kUp) return {&u, e * width, width, d};
    if (w == sn::kDown) return {&dn, e * d, d, width};
    for (std::size_t i = 0; &g == &p.gate && i < p.extras.size(); ++i)  // a routed expert's float parts: row e
      if (w == p.extra_names[i]) return {&p.extras[i], e, 1, Index(p.extras[i].info->ne[0])};
    return {};
  };
  Slice s;
  if (name.rfind(sn::kRoutedPrefix, 0) == 0) {
    const std::size_t dot = name.find('.', std::strlen(sn::kRoutedPrefix));
    const std::string id = name.substr(std::strlen(sn::kRoutedPrefix), dot - std::strlen(sn::kRoutedPrefix));
    const bool digits = !id.empty() && id.size() < 12 && id.find_first_not_of("0123456789") == std::string::npos;
    const Index e = digits ? Index(std::stoll(id)) : -1;
    if (dot != std::string::npos && e >= 0 && e < c.n_experts)
      s = projection(name.substr(dot + 1), p.gate, p.up, p.down, e, f);
  } else if (c.n_shared > 0 && name.rfind(sn::shared_expert(0), 0) == 0) {
    s = projection(name.substr(sn::shared_expert(0).size()), p.shared_gate_w, p.shared_up, p.shared_down, 0, fs);
  }
  if (!s.tensor)
    throw ConfigError(where + ": the layer's parameter '" + name + "' has no tensor in a GGUF block (which holds a "
                      "router and its bias, the architecture's experts, one shared expert and its gate)");
  return s;
}

/// Slice s decoded to float (s.rows × s.cols).
inline Matrix<float> decode(const std::string& where, const gguf::File& file, const Slice& s) {
  return decode(where, file, *s.tensor, s.row0, s.rows, s.cols);
}

/// Rows r0 … r0 + n − 1 of tensor t in file form: a pointer into the mapping.
inline const std::byte* file_rows(const gguf::File& file, const Tensor& t, Index r0) {
  const std::size_t row_bytes = std::size_t(t.info->nbytes / t.info->rows());
  return bytes_of(file, t) + std::size_t(r0) * row_bytes;
}

/// Expert `e` (d × width) of a gate/up/down triple (3-D; the 2-D shared
/// one is e = 0), its rows moved into the panels as they are.
inline packed::PackedExpert expert(const gguf::File& file, const Tensor& g, const Tensor& u, const Tensor& dn, Index e,
                                   Index d, Index width) {
  return packed::PackedExpert::from_file_rows(d, width, {g.dtype, dn.dtype}, file_rows(file, g, e * width),
                                              file_rows(file, u, e * width), file_rows(file, dn, e * d));
}

}  // namespace detail::gguf_moe

/// The MoE layer of block `layer` of `file` as a PackedMoE in the file's
/// types (layer.types()): see the file comment. `Storage` is only the layer's
/// default type for from(); the experts keep the file's. `Expert` is the
/// architecture's expert type (ConfigError otherwise).
template <class Storage = float, class Expert = SwiGLU<float>>
PackedMoE<Storage, Expert> load_gguf_moe(const gguf::File& file, Index layer) {
  namespace g = detail::gguf_moe;
  using Layer = PackedMoE<Storage, Expert>;
  const std::string where = "load_gguf_moe(" + file.description() + ", block " + std::to_string(layer) + ")";
  const g::Plan p = g::plan<Expert>(where, file, layer, false);
  const MoEConfig& c = p.config;
  auto [router, bias] = g::router_and_bias(where, file, p);
  const RowVector<float> logit_bias = g::logit_bias(where, file, p);
  std::vector<packed::PackedExpert> experts, shared;
  std::vector<typename Layer::Extra> extras;
  experts.reserve(std::size_t(c.n_experts));
  for (Index e = 0; e < c.n_experts; ++e) {
    experts.push_back(detail::inference::for_expert(where, "expert", e, [&] {  // a block beyond the format's range
      return g::expert(file, p.gate, p.up, p.down, e, c.d_model, c.d_ffn);
    }));
    if constexpr (Layer::kHasExtra)
      extras.push_back(Layer::Kind::make_extra(g::extra_rows(where, file, p, e), Layer::Kind::Gguf::options(*p.arch)));
  }
  if (c.n_shared > 0)
    shared.push_back(detail::inference::for_expert(where, "shared expert", 0, [&] {
      return g::expert(file, p.shared_gate_w, p.shared_up, p.shared_down, 0, c.d_model, c.shared_ffn());
    }));
  Matrix<float> shared_gate;  // 1 × d, or empty
  if (c.shared_expert_gate) shared_gate = g::decode(where, file, p.shared_gate, 0, 1, c.d_model);
  Layer out(c, router, bias, std::move(experts), std::move(extras), std::move(shared), std::move(shared_gate));
  if (c.router_bias) out.set_logit_bias(logit_bias);
  return out;
}

/// The same block as a float MoEFFN<T, Expert>: every weight decoded to
/// float (a quantized file's through ggml's dequantizers), then converted
/// to T; a kind's options (gpt-oss's α and L) from the architecture row.
/// A block whose values would not be finite is a ValueError naming the
/// tensor, row and block, as load_gguf_moe refuses it.
template <class T = float, class Expert = SwiGLU<T>>
MoEFFN<T, Expert> load_gguf_moe_float(const gguf::File& file, Index layer) {
  namespace g = detail::gguf_moe;
  const std::string where = "load_gguf_moe_float(" + file.description() + ", block " + std::to_string(layer) + ")";
  const g::Plan p = g::plan<Expert>(where, file, layer, false);
  const MoEConfig& c = p.config;
  auto [router, bias] = g::router_and_bias(where, file, p);
  const RowVector<float> logit_bias = g::logit_bias(where, file, p);
  for (Index e = 0; e < c.n_experts && !p.extras.empty(); ++e) (void)g::extra_rows(where, file, p, e);  // finite
  MoEFFN<T, Expert> out(c);
  ExpertKind<Expert>::Gguf::configure(out, *p.arch);
  out.balancer().set_bias(bias.cast<T>());
  for (auto& q : out.param_values()) {  // by name: the expert-parallel loader (mpi/gguf_checkpoint.hpp) reads the same slices
    const Matrix<float> m = q.name == state_names::kRouter       ? router
                            : q.name == state_names::kRouterBias ? Matrix<float>(logit_bias)
                                                                 : g::decode(where, file, g::slice_of(where, p, q.name));
    q.value() = m.cast<T>();
  }
  return out;
}

/// The FFN sublayer of block `layer`: RMSNorm with the architecture's norm
/// gain (`blk.N.ffn_norm.weight`; gpt-oss: `blk.N.post_attention_norm.weight`)
/// and ε `<arch>.attention.layer_norm_rms_epsilon` (FormatError if either is
/// absent), around load_gguf_moe, in inference mode.
template <class Storage = float, class Expert = SwiGLU<float>>
PackedSublayer<PackedMoE<Storage, Expert>> load_gguf_sublayer(const gguf::File& file, Index layer) {
  namespace g = detail::gguf_moe;
  const std::string where = "load_gguf_sublayer(" + file.description() + ", block " + std::to_string(layer) + ")";
  const g::Plan p = g::plan<Expert>(where, file, layer, true);
  RMSNorm<float> norm(p.config.d_model, p.rms_eps);
  norm.gain() = g::decode(where, file, p.norm, 0, 1, p.config.d_model);
  PackedSublayer<PackedMoE<Storage, Expert>> out(p.config.d_model, load_gguf_moe<Storage, Expert>(file, layer));
  out.norm() = std::move(norm);
  out.set_mode(SublayerMode::inference);
  return out;
}

}  // namespace apex
