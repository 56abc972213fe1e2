/// \file files.cpp
/// Packed experts from a llama.cpp GGUF model file: the routed experts of
/// one block as the library's load_gguf_moe reads them (the file's storage
/// types, the bytes moved into panels without re-quantization, every check
/// on metadata and tensor infos before the first weight is touched), held
/// as the extension's PackedExperts.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>
#include <vector>

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
  if (gate != "silu" && gate != "clamped")
    throw ConfigError("apex_ffn.PackedExperts.from_gguf: unknown gate '" + gate + "'");
  nb::gil_scoped_release release;
  if (gate == "silu") {
    auto moe = load_gguf_moe<float, SwiGLU<float>>(f.file, layer);
    return PackedExperts(GateKind::silu, moe.experts(), {});
  }
  auto moe = load_gguf_moe<float, ClampedSwiGLU<float>>(f.file, layer);
  return PackedExperts(GateKind::clamped, moe.experts(), moe.extras());
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
}

}  // namespace apex::python
