#pragma once
/// \file dlpack_exchange.hpp
/// DLPack 1.3's C exchange table, the way a framework hands a tensor's
/// memory to an extension without a Python call: torch publishes it (2.15 here)
/// as a PyCapsule on `torch.Tensor.__dlpack_c_exchange_api__`. Declared here
/// in dlpack.h's stable layout (the header names no DLPack package: Debian
/// has none, and the few structs are fixed by the ABI), with the one entry
/// torch_tensors.hpp calls.

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>

namespace apex::python {

namespace nb = nanobind;

/// DLPack's DLTensor (dlpack.h, ABI-stable since 1.0), with the codes read here.
struct DLTensorView {
  static constexpr std::int32_t kCpu = 1;                           // DLDeviceType kDLCPU
  static constexpr std::uint8_t kInt = 0, kFloat = 2, kBfloat = 4;  // DLDataTypeCode
  void* data;
  struct {
    std::int32_t type, id;
  } device;
  std::int32_t ndim;
  struct {
    std::uint8_t code, bits;
    std::uint16_t lanes;
  } dtype;
  const std::int64_t* shape;
  const std::int64_t* strides;  ///< elements; null: compact row-major
  std::uint64_t byte_offset;
};

/// DLPack 1.3's C exchange table (dlpack.h's DLPackExchangeAPI), in its
/// stable layout: the version header, then five function pointers, of which
/// only dltensor_from_py_object_no_sync is called here (it fills `out`,
/// whose shape and strides stay torch's, valid while the tensor lives; 0 on
/// success, else -1 with a Python error set).
struct DLPackExchangeTable {
  struct Header {
    std::uint32_t major, minor;
    const Header* prev_api;  // an older table in the chain, or null
  } header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensorView* out);
  void* current_work_stream;
};

/// torch.Tensor's exchange table of DLPack major version 1 that has the
/// DLTensor export, or null (an older torch: no table).
inline const DLPackExchangeTable* torch_exchange_table(nb::handle tensor_type) {
  PyObject* capsule = PyObject_GetAttrString(tensor_type.ptr(), "__dlpack_c_exchange_api__");
  if (!capsule) {
    PyErr_Clear();
    return nullptr;
  }
  const auto* h = static_cast<const DLPackExchangeTable::Header*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  Py_DECREF(capsule);  // the table is static in torch, alive for the process
  if (!h) PyErr_Clear();
  while (h && h->major > 1) h = h->prev_api;
  if (!h || h->major != 1 || h->minor < 3) return nullptr;
  const auto* table = reinterpret_cast<const DLPackExchangeTable*>(h);
  return table->dltensor_from_py_object_no_sync ? table : nullptr;
}

// The layouts copied by hand, checked against dlpack.h's on LP64
static_assert(sizeof(DLTensorView) == 48 && offsetof(DLTensorView, shape) == 24 &&
              offsetof(DLTensorView, byte_offset) == 40, "DLTensorView must have DLTensor's layout");
static_assert(sizeof(DLPackExchangeTable) == 56 &&
              offsetof(DLPackExchangeTable, dltensor_from_py_object_no_sync) == 40,
              "DLPackExchangeTable must have DLPackExchangeAPI's layout");

}  // namespace apex::python
