"""PackedExpertsModule: the routed experts of one MoE block of a transformers model, packed (apex_ffn.packed
makes them). Inference runs the library's packed forward in one call into the extension; with grad, the
ops with their backward (apex_ffn.ops); its state dict holds the experts as float tensors
(apex_ffn.float_weights)."""
import copy

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from . import float_weights as float_tensors, ops
from ._tensors import float32, int64

# Looked up once: at decode every step's first Python runs from cold caches, where each lookup and frame
# costs microseconds. is_dynamo_compiling, not is_compiling: one frame, not two, and the same answer where
# it matters (dynamo must not trace the extension's call; torch.export without dynamo passes fake tensors,
# which infer declines).
_grad_enabled = torch.is_grad_enabled
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_jit_tracing = torch._C._is_tracing
# nn.Module's global hooks (dicts changed in place by register_module_forward_hook and the like)
_global_hooks = (_nn_module._global_backward_pre_hooks, _nn_module._global_backward_hooks,
                 _nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks)


class PackedExpertsModule(nn.Module):
    """The routed experts of one MoE block, packed; forward as transformers' experts modules:
    (hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K)) → (T, H) in the input's dtype."""

    def __init__(self, packed, layout, source="", weight_dtype=torch.float32):
        super().__init__()
        self.packed = packed
        self.handle = ops.register_packed(packed)
        self.layout = layout
        self.num_experts = packed.experts
        self.hidden_dim = packed.d_model
        self.intermediate_dim = packed.d_ffn
        self.source = source
        self.weight_dtype = weight_dtype  # the float module's: its state dict's tensors are of it
        self.lora = None  # apex_ffn.lora.ExpertsLora, when adapters are attached

    def __call__(self, *args, **kwargs):
        """nn.Module's call, without its frames when it would only call forward: no hooks (the module's or global
        ones), not compiled as a module (torch.compile(module)), not traced (dynamo, jit); and at inference
        without adapters forward's first step, the extension's one-call path (PackedExperts.infer), made here.
        At decode the call runs from cold caches, where nn.Module's two frames cost 8-11 µs and forward's own
        about as much, of a Qwen3-30B-A3B block's 0.7-1.7 ms."""
        d = self.__dict__
        if (d.get("_compiled_call_impl") is None and not (d["_forward_hooks"] or d["_forward_pre_hooks"]
                                                         or d["_backward_hooks"] or d["_backward_pre_hooks"])
                and not (_global_hooks[0] or _global_hooks[1] or _global_hooks[2] or _global_hooks[3])
                and not _dynamo_compiling() and not _jit_tracing()):
            if len(args) == 3 and not kwargs and d["_modules"].get("lora") is None and not _grad_enabled():
                y = d["packed"].infer(*args, d["layout"].expert_parallel)  # None: forward checks the arguments
                if y is not None:
                    return y
            return self.forward(*args, **kwargs)
        return nn.Module.__call__(self, *args, **kwargs)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # torch.jit.trace records only what goes through torch's dispatcher: traced, the experts must run as the
        # op, or the trace would hold an uninitialised output in their place
        traced = _jit_tracing()
        if self.lora is None and not _grad_enabled() and not _dynamo_compiling() and not traced:
            # inference: one call into the extension, which reads plain CPU tensors without DLPack, allocates
            # y and reads the thread count (PackedExperts.infer); None for any other input (a fake tensor of
            # a non-strict export among them), which the checked path below takes
            y = self.packed.infer(hidden_states, top_k_index, top_k_weights, self.layout.expert_parallel)
            if y is not None:
                return y
        ops.check_routed_dtypes("apex_ffn.PackedExpertsModule", hidden_states, top_k_index, top_k_weights)
        dtype = hidden_states.dtype
        bf16 = dtype == torch.bfloat16  # a bf16 model: bf16 experts may multiply in bf16 pairs
        ep = self.layout.expert_parallel
        if self.lora is not None or torch.is_grad_enabled() or torch.compiler.is_compiling() or traced:
            # through torch's dispatcher (custom ops): torch.compile and torch.jit.trace record these casts and
            # the op, and the dispatcher resolves a lazily negated view before the op's body sees it
            x, w = hidden_states.float().contiguous(), top_k_weights.float().contiguous()
            ids = top_k_index.long().contiguous()
            if self.lora is not None:
                y = self.lora.run(self.handle, x, ids, w, ep)
            elif torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
                # gradients through frozen experts (to the router, to layers before): the training forward,
                # without adapters, whose backward gives ∂L/∂x and ∂L/∂w
                y = ops.packed_experts_train(x, ids, w, None, None, None, None, 1.0, self.handle, ep)[0]
            else:
                y = ops.packed_experts(x, ids, w, self.handle, ep, bf16)
        else:  # inference: the op's body without the dispatcher (ops.packed_forward), so the negative bit here
            x, w, ids = float32(hidden_states), float32(top_k_weights), int64(top_k_index)
            y = ops.packed_forward(x, ids, w, self.handle, ep, bf16)
        return y if dtype == torch.float32 else y.to(dtype)

    def weight_shapes(self):
        """{name: shape} of the float module's expert tensors (apex_ffn.float_weights.weight_shapes)."""
        return float_tensors.weight_shapes(self)

    def float_weights(self, dtype=None, threads=None):
        """The experts as the float module's tensors, dequantized (apex_ffn.float_weights.float_weights)."""
        return float_tensors.float_weights(self, dtype, threads)

    def load_float_weights(self, tensors, threads=None):
        """Packs the float module's tensors in place of the experts (apex_ffn.float_weights.load_float_weights)."""
        float_tensors.load_float_weights(self, tensors, threads)

    def _apply(self, fn, *args, **kwargs):
        """model.to(dtype), .half(), .bfloat16(): the float module's dtype follows, so the state dict's tensors
        are of the model's dtype (the packed experts keep their storage types)."""
        probe = fn(torch.empty(0, dtype=self.weight_dtype))
        if isinstance(probe, torch.Tensor) and probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The experts as the float module's tensors where asked for (apex_ffn.float_export), not otherwise."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        float_tensors.save_to_state_dict(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """load_state_dict packs the float module's tensors when given them (load_float_weights), all or none."""
        rest = float_tensors.load_from_state_dict(self, state_dict, prefix, local_metadata, error_msgs)
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def __reduce_ex__(self, protocol):
        raise TypeError("apex_ffn.PackedExpertsModule cannot be pickled (its experts are packed by the extension): "
                        "save the model's state_dict (the experts as float tensors) or the packed experts with "
                        "apex_ffn.packed.save_pack_once")

    def __copy__(self):
        """A shallow copy: like nn.Module's, it shares what the module holds (the packed weights, never written
        in place, the layout, and the LoRA adapters when attached: the same ExpertsLora and parameters, so
        training either trains both), but it holds a registry handle of its own, so that each keeps working when
        the other is collected (the module's handle is released with it). Unlike a float module's copy, loading
        other experts into one (load_state_dict, load_float_weights) leaves the other's as they were. Its containers of submodules, parameters, buffers
        and hooks are its own (shallow copies): attaching other adapters to one (add_lora, load_peft) or a hook
        leaves the other's as they were."""
        new = type(self).__new__(type(self))
        new.__dict__["handle"] = ops.register_packed(self.packed)  # first: __del__ releases the copy's handle
        state = nn.Module.__getstate__(self)  # without a compiled call bound to this module, as pickling
        state.pop("handle", None)
        new.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in state.items()})
        return new

    def __deepcopy__(self, memo):
        """A copy sharing the packed weights (never written) under a handle of its own; adapters copied."""
        new = PackedExpertsModule(self.packed, copy.deepcopy(self.layout, memo), self.source, self.weight_dtype)
        new.train(self.training)
        if self.lora is not None:
            new.lora = copy.deepcopy(self.lora, memo)
            new.lora_config = dict(self.lora_config)
        memo[id(self)] = new
        return new

    def __del__(self):
        ops.release_packed(getattr(self, "handle", None))

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim},"
                f" types={self.packed.types!r}, gate={self.layout.gate!r}, nbytes={self.packed.nbytes}"
                + (f", source={self.source!r}" if self.source else ""))
