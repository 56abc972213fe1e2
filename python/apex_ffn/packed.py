"""Packed experts in a transformers model.

    import apex_ffn.packed as P
    P.pack_experts(model, "q4_k")                       # quantized by the library from the model's weights
    P.pack_experts(model, gguf="Qwen3-30B-A3B-Q4_K_M.gguf")  # the file's blocks, never dequantized

replaces every experts module of the model (a module named ``*.experts``
of transformers' experts interface) with a PackedExpertsModule holding its
experts in one of the library's storage types (``apex_ffn.storage_types()``;
``"q4_k/q6_k"`` gives gate_up and down their own). The model's float expert
weights are dropped with the modules they belonged to. From a GGUF file, the
model may be meta-initialised: the experts come from the file (block i of the
file for ``…layers.i…``), moved into the library's panels as they are.

Every module is packed (and checked against the file) before the first one
is swapped in, so an error leaves the model as it was.

Inference runs the library's packed forward, which quantizes the activations
as ggml does for the block formats. LoRA adapters on packed experts: see
apex_ffn.lora.
"""
import copy
import re

import torch
from torch import nn

from . import _core, ops
from ._threads import get_num_threads
from .layout import experts_layout

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


class PackedExpertsModule(nn.Module):
    """The routed experts of one MoE block, packed; forward as transformers' experts modules:
    (hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K)) → (T, H) in the input's dtype."""

    def __init__(self, packed, layout, source=""):
        super().__init__()
        self.packed = packed
        self.handle = ops.register_packed(packed)
        self.layout = layout
        self.num_experts = packed.experts
        self.hidden_dim = packed.d_model
        self.intermediate_dim = packed.d_ffn
        self.source = source
        self.lora = None  # apex_ffn.lora.ExpertsLora, when adapters are attached

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dtype = hidden_states.dtype
        x = hidden_states.float().contiguous()
        w = top_k_weights.float().contiguous()
        ids = top_k_index.long().contiguous()
        if self.lora is not None:
            y = self.lora.run(self.handle, x, ids, w, self.layout.expert_parallel)
        elif torch.is_grad_enabled() or torch.compiler.is_compiling():
            y = ops.packed_experts(x, ids, w, self.handle, self.layout.expert_parallel)
        else:  # inference: the op's body without the dispatcher (ops.packed_forward)
            y = ops.packed_forward(x, ids, w, self.handle, self.layout.expert_parallel)
        return y.to(dtype)

    def __deepcopy__(self, memo):
        """A copy sharing the packed weights (never written) under a handle of its own; adapters copied."""
        new = PackedExpertsModule(self.packed, copy.deepcopy(self.layout, memo), self.source)
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


def experts_modules(model):
    """(name, module) of every experts module of transformers' experts interface in `model`."""
    return [(n, m) for n, m in model.named_modules() if n.split(".")[-1] == "experts" and hasattr(m, "has_gate")]


def _layer_of(name):
    m = _LAYER.search(name)
    if not m:
        raise _core.ConfigError(f"apex_ffn.pack_experts: the module name '{name}' has no layer index "
                                "(…layers.<i>…), so its GGUF block is unknown")
    return int(m.group(1))


def _from_float(name, module, layout, types, threads):
    t = [module.gate_up_proj, module.down_proj]
    if layout.has_bias:
        t += [module.gate_up_proj_bias, module.down_proj_bias]
    if any(x.device.type == "meta" for x in t):
        raise _core.ConfigError(f"apex_ffn.pack_experts: {name} has no weights (a meta-initialised model): "
                                "pack it from a GGUF file (gguf=...)")
    t = [x.detach().to("cpu", torch.float32).contiguous() for x in t]
    return _core.PackedExperts.from_float(t[0], t[1], t[2] if layout.has_bias else None,
                                          t[3] if layout.has_bias else None, layout.gate, layout.transposed,
                                          layout.interleaved, layout.alpha, layout.limit, types, threads)


def _expected_shape(module, layout):
    gu = module.gate_up_proj
    e = gu.shape[0]
    h, two_f = (gu.shape[1], gu.shape[2]) if layout.transposed else (gu.shape[2], gu.shape[1])
    return e, h, two_f // 2


def pack_experts(model, types=None, gguf=None, threads=None):
    """Replaces every experts module of `model` with a PackedExpertsModule (see the module comment):
    from the model's weights in storage type `types`, or from the GGUF file `gguf` (a path) in the
    file's types. Returns the names of the replaced modules. Nothing is replaced when anything fails."""
    if (types is None) == (gguf is None):
        raise _core.ConfigError("apex_ffn.pack_experts: give either types (pack the model's weights) or gguf "
                                "(a GGUF file's experts), not both or neither")
    found = experts_modules(model)
    if not found:
        raise _core.ConfigError(f"apex_ffn.pack_experts: {type(model).__name__} has no experts module of "
                                "transformers' experts interface (…experts with has_gate)")
    threads = get_num_threads() if threads is None else threads
    file = _core.GgufFile.open(str(gguf)) if gguf is not None else None
    built = []
    try:
        for name, module in found:
            layout = experts_layout(module)
            layout.expert_parallel = bool(getattr(module, "_is_expert_parallel", False))
            if file is None:
                p = _from_float(name, module, layout, types, threads)
                source = ""
            else:
                p = _core.packed_from_gguf(file, _layer_of(name), layout.gate)
                source = f"{file.description}, block {_layer_of(name)}"
            want = _expected_shape(module, layout)
            if (p.experts, p.d_model, p.d_ffn) != want:
                raise _core.ShapeError(f"apex_ffn.pack_experts: {name} has {want[0]} experts of {want[1]} x {want[2]}"
                                       f" (experts, hidden, intermediate), the packed ones {p.experts} x {p.d_model}"
                                       f" x {p.d_ffn}" + (f" ({source})" if source else ""))
            built.append((name, PackedExpertsModule(p, layout, source)))
    except BaseException:
        built.clear()  # the handles go with the modules
        raise
    for name, new in built:
        model.set_submodule(name, new)
    return [n for n, _ in built]
