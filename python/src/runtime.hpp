#pragma once
/// \file runtime.hpp
/// What every operation of the extension shares: the kernel path (ISA)
/// the packed products run on — by default the best one the running CPU
/// has, whatever the compiler targeted — and the declarations that bind
/// each part of the module.

#include <atomic>
#include <string>

#include <nanobind/nanobind.h>

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/kernels/isa.hpp>

namespace apex::python {

/// The best kernel path the running CPU supports.
inline packed::Isa best_isa() {
  packed::Isa best = packed::Isa::scalar;
  for (packed::Isa i : packed::kAllIsas)
    if (packed::cpu_supports(i)) best = i;
  return best;
}

inline std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{int(best_isa())};
  return slot;
}
/// The path the operations run on now.
inline packed::Isa current_isa() { return packed::Isa(isa_slot().load(std::memory_order_relaxed)); }

/// The path named `name` ("avx512_bf16"...); ConfigError for an unknown name
/// or one the CPU lacks.
inline packed::Isa isa_from_name(const std::string& name) {
  for (packed::Isa i : packed::kAllIsas)
    if (name == packed::isa_name(i)) {
      packed::detail::require_isa("apex_ffn.set_isa", i);
      return i;
    }
  throw ConfigError("apex_ffn.set_isa: unknown kernel path '" + name +
                    "', expected one of scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx_bf16");
}

void bind_float_experts(nanobind::module_& m);
void bind_packed_experts(nanobind::module_& m);
void bind_files(nanobind::module_& m);
void bind_pack_once(nanobind::module_& m);

}  // namespace apex::python
