#pragma once
/// \file ffn.hpp
/// Umbrella header of apex-ffn: the feed-forward layers of APEX-1.

#include "ffn/activations.hpp"
#include "ffn/cross_entropy.hpp"
#include "ffn/dispatch.hpp"
#include "ffn/errors.hpp"
#include "ffn/init.hpp"
#include "ffn/linear.hpp"
#include "ffn/load_balancer.hpp"
#include "ffn/moe.hpp"
#include "ffn/moe_config.hpp"
#include "ffn/multi_token_heads.hpp"
#include "ffn/parallel.hpp"
#include "ffn/param.hpp"
#include "ffn/rms_norm.hpp"
#include "ffn/router.hpp"
#include "ffn/speculative.hpp"
#include "ffn/swiglu.hpp"
#include "ffn/types.hpp"
#include "ffn/version.hpp"
