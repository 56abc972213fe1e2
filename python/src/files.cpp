/// \file files.cpp
/// Packed experts from a llama.cpp GGUF model file: the routed experts of
/// one block as the library's load_gguf_moe reads them (the file's storage
/// types, the bytes moved into panels without re-quantization, every check
/// on metadata and tensor infos before the first weight is touched), held
/// as the extension's PackedExperts; and peft's adapter_config.json read
/// and written by the library's rules (adapters/peft_config.hpp: what plain
/// LoRA is, what is refused).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include <apex/ffn/adapters/peft_config.hpp>
#include <apex/ffn/inference/files/gguf/load.hpp>
#include <apex/ffn/io/gguf.hpp>

#include "packed_experts.hpp"
#include "runtime.hpp"

namespace nb = nanobind;

namespace apex::python {
namespace {

/// A GGUF file mapped read-only (the mapping lives as long as this object).
struct GgufFile {
  gguf::File file;
};

/// Block `layer`'s routed experts; `gate` ("silu" or "clamped") is the
/// experts module's kind, which must be the file architecture's.
PackedExperts from_gguf(const GgufFile& f, Index layer, const std::string& gate) {
  const GateKind kind = gate_kind("apex_ffn.PackedExperts.from_gguf", gate);
  nb::gil_scoped_release release;
  if (kind == GateKind::silu) {
    auto moe = load_gguf_moe<float, SwiGLU<float>>(f.file, layer);
    return PackedExperts(GateKind::silu, moe.experts(), {});
  }
  auto moe = load_gguf_moe<float, ClampedSwiGLU<float>>(f.file, layer);
  return PackedExperts(GateKind::clamped, moe.experts(), moe.extras());
}

/// adapter_config.json of an adapter folder (or the file) as a dict; FormatError or ConfigError naming a
/// key the library does not read as plain LoRA (DoRA, biases, patterns...).
nb::dict read_peft_config(const std::string& path) {
  const PeftAdapterConfig c = apex::read_peft_config(path);
  nb::dict d;
  d["r"] = c.rank;
  d["lora_alpha"] = c.alpha;
  d["use_rslora"] = c.rslora;
  d["scale"] = c.scale();
  d["target_parameters"] = c.target_parameters;
  d["target_modules"] = c.target_modules;
  d["target_modules_regex"] = c.target_modules_regex;
  d["base_model_name_or_path"] = c.base_model_name_or_path;
  d["task_type"] = c.task_type;
  return d;
}

std::string peft_config_text(Index r, double alpha, bool rslora, const std::vector<std::string>& target_parameters,
                             const std::string& base_model, const std::string& task_type) {
  PeftAdapterConfig c;
  c.rank = r, c.alpha = alpha, c.rslora = rslora, c.target_parameters = target_parameters;
  c.base_model_name_or_path = base_model, c.task_type = task_type;
  return apex::peft_config_text(c);
}

}  // namespace

void bind_files(nb::module_& m) {
  nb::class_<GgufFile>(m, "GgufFile", "A llama.cpp GGUF model file, mapped read-only")
      .def_static("open", [](const std::string& path) { return GgufFile{gguf::File::open(path)}; }, nb::arg("path"),
                  "Maps and validates `path` (FormatError naming the problem).")
      .def_prop_ro("description", [](const GgufFile& f) { return f.file.description(); })
      .def_prop_ro("size", [](const GgufFile& f) { return f.file.size(); });
  m.def("packed_from_gguf", &from_gguf, nb::arg("file"), nb::arg("layer"), nb::arg("gate"),
        "The routed experts of block `layer` in the file's storage types (load_gguf_moe).");
  m.def("read_peft_config", &read_peft_config, nb::arg("path"),
        "peft's adapter_config.json (a folder or the file) as the library reads it.");
  m.def("peft_config_text", &peft_config_text, nb::arg("r"), nb::arg("lora_alpha"), nb::arg("use_rslora"),
        nb::arg("target_parameters"), nb::arg("base_model_name_or_path"), nb::arg("task_type"),
        "The adapter_config.json the library writes for plain LoRA on these parameters.");
}

}  // namespace apex::python
