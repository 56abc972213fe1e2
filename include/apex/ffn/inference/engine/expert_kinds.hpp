#pragma once
/// \file inference/engine/expert_kinds.hpp
/// The library's rows of the expert-kind table (inference/engine/expert_kind.hpp),
/// one header each: what the packed layer, its files and the adapters'
/// layers include so that every library expert type has its row. A user's
/// kind is its own header, included before the layer is instantiated.
///
///     kind             expert template       kept as float per expert        GGUF form
///     swiglu           SwiGLU<T>             —                               llama.cpp's plain MoE blocks
///     kappa_swiglu     KappaSwiGLU<T>        kappa_alpha, kappa_bias         —
///     clamped_swiglu   ClampedSwiGLU<T>      w_gate.bias, w_up.bias,         gpt-oss's block
///                                            w_down.bias

#include "kinds/clamped_swiglu.hpp"
#include "kinds/kappa_swiglu.hpp"
#include "kinds/swiglu.hpp"
