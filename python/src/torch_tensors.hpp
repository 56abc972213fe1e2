#pragma once
/// \file torch_tensors.hpp
/// torch reached from C++ through Python, for the one call a decode step
/// makes per MoE block (PackedExperts.infer): its tensors' memory, new
/// outputs, and its thread count.
///
/// A torch tensor is read without DLPack's Python protocol: torch's
/// `__dlpack__` is a Python function, 2.3 µs a tensor when the interpreter
/// is warm and several times that once a step has streamed the expert
/// weights through the caches. Where torch publishes DLPack 1.3's C
/// exchange table (torch.Tensor.__dlpack_c_exchange_api__; table version ≥ 1.3),
/// one C call of it fills a non-owning DLTensor (data, device, dtype,
/// shape, strides) and one Python call reads the negative bit, which the
/// table does not carry; with an older torch the tensor's own attributes
/// are read (type, dtype, is_cpu, is_neg(), is_contiguous(), shape,
/// data_ptr(), C getters: six calls a tensor).
///
/// Only the plain case is read: an exact torch.Tensor (no subclass, so no
/// tensor that overrides its own behaviour), on the CPU, without the
/// negative bit, C-contiguous, two-dimensional and non-empty, of float32,
/// bfloat16 or int64. Anything else is "not plain" and the caller takes the
/// DLPack path (tensor_args.hpp), which checks it and names what is wrong.
/// torch is reached through Python only: the extension never links libtorch.

#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include <apex/ffn/core/types.hpp>

#include "dlpack_exchange.hpp"

namespace apex::python {

namespace nb = nanobind;

/// The element types of plain tensors.
enum class TorchElem { f32, bf16, i64 };

/// torch's objects the reads compare with and the attribute names they read,
/// looked up and interned once (the GIL held), so a read makes no string.
/// Kept for the process's life: torch outlives every call that uses them.
struct TorchRefs {
  nb::object tensor_type, float32, bfloat16, int64, cpu, empty, get_num_threads, is_inference_mode_enabled;
  nb::object dtype_name, is_cpu_name, is_neg_name, is_contiguous_name, shape_name, data_ptr_name;
  const DLPackExchangeTable* exchange;  ///< null with a torch that has none

  static const TorchRefs& get() {
    static const TorchRefs* refs = [] {
      const nb::module_ torch = nb::module_::import_("torch");
      const auto name = [](const char* s) {
        PyObject* n = PyUnicode_InternFromString(s);
        if (!n) throw nb::python_error();
        return nb::steal(n);
      };
      return new TorchRefs{torch.attr("Tensor"),        torch.attr("float32"),
                           torch.attr("bfloat16"),      torch.attr("int64"),
                           torch.attr("device")("cpu"), torch.attr("empty"),
                           torch.attr("get_num_threads"), torch.attr("is_inference_mode_enabled"),
                           name("dtype"),               name("is_cpu"),
                           name("is_neg"),              name("is_contiguous"),
                           name("shape"),               name("data_ptr"),
                           torch_exchange_table(torch.attr("Tensor"))};
    }();
    return *refs;
  }
  const nb::object& dtype_of(TorchElem e) const { return e == TorchElem::f32 ? float32 : e == TorchElem::bf16 ? bfloat16 : int64; }
};

/// t.<name> and t.<name>(), a Python error raised as nb::python_error.
inline nb::object attribute(nb::handle t, const nb::object& name) {
  PyObject* r = PyObject_GetAttr(t.ptr(), name.ptr());
  if (!r) throw nb::python_error();
  return nb::steal(r);
}
inline nb::object call_method(nb::handle t, const nb::object& name) {
  PyObject* r = PyObject_CallMethodNoArgs(t.ptr(), name.ptr());
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

/// A plain tensor's memory: rows × cols elements of `elem`, row-major.
struct PlainTensor {
  void* data = nullptr;
  Index rows = 0, cols = 0;
  TorchElem elem = TorchElem::f32;
};

/// t.data_ptr(), or null when t has no memory (functionalize's and
/// torch.func's wrappers, a storage-less tensor: data_ptr() raises or gives
/// 0); the Python error is cleared.
inline void* data_ptr_or_null(nb::handle t) {
  PyObject* ptr = PyObject_CallMethodNoArgs(t.ptr(), TorchRefs::get().data_ptr_name.ptr());
  void* data = ptr ? PyLong_AsVoidPtr(ptr) : nullptr;
  Py_XDECREF(ptr);
  if (!data) PyErr_Clear();
  return data;
}

/// t's memory if t is plain (above) and two-dimensional, read through the
/// exchange table: t is an exact torch.Tensor.
inline std::optional<PlainTensor> plain_2d_exchanged(nb::handle t, const TorchRefs& torch) {
  DLTensorView dl;
  if (torch.exchange->dltensor_from_py_object_no_sync(t.ptr(), &dl) != 0) {
    PyErr_Clear();  // not describable (meta, sparse, no storage): the checked path says why
    return std::nullopt;
  }
  PlainTensor p;
  const auto code = dl.dtype.code, bits = dl.dtype.bits;
  if (dl.dtype.lanes != 1) return std::nullopt;
  if (code == DLTensorView::kFloat && bits == 32) p.elem = TorchElem::f32;
  else if (code == DLTensorView::kBfloat && bits == 16) p.elem = TorchElem::bf16;
  else if (code == DLTensorView::kInt && bits == 64) p.elem = TorchElem::i64;
  else return std::nullopt;
  if (dl.device.type != DLTensorView::kCpu || dl.ndim != 2) return std::nullopt;
  p.rows = dl.shape[0], p.cols = dl.shape[1];
  if (p.rows < 1 || p.cols < 1) return std::nullopt;
  // C-contiguous as torch.is_contiguous() says it: a dimension of size 1 may have any stride
  if (dl.strides && ((p.rows > 1 && dl.strides[0] != p.cols) || (p.cols > 1 && dl.strides[1] != 1)))
    return std::nullopt;
  p.data = dl.data ? static_cast<char*>(dl.data) + dl.byte_offset : nullptr;
  // the negative bit (a lazily negated view whose memory holds the values un-negated) is not in a DLTensor
  if (!p.data || call_method(t, torch.is_neg_name).is(nb::handle(Py_True))) return std::nullopt;
  return p;
}

/// Whether plain_2d reads through torch's exchange table when it has one
/// (the tests read both ways: CI's torch has the table).
inline std::atomic<bool>& exchange_reads() {
  static std::atomic<bool> on{true};
  return on;
}

/// t's memory if t is a plain two-dimensional tensor (above), nothing otherwise.
inline std::optional<PlainTensor> plain_2d(nb::handle t) {
  const TorchRefs& torch = TorchRefs::get();
  if (!t.type().is(torch.tensor_type)) return std::nullopt;
  if (torch.exchange && exchange_reads().load(std::memory_order_relaxed)) return plain_2d_exchanged(t, torch);
  PlainTensor p;
  const nb::object dtype = attribute(t, torch.dtype_name);
  if (dtype.is(torch.float32)) p.elem = TorchElem::f32;
  else if (dtype.is(torch.bfloat16)) p.elem = TorchElem::bf16;
  else if (dtype.is(torch.int64)) p.elem = TorchElem::i64;
  else return std::nullopt;
  if (!attribute(t, torch.is_cpu_name).is(nb::handle(Py_True)) || call_method(t, torch.is_neg_name).is(nb::handle(Py_True)) ||
      !call_method(t, torch.is_contiguous_name).is(nb::handle(Py_True)))
    return std::nullopt;
  const nb::object shape = attribute(t, torch.shape_name);  // torch.Size, a tuple
  if (!PyTuple_Check(shape.ptr()) || PyTuple_GET_SIZE(shape.ptr()) != 2) return std::nullopt;
  p.rows = nb::cast<Index>(nb::handle(PyTuple_GET_ITEM(shape.ptr(), 0)));
  p.cols = nb::cast<Index>(nb::handle(PyTuple_GET_ITEM(shape.ptr(), 1)));
  if (p.rows < 1 || p.cols < 1) return std::nullopt;
  p.data = data_ptr_or_null(t);
  if (!p.data) return std::nullopt;
  return p;
}

/// A new uninitialised rows × cols CPU tensor of `elem` (torch.empty).
inline nb::object torch_empty_2d(Index rows, Index cols, TorchElem elem) {
  const TorchRefs& torch = TorchRefs::get();
  return torch.empty(rows, cols, nb::arg("dtype") = torch.dtype_of(elem), nb::arg("device") = torch.cpu);
}

/// New outputs for inference calls, allocated a few at a time. After a
/// decode step has streamed the expert weights through the caches, torch
/// runs from cold caches: the first torch.empty takes about 20 µs on the
/// 2-vCPU EPYC VM, the ones right after it about 2 µs. So a call that finds
/// no spare of its shape allocates up to eight (at most 1 MiB in all) and
/// keeps the rest for the next calls, which every MoE block of a decode step
/// makes with one shape. A spare was never handed out, so nothing else can
/// hold it; a call of another shape, or under the other inference mode (its
/// tensors are inference tensors), drops them. Each keeps its data pointer,
/// read once when it was made. None when torch's answer is not a plain CPU
/// tensor (a mode that makes fake or meta tensors is active): the caller
/// then takes the checked path. The GIL guards the spares (the extension is
/// not built for free-threaded Python).
class OutputSpares {
 public:
  struct Output {
    nb::object tensor;  ///< None: torch made no plain tensor
    void* data = nullptr;
  };

  static Output take(Index rows, Index cols, TorchElem elem) {
    static OutputSpares* spares = new OutputSpares;  // kept for the process's life, as TorchRefs
    const bool inference = nb::handle(TorchRefs::get().is_inference_mode_enabled()).is(nb::handle(Py_True));
    return spares->next({rows, cols, elem, inference});
  }

 private:
  static constexpr std::size_t kMaxSpares = 8, kMaxBytes = std::size_t(1) << 20;

  struct Key {
    Index rows = 0, cols = 0;
    TorchElem elem = TorchElem::f32;
    bool inference = false;
    bool operator==(const Key& o) const { return rows == o.rows && cols == o.cols && elem == o.elem && inference == o.inference; }
  };

  // torch.empty may release the GIL, so another thread can take or replace spares while this one
  // allocates: the state changes only after the last call into torch, and old spares die after it.
  Output next(const Key& key) {
    if (key == key_ && !spares_.empty()) {
      Output out = std::move(spares_.back());
      spares_.pop_back();
      return out;
    }
    const std::size_t elem_bytes = key.elem == TorchElem::i64 ? 8 : key.elem == TorchElem::f32 ? 4 : 2;
    const std::size_t bytes = std::size_t(key.rows) * std::size_t(key.cols) * elem_bytes;
    const std::size_t count = std::max<std::size_t>(1, std::min(kMaxSpares, kMaxBytes / bytes));
    const auto make = [&] {
      Output o{torch_empty_2d(key.rows, key.cols, key.elem)};
      if (o.tensor.type().is(TorchRefs::get().tensor_type)) o.data = data_ptr_or_null(o.tensor);
      return o;
    };
    Output out = make();
    if (!out.data) return Output{nb::none()};
    std::vector<Output> batch;
    for (std::size_t i = 1; i < count; ++i)
      if (Output o = make(); o.data) batch.push_back(std::move(o));
    if (!(key == key_)) {
      std::swap(batch, spares_), key_ = key;
    } else {
      for (Output& t : batch)
        if (spares_.size() < count) spares_.push_back(std::move(t));
    }
    return out;  // `batch` (the other key's spares, if any) dies here
  }

  Key key_;
  std::vector<Output> spares_;  ///< each made as `out` was, so plain
};

/// apex_ffn.set_num_threads's count; 0: follow torch.get_num_threads().
inline std::atomic<int>& threads_setting() {
  static std::atomic<int> threads{0};
  return threads;
}

/// The threads an operation runs on (the GIL held: torch is asked through Python).
inline int package_threads() {
  const int set = threads_setting().load(std::memory_order_relaxed);
  return set > 0 ? set : nb::cast<int>(TorchRefs::get().get_num_threads());
}

}  // namespace apex::python
