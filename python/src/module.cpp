/// \file module.cpp
/// The extension module `apex_ffn._core`: the library's routed experts
/// (float, packed, with adapters) as functions on CPU tensors passed by
/// DLPack, without a link to libtorch — the autograd and torch.library glue
/// is Python (apex_ffn/ops.py). The library's typed errors become Python
/// exceptions of the same names (ShapeError, ConfigError, ValueError and
/// FormatError derive from Python's ValueError).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include <apex/ffn/core/version.hpp>

#include "runtime.hpp"
#include "torch_tensors.hpp"

namespace nb = nanobind;
using namespace apex;

NB_MODULE(_core, m) {
  m.doc() = "apex-ffn's routed experts (float, packed, LoRA) on CPU tensors";
  m.attr("__version__") = std::to_string(APEX_FFN_VERSION_MAJOR) + "." + std::to_string(APEX_FFN_VERSION_MINOR) + "." +
                          std::to_string(APEX_FFN_VERSION_PATCH);

  nb::exception<apex::Error>(m, "Error", PyExc_RuntimeError);
  nb::exception<apex::ShapeError>(m, "ShapeError", PyExc_ValueError);
  nb::exception<apex::ConfigError>(m, "ConfigError", PyExc_ValueError);
  nb::exception<apex::ValueError>(m, "ValueError", PyExc_ValueError);
  nb::exception<apex::FormatError>(m, "FormatError", PyExc_ValueError);

  m.def("isa", [] { return std::string(packed::isa_name(python::current_isa())); },
        "The kernel path the operations run on (scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx_bf16).");
  m.def("best_isa", [] { return std::string(packed::isa_name(python::best_isa())); },
        "The best kernel path this CPU supports.");
  m.def("available_isas", [] {
    std::vector<std::string> out;
    for (packed::Isa i : packed::kAllIsas)
      if (packed::cpu_supports(i)) out.push_back(packed::isa_name(i));
    return out;
  }, "The kernel paths this CPU supports.");
  m.def("set_isa", [](const std::string& name) { python::isa_slot().store(int(python::isa_from_name(name))); },
        nb::arg("name"), "Runs the operations on kernel path `name` (ConfigError if the CPU lacks it).");
  m.def("set_num_threads", [](std::optional<int> n) {
    if (n && *n < 1) throw ConfigError("apex_ffn.set_num_threads: expected a positive int or None, got " + std::to_string(*n));
    python::threads_setting().store(n ? *n : 0);
  }, nb::arg("n").none(), "Runs the operations on `n` threads (None: follow torch.get_num_threads()).");
  m.def("get_num_threads", &python::package_threads, "The threads the operations run on.");
  m.def("_exchange_reads", [](bool on) {
    const bool has = python::TorchRefs::get().exchange != nullptr;
    python::exchange_reads().store(on);
    return has;
  }, nb::arg("on"), "Tests only: PackedExperts.infer reads tensors through torch's DLPack exchange table (on, when "
                    "torch has one) or their attributes (off). Returns whether torch has the table.");
  m.def("openmp", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  }, "Whether the extension was built with OpenMP (threads > 1 need it).");

  python::bind_float_experts(m);
  python::bind_packed_experts(m);
  python::bind_files(m);
  python::bind_pack_once(m);
}
