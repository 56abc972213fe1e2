#pragma once
/// \file quant/formats.hpp
/// ggml's quantized block formats (Q8_0, Q4_0, MXFP4, Q4_K, Q6_K, Q8_K):
/// layouts, scale conversions and the reference row quantizers and
/// dequantizers, bit-identical to ggml/src/ggml-quants.c. See
/// docs/quantized_formats.md.

#include "blocks.hpp"
#include "half.hpp"
#include "k_quant_search.hpp"
#include "mxfp4_openai.hpp"
#include "quantize_mxfp4.hpp"
#include "quantize_q4_0.hpp"
#include "quantize_q4_k.hpp"
#include "quantize_q6_k.hpp"
#include "quantize_q8_0.hpp"
#include "quantize_q8_k.hpp"
