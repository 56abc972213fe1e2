#pragma once
/// \file io/safetensors.hpp
/// The safetensors file format: validated reading, writing, atomic saves.
/// This umbrella includes the headers under safetensors/, one per concern:
///
///     dtype.hpp        DType, its spellings and sizes
///     element_bits.hpp little-endian bytes, double → float and → bf16 rounding
///     codec.hpp        element arrays to and from their stored bytes
///     header.hpp       Header, TensorInfo, Metadata, Limits; quote_name, shape_string
///     parse.hpp        the header parser and validator (parse_header, read_header)
///     files.hpp        the file layer (io/file/) under the format's names:
///                      ByteSource / ByteSink and their in-memory versions,
///                      FileSource (regular files only, never blocks on
///                      open), write_file_atomic (bounded temporary names)
///     reader.hpp       Reader
///     writer.hpp       write, save, TensorRef
///
/// Layout (https://github.com/huggingface/safetensors, "Format"):
///
///     [8 bytes]  N, unsigned 64-bit little-endian: length of the header
///     [N bytes]  JSON object, UTF-8, starting with '{', padded with spaces
///                so that 8 + N is a multiple of 8:
///                  { "__metadata__": {"key": "value", …},            (optional)
///                    "name": {"dtype": "F32", "shape": [r, c],
///                             "data_offsets": [begin, end]}, … }
///     [rest]     the data buffer; begin/end are byte offsets into it
///                (relative to its start, end exclusive), row-major,
///                little-endian.
///
/// The reader trusts nothing in a file: the header is validated completely
/// (io/safetensors/parse.hpp) before a single data byte is read, and any
/// violation throws `FormatError`. The header is parsed and written with
/// nlohmann/json (a dependency of these headers only).

#include "safetensors/element_bits.hpp"
#include "safetensors/codec.hpp"
#include "safetensors/dtype.hpp"
#include "safetensors/files.hpp"
#include "safetensors/header.hpp"
#include "safetensors/parse.hpp"
#include "safetensors/reader.hpp"
#include "safetensors/writer.hpp"
