"""The library's experts inside Hugging Face transformers models.

``import apex_ffn.hf`` registers the experts implementation ``"apex_ffn"``
with transformers' experts interface, so that

    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="apex_ffn")
    model.set_experts_implementation("apex_ffn")

run every experts module of the model (Qwen2/3-MoE, OLMoE, Mixtral,
DeepSeek-V3, gpt-oss, and the other families of the interface) on the
library's float experts, reading the module's own weights in place, with
the library's backward for ∂L/∂x, ∂L/∂(routing weights) and the weights'
gradients. A module whose layout or activation the library does not have
is a ConfigError naming it, at its first call.

bf16 or f16 expert weights: without gradients they run packed as bf16
(exact for bf16 weights; f16 rounded), packed once per weight version;
with gradients they run in float32 (the weights widened, their gradients
narrowed back by autograd). In a bf16 model on the avx512_bf16 and
amx_bf16 paths the packed SiLU-gated experts multiply in bf16 pairs
(`vdpbf16ps`; AMX tiles on amx_bf16), rounding the hidden activations to
bf16 as the model's own experts do.
"""
import weakref

import torch

from . import _core, ops
from .layout import cached_layout

NAME = "apex_ffn"

# module → (key, handle, weak references to the tensors packed, release, layout): _packed_bf16's cache, beside
# the module rather than in its __dict__, where the references would stop the module from pickling. release (a
# weakref.finalize, outside the module too) gives the handle back when the module is collected: the entry goes
# with the module, but the registry in ops would otherwise keep the packed copy of its experts for good.
_PACKED_BF16 = weakref.WeakKeyDictionary()


def _bias(module, name, layout):
    return getattr(module, name) if layout.has_bias else None


def _packed_bf16(module, layout):
    """The module's bf16/f16 weights packed as bf16, rebuilt when a weight changes: written in place (its
    version) or replaced by another tensor. The cache holds weak references to the tensors it packed: a new
    tensor can take a freed one's address and version count (del, then a new weight of the same size), which
    a key of addresses and versions alone would take for the packed weights, silently."""
    tensors = [module.gate_up_proj, module.down_proj] + (
        [module.gate_up_proj_bias, module.down_proj_bias] if layout.has_bias else [])
    key = tuple((t.data_ptr(), t._version) for t in tensors)
    cached = _PACKED_BF16.get(module)
    if cached is not None and cached[0] == key and cached[4] is layout and all(
            ref() is t for ref, t in zip(cached[2], tensors)):  # a new layout (act_fn changed, say): packed again
        return cached[1]
    if layout.gate == "silu" and layout.has_bias:
        raise _core.ConfigError(f"apex_ffn: {type(module).__name__}: SiLU-gated experts with biases in "
                                f"{module.gate_up_proj.dtype} run only in float32 (the packed kinds have no biases)")
    float_ = [t.detach().float().contiguous() for t in tensors]
    p = _core.PackedExperts.from_float(float_[0], float_[1], float_[2] if layout.has_bias else None,
                                       float_[3] if layout.has_bias else None, layout.gate, layout.transposed,
                                       layout.interleaved, layout.alpha, layout.limit, "bf16", ops.get_num_threads())
    if cached is not None:
        cached[3]()  # releases the handle now (a finalizer runs once: not again when the module goes)
    handle = ops.register_packed(p)
    _PACKED_BF16[module] = (key, handle, [weakref.ref(t) for t in tensors],
                            weakref.finalize(module, ops.release_packed, handle), layout)
    return handle


def apex_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts function: (T, H), (T, K) ids, (T, K) weights → (T, H) in the input's dtype."""
    layout = cached_layout(module)
    ops.check_routed_dtypes(f"apex_ffn: {type(module).__name__}", hidden_states, top_k_index, top_k_weights)
    dtype = hidden_states.dtype
    x = hidden_states.float().contiguous()
    w = top_k_weights.float().contiguous()
    ids = top_k_index.long().contiguous()
    gu, dn = module.gate_up_proj, module.down_proj
    grad = torch.is_grad_enabled() and any(  # every input with a gradient: the packed path gives none
        t is not None and t.requires_grad
        for t in (hidden_states, top_k_weights, gu, dn, _bias(module, "gate_up_proj_bias", layout),
                  _bias(module, "down_proj_bias", layout)))
    if gu.dtype != torch.float32 and not grad:
        y = ops.packed_experts(x, ids, w, _packed_bf16(module, layout), layout.expert_parallel,
                               dtype == torch.bfloat16)
        return y.to(dtype)
    gb, db = _bias(module, "gate_up_proj_bias", layout), _bias(module, "down_proj_bias", layout)
    if gu.dtype != torch.float32:  # widened: autograd narrows the gradients back
        gu, dn = gu.float(), dn.float()
        gb, db = (gb.float(), db.float()) if gb is not None else (None, None)
    y, _, _ = ops.float_experts(x, ids, w, gu, dn, gb, db, layout.gate, layout.transposed, layout.interleaved,
                                layout.alpha, layout.limit, layout.expert_parallel)
    return y.to(dtype)


def register():
    """Registers the "apex_ffn" experts implementation (done on import)."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, apex_experts_forward)


register()
