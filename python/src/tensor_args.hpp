#pragma once
/// \file tensor_args.hpp
/// The extension's view of a tensor argument: a CPU buffer handed over by
/// DLPack (nanobind's ndarray), checked once, with a message naming the
/// operation and the argument, before any pointer is read. The operations
/// take these views and write into outputs the caller allocated, so no
/// tensor is copied on the way in or out.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/types.hpp>

namespace apex::python {

namespace nb = nanobind;
using Array = nb::ndarray<nb::ro>;     ///< any DLPack tensor, read
using MutArray = nb::ndarray<>;        ///< any DLPack tensor, written

/// The element types the operations read.
enum class Elem { f32, i64, bf16 };

inline const char* elem_name(Elem e) {
  switch (e) {
    case Elem::f32: return "float32";
    case Elem::i64: return "int64";
    case Elem::bf16: return "bfloat16";
  }
  return "?";
}

inline std::string dtype_text(const nb::dlpack::dtype& t) {
  const auto code = nb::dlpack::dtype_code(t.code);
  const char* kind = code == nb::dlpack::dtype_code::Float    ? "float"
                     : code == nb::dlpack::dtype_code::Int    ? "int"
                     : code == nb::dlpack::dtype_code::UInt   ? "uint"
                     : code == nb::dlpack::dtype_code::Bfloat ? "bfloat"
                     : code == nb::dlpack::dtype_code::Bool   ? "bool"
                                                              : "complex";
  return std::string(kind) + std::to_string(int(t.bits));
}

inline bool is_elem(const nb::dlpack::dtype& t, Elem e) {
  switch (e) {
    case Elem::f32: return t == nb::dtype<float>();
    case Elem::i64: return t == nb::dtype<std::int64_t>();
    case Elem::bf16: return t.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 && t.lanes == 1;
  }
  return false;
}

/// A checked CPU, C-contiguous tensor: its data and shape.
template <class T>
struct View {
  T* data = nullptr;
  std::int64_t shape[4] = {0, 0, 0, 0};
  std::size_t ndim = 0;
  Index dim(std::size_t i) const { return Index(shape[i]); }
  Index size() const {
    Index n = 1;
    for (std::size_t i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
};

/// ShapeError / ValueError naming `where` and `name` unless `a` is a CPU
/// tensor of element type `e`, with `dims` dimensions, C-contiguous, with
/// memory.
template <class Arr>
void check_tensor(const char* where, const char* name, const Arr& a, Elem e, std::size_t dims) {
  const std::string head = std::string(where) + ": argument '" + name + "' ";
  if (a.device_type() != nb::device::cpu::value)
    throw ValueError(head + "is on another device (device type " + std::to_string(a.device_type()) +
                     "); apex_ffn computes on CPU tensors: move it with .cpu()");
  if (!is_elem(a.dtype(), e))
    throw ValueError(head + "has dtype " + dtype_text(a.dtype()) + ", expected " + elem_name(e));
  if (a.ndim() != dims)
    throw ShapeError(head + "has " + std::to_string(a.ndim()) + " dimensions, expected " + std::to_string(dims));
  // A tensor with no elements has no memory to lay out: torch gives such tensors any strides (torch.empty(n, 0)
  // has (1, 1)) and calls them contiguous, so .contiguous() would not change them and refusing them would ask
  // for what the caller cannot do.
  if (a.size() > 0) {
    std::int64_t expected = 1;
    for (std::size_t i = a.ndim(); i-- > 0;) {
      if (a.shape(i) != 1 && a.stride(i) != expected)
        throw ValueError(head + "is not contiguous (strides do not match a row-major layout); call .contiguous() first");
      expected *= std::int64_t(a.shape(i));
    }
  }
  if (!a.data() && a.size() > 0)  // a fake or functional tensor's wrapper: shape without memory
    throw ValueError(head + "has no memory (a fake, meta or functional tensor); apex_ffn computes on real CPU tensors");
}

template <class T>
View<T> view(const char* where, const char* name, const Array& a, Elem e, std::size_t dims) {
  check_tensor(where, name, a, e, dims);
  View<T> v;
  v.data = static_cast<T*>(const_cast<void*>(a.data()));
  v.ndim = dims;
  for (std::size_t i = 0; i < dims; ++i) v.shape[i] = std::int64_t(a.shape(i));
  return v;
}
template <class T>
View<T> view(const char* where, const char* name, const MutArray& a, Elem e, std::size_t dims) {
  check_tensor(where, name, a, e, dims);
  View<T> v;
  v.data = static_cast<T*>(a.data());
  v.ndim = dims;
  for (std::size_t i = 0; i < dims; ++i) v.shape[i] = std::int64_t(a.shape(i));
  return v;
}

/// ShapeError unless v's shape is `expected` (kAny: any extent).
template <class T>
void expect_shape(const char* where, const char* name, const View<T>& v, std::initializer_list<Index> expected) {
  bool ok = expected.size() == v.ndim;
  std::size_t i = 0;
  for (Index e : expected) ok = ok && (e < 0 || e == v.dim(i)), ++i;
  if (ok) return;
  const auto text = [](const std::vector<Index>& dims) {
    std::string s = "(";
    for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + (dims[i] < 0 ? std::string("*") : std::to_string(dims[i]));
    return s + ")";
  };
  std::vector<Index> got;
  for (std::size_t j = 0; j < v.ndim; ++j) got.push_back(v.dim(j));
  throw ShapeError(std::string(where) + ": argument '" + name + "' has shape " + text(got) + ", expected " +
                   text(std::vector<Index>(expected)));
}

/// A row-major matrix over a view's memory (no copy).
template <class T>
using Map = Eigen::Map<Matrix<std::remove_const_t<T>>>;
template <class T>
using ConstMap = Eigen::Map<const Matrix<std::remove_const_t<T>>>;

}  // namespace apex::python
