#pragma once
/// \file layers/expert_side_input.hpp
/// The per-pair side inputs an expert may declare as `using SideInput = …`
/// (moe/expert_contract.hpp): a tag type each, nothing else.
///
/// Exists below moe/ so that an expert layer (layers/kappa_swiglu.hpp)
/// declares what it reads without including the MoE layer that routes to
/// it. The dispatch gathers the side input into sorted order before the
/// experts run and scatters its gradient back after (moe/dispatch.hpp).

namespace apex {

/// The expert reads its rows of x only (the default).
struct NoSideInput {};
/// The expert also reads, per row, the raw router logit ℓ[t, e] of its own
/// expert e for the row's token t, and returns ∂L/∂ℓ, which reaches the
/// router's weights and x (docs/math.md#kappa-swiglu).
struct RouterLogitInput {};

}  // namespace apex
