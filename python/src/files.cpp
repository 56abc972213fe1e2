/// \file files.cpp
/// Packed experts from model files: a llama.cpp GGUF file's MoE block
/// (the library's load_gguf_moe), and the library's pack-once file (its
/// panels mapped in place).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "runtime.hpp"

namespace apex::python {
void bind_files(nanobind::module_&) {}
}  // namespace apex::python
