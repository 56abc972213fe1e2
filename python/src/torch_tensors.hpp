#pragma once
/// \file torch_tensors.hpp
/// A torch tensor read through its own Python attributes (type, dtype,
/// is_cpu, is_neg(), is_contiguous(), shape, data_ptr()) instead of DLPack,
/// for the one call a decode step makes per MoE block (PackedExperts.infer).
/// torch's `__dlpack__` is a Python function: 2.3 µs a tensor when the
/// interpreter is warm, several times that once a step has streamed the
/// expert weights through the caches; the attributes are C getters.
///
/// Only the plain case is read: an exact torch.Tensor (no subclass, so no
/// tensor that overrides its own behaviour), on the CPU, without the
/// negative bit, C-contiguous, two-dimensional and non-empty, of float32,
/// bfloat16 or int64. Anything else is "not plain" and the caller takes the
/// DLPack path (tensor_args.hpp), which checks it and names what is wrong.
/// torch is reached through Python only: the extension never links libtorch.

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>

#include <apex/ffn/core/types.hpp>

namespace apex::python {

namespace nb = nanobind;

/// The element types of plain tensors.
enum class TorchElem { f32, bf16, i64 };

/// torch's objects the reads compare with, looked up once (the GIL held).
/// Kept for the process's life: torch outlives every call that uses them.
struct TorchRefs {
  nb::object tensor_type, float32, bfloat16, int64, empty;

  static const TorchRefs& get() {
    static const TorchRefs* refs = [] {
      const nb::module_ torch = nb::module_::import_("torch");
      return new TorchRefs{torch.attr("Tensor"), torch.attr("float32"), torch.attr("bfloat16"), torch.attr("int64"),
                           torch.attr("empty")};
    }();
    return *refs;
  }
  const nb::object& dtype_of(TorchElem e) const { return e == TorchElem::f32 ? float32 : e == TorchElem::bf16 ? bfloat16 : int64; }
};

/// A plain tensor's memory: rows × cols elements of `elem`, row-major.
struct PlainTensor {
  void* data = nullptr;
  Index rows = 0, cols = 0;
  TorchElem elem = TorchElem::f32;
};

inline void* data_ptr_of(nb::handle t) {
  return reinterpret_cast<void*>(nb::cast<std::uintptr_t>(t.attr("data_ptr")()));
}

/// t's memory if t is a plain two-dimensional tensor (above), nothing otherwise.
inline std::optional<PlainTensor> plain_2d(nb::handle t) {
  const TorchRefs& torch = TorchRefs::get();
  if (!t.type().is(torch.tensor_type)) return std::nullopt;
  PlainTensor p;
  const nb::object dtype = t.attr("dtype");
  if (dtype.is(torch.float32)) p.elem = TorchElem::f32;
  else if (dtype.is(torch.bfloat16)) p.elem = TorchElem::bf16;
  else if (dtype.is(torch.int64)) p.elem = TorchElem::i64;
  else return std::nullopt;
  // the negative bit: a lazily negated view whose memory holds the values un-negated
  if (!t.attr("is_cpu").is(nb::handle(Py_True)) || t.attr("is_neg")().is(nb::handle(Py_True)) ||
      !t.attr("is_contiguous")().is(nb::handle(Py_True)))
    return std::nullopt;
  const nb::object shape = t.attr("shape");
  if (nb::len(shape) != 2) return std::nullopt;
  p.rows = nb::cast<Index>(shape[0]), p.cols = nb::cast<Index>(shape[1]);
  if (p.rows < 1 || p.cols < 1) return std::nullopt;
  p.data = data_ptr_of(t);
  return p;
}

/// A new uninitialised rows × cols CPU tensor of `elem` (torch.empty).
inline nb::object torch_empty_2d(Index rows, Index cols, TorchElem elem) {
  const TorchRefs& torch = TorchRefs::get();
  return torch.empty(rows, cols, nb::arg("dtype") = torch.dtype_of(elem));
}

}  // namespace apex::python
