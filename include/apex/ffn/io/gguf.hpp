#pragma once
/// \file io/gguf.hpp
/// The GGUF container (llama.cpp's and ggml's model files, versions 2 and 3):
/// validated reading over a read-only mapping, and atomic writing.
/// This umbrella includes the headers under gguf/, one per concern:
///
///     types.hpp    TensorType (ggml's type ids), TypeTraits, traits, tensor_nbytes
///     value.hpp    ValueType, Value (metadata values, checked conversions)
///     parse.hpp    Limits, TensorInfo, Header, parse (the validator)
///     file.hpp     File (open: mmap; from_memory), data pointers in place
///     writer.hpp   Writer (write to a ByteSink, save atomically)
///
/// Layout (ggml's docs/gguf.md and src/gguf.cpp; every integer little-endian):
///
///     [4]   magic "GGUF"
///     [4]   version, u32: 3 (2 has the same layout; 1 had 32-bit counts)
///     [8]   n_tensors, u64        [8]  n_kv, u64
///     n_kv times:     key: string · type: u32 · value
///                       string = u64 length + bytes (no NUL)
///                       array  = element type u32 · u64 count · elements
///                                (an array of arrays: each inner array is
///                                its own type · count · elements)
///                       bool   = one byte, 0 or 1
///     n_tensors times: name: string · n_dims: u32 (≤ 4) · ne[n_dims]: u64
///                       (ne[0] the row length) · type: u32 (ggml_type) ·
///                       offset: u64 (into the data section)
///     [pad] zeros to a multiple of general.alignment (u32, a power of 2,
///           default 32), counted from the start of the file
///     [data] each tensor at its offset: offset = the sum of the earlier
///           tensors' sizes, each padded to the alignment; a tensor's size
///           is (ne[0] / block) · block bytes · ne[1] · ne[2] · ne[3].
///
/// The reader trusts nothing in a file: the whole header and every tensor's
/// range are validated (parse.hpp) before a File exists, and any violation
/// throws `FormatError` naming the file and the problem.

#include "gguf/file.hpp"
#include "gguf/parse.hpp"
#include "gguf/types.hpp"
#include "gguf/value.hpp"
#include "gguf/writer.hpp"
