"""Packed experts in a transformers model.

    import apex_ffn.packed as P
    P.pack_experts(model, "q4_k")                       # quantized by the library from the model's weights
    P.pack_experts(model, gguf="Qwen3-30B-A3B-Q4_K_M.gguf")  # the file's blocks, never dequantized
    P.save_pack_once(model, "packed/")                  # the packed experts as pack-once files, once
    P.pack_experts(model, pack_once="packed/")          # later: mapped in place, nothing read or copied

replaces every experts module of the model (a module named ``*.experts``
of transformers' experts interface) with a PackedExpertsModule holding its
experts in one of the library's storage types (``apex_ffn.storage_types()``;
``"q4_k/q6_k"`` gives gate_up and down their own). The model's float expert
weights are dropped with the modules they belonged to. From a GGUF file, the
model may be meta-initialised: the experts come from the file (block i of the
file for ``…layers.i…``), moved into the library's panels as they are.
From a folder of pack-once files (save_pack_once), likewise: the experts are
views into the mapped files, in the files' types.

Every module is packed (and checked against the file) before the first one
is swapped in, so an error leaves the model as it was.

A packed module's state dict holds its experts as the float module's tensors,
dequantized (PackedExpertsModule.float_weights), so save_pretrained writes a
folder the float model loads; load_state_dict packs such tensors again.

Inference runs the library's packed forward, which quantizes the activations
as ggml does for the block formats. LoRA adapters on packed experts: see
apex_ffn.lora.
"""
import copy
import os
import re

import torch
from torch import nn

from . import _core, ops
from ._threads import check_threads, get_num_threads
from .layout import experts_layout

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


# Looked up once: at decode every step's first Python runs from cold caches, where each lookup and frame
# costs microseconds. is_dynamo_compiling, not is_compiling: one frame, not two, and the same answer where
# it matters (dynamo must not trace the extension's call; torch.export without dynamo passes fake tensors,
# which infer declines).
_grad_enabled = torch.is_grad_enabled
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _float32(t):
    """t as contiguous float32; t itself when it is, without a call into torch's dispatcher (at decode,
    after a step has left the interpreter's caches cold, each such call costs microseconds)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() and not t.is_neg() else _plain(t.float())


def _int64(t):
    return t if t.dtype == torch.int64 and t.is_contiguous() and not t.is_neg() else _plain(t.long())


def _plain(t):
    """t contiguous with its negative bit resolved: DLPack hands over a lazily negated view's memory as it
    is, un-negated (such views come from e.g. z.conj().imag)."""
    return t.resolve_neg().contiguous()


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

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.lora is None and not _grad_enabled() and not _dynamo_compiling():
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
        if self.lora is not None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            # through torch's dispatcher (custom ops): torch.compile traces these casts, and the dispatcher
            # resolves a lazily negated view before the op's body sees it
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
            x, w, ids = _float32(hidden_states), _float32(top_k_weights), _int64(top_k_index)
            y = ops.packed_forward(x, ids, w, self.handle, ep, bf16)
        return y if dtype == torch.float32 else y.to(dtype)

    def weight_shapes(self):
        """{name: shape} of the float module's expert tensors: gate_up_proj and down_proj, (E, 2f, d) and
        (E, d, f), or (E, d, 2f) and (E, f, d) transposed; with biases, gate_up_proj_bias (E, 2f) and
        down_proj_bias (E, d)."""
        e, d, f = self.num_experts, self.hidden_dim, self.intermediate_dim
        t = self.layout.transposed
        gate_up, down = ((e, d, 2 * f), (e, f, d)) if t else ((e, 2 * f, d), (e, d, f))
        if not self.layout.has_bias:
            return {"gate_up_proj": gate_up, "down_proj": down}
        # the order of gpt-oss's parameters
        return {"gate_up_proj": gate_up, "gate_up_proj_bias": (e, 2 * f), "down_proj": down, "down_proj_bias": (e, d)}

    def float_weights(self, dtype=None, threads=None):
        """The experts as the float module's tensors (weight_shapes: its names, shapes and layout), new tensors
        in `dtype` (the float module's by default): each weight the value the kernels multiply by, which for a
        block format is its dequantized value, so a float model given these computes what the packed one does
        up to the activations' quantization. Holds the block's E·3·d·f weights in float at once."""
        check_threads("apex_ffn.PackedExpertsModule.float_weights: argument 'threads'", threads)
        threads = get_num_threads() if threads is None else threads
        out = {n: torch.empty(s, dtype=torch.float32) for n, s in self.weight_shapes().items()}
        self.packed.to_float(out["gate_up_proj"], out["down_proj"], out.get("gate_up_proj_bias"),
                             out.get("down_proj_bias"), self.layout.transposed, self.layout.interleaved, threads)
        dtype = self.weight_dtype if dtype is None else dtype
        return {n: t if dtype == torch.float32 else t.to(dtype) for n, t in out.items()}

    def load_float_weights(self, tensors, threads=None):
        """Packs the float module's tensors `tensors` ({name: tensor}, every name of weight_shapes, in any float
        dtype and device) in this module's storage types and puts them in place of its experts (for a block
        format: quantized as pack_experts quantizes). Graphs holding the module's handle run on the new experts;
        a module mapped from a file no longer reads it. Errors (ShapeError, ConfigError) leave it as it was."""
        where = "apex_ffn.PackedExpertsModule.load_float_weights"
        shapes = self.weight_shapes()
        if set(tensors) != set(shapes):
            raise _core.ConfigError(f"{where}: expected the tensors {sorted(shapes)}, got {sorted(tensors)}")
        for n, t in tensors.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shapes[n]:
                got = f"shape {tuple(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise _core.ShapeError(f"{where}: '{n}' has {got}, expected a float tensor of shape {shapes[n]}")
            if t.device.type == "meta":
                raise _core.ConfigError(f"{where}: '{n}' has no values (a meta tensor)")
        check_threads(f"{where}: argument 'threads'", threads)
        t = {n: _plain(x.detach().to("cpu", torch.float32)) for n, x in tensors.items()}
        lay = self.layout
        p = _core.PackedExperts.from_float(t["gate_up_proj"], t["down_proj"], t.get("gate_up_proj_bias"),
                                           t.get("down_proj_bias"), lay.gate, lay.transposed, lay.interleaved,
                                           lay.alpha, lay.limit, self.packed.types,
                                           get_num_threads() if threads is None else threads)
        ops.replace_packed(self.handle, p)
        self.packed, self.source = p, ""

    def _apply(self, fn, *args, **kwargs):
        """model.to(dtype), .half(), .bfloat16(): the float module's dtype follows, so the state dict's tensors
        are of the model's dtype (the packed experts keep their storage types)."""
        probe = fn(torch.empty(0, dtype=self.weight_dtype))
        if isinstance(probe, torch.Tensor) and probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The state dict holds the experts as the float module's tensors (float_weights), so save_pretrained
        writes a folder the float model loads, with the weights the packed one ran on."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n, t in self.float_weights().items():
            destination[prefix + n] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """load_state_dict packs the float module's tensors (load_float_weights); all of them or none."""
        keys = {prefix + n: n for n in self.weight_shapes()}
        given = {n: state_dict[k] for k, n in keys.items() if k in state_dict}
        if given:
            try:
                if len(given) != len(keys):
                    raise _core.ConfigError(f"gives {sorted(given)} without {sorted(set(keys.values()) - set(given))}:"
                                            " packed experts are loaded from all their tensors at once")
                self.load_float_weights(given)
            except (_core.ShapeError, _core.ConfigError, _core.ValueError) as e:
                error_msgs.append(f"{prefix or 'the module'}: {e}")
            state_dict = {k: v for k, v in state_dict.items() if k not in keys}
        elif strict:
            missing_keys.extend(keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __reduce_ex__(self, protocol):
        raise TypeError("apex_ffn.PackedExpertsModule cannot be pickled (its experts are packed by the extension): "
                        "save the model's state_dict (the experts as float tensors) or the packed experts with "
                        "apex_ffn.packed.save_pack_once")

    def __copy__(self):
        """A shallow copy: like nn.Module's, it shares what the module holds (the packed weights, never written,
        the layout, and the LoRA adapters when attached: the same ExpertsLora and parameters, so training either
        trains both), but it holds a registry handle of its own, so that each keeps working when the other is
        collected (the module's handle is released with it). Its containers of submodules, parameters, buffers
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


def experts_modules(model):
    """(name, module) of every experts module of transformers' experts interface in `model`."""
    return [(n, m) for n, m in model.named_modules() if n.split(".")[-1] == "experts" and hasattr(m, "has_gate")]


def _layer_of(name, fn="pack_experts", what="GGUF block"):
    m = _LAYER.search(name)
    if not m:
        raise _core.ConfigError(f"apex_ffn.{fn}: the module name '{name}' has no layer index "
                                f"(…layers.<i>…), so its {what} is unknown")
    return int(m.group(1))


def _block_file(folder, name, fn):
    """The pack-once file of experts module `name` in `folder`: block-<i>.safetensors for …layers.<i>…"""
    return os.path.join(os.fspath(folder), f"block-{_layer_of(name, fn, 'pack-once file')}.safetensors")


def _router_of(model, name, experts, e, d, fn):
    """The router beside experts module `name`: the one sibling with a weight of E × d, and its bias (or None).
    ConfigError when there is none or more than one (the file's shape records whether the router has a bias)."""
    block = name.rpartition(".")[0]
    parent = model.get_submodule(block)
    found = [(f"{block}.{n}" if block else n, m) for n, m in parent.named_children() if m is not experts
             and isinstance(getattr(m, "weight", None), torch.Tensor) and tuple(m.weight.shape) == (e, d)]
    if len(found) != 1:
        raise _core.ConfigError(f"apex_ffn.{fn}: {name}: {len(found)} router modules beside the experts (siblings "
                                f"with a weight of {e} x {d}: {[n for n, _ in found]}); the file needs exactly one")
    router = found[0][1]
    bias = getattr(router, "bias", None)
    return found[0][0], router, bias if isinstance(bias, torch.Tensor) else None


def _top_k(model, router, e):
    """Experts a token of the block (the file's config records it; its shape does not depend on it)."""
    for holder, key in ((router, "top_k"), (getattr(model, "config", None), "num_experts_per_tok")):
        k = getattr(holder, key, None)
        if isinstance(k, int) and 1 <= k <= e:
            return k
    return 1


def _from_float(name, module, layout, types, threads):
    t = [module.gate_up_proj, module.down_proj]
    if layout.has_bias:
        t += [module.gate_up_proj_bias, module.down_proj_bias]
    if any(x.device.type == "meta" for x in t):
        raise _core.ConfigError(f"apex_ffn.pack_experts: {name} has no weights (a meta-initialised model): "
                                "pack it from a GGUF file (gguf=...)")
    t = [_plain(x.detach().to("cpu", torch.float32)) for x in t]
    return _core.PackedExperts.from_float(t[0], t[1], t[2] if layout.has_bias else None,
                                          t[3] if layout.has_bias else None, layout.gate, layout.transposed,
                                          layout.interleaved, layout.alpha, layout.limit, types, threads)


def _expected_shape(module, layout):
    gu = module.gate_up_proj
    e = gu.shape[0]
    h, two_f = (gu.shape[1], gu.shape[2]) if layout.transposed else (gu.shape[2], gu.shape[1])
    return e, h, two_f // 2


def _map_block(model, name, module, layout, folder):
    """The experts of module `name` mapped from its pack-once file in `folder`; errors name the module."""
    e, d, f = _expected_shape(module, layout)
    path = _block_file(folder, name, "pack_experts")
    _, router, bias = _router_of(model, name, module, e, d, "pack_experts")
    try:
        p = _core.map_pack_once(path, e, d, f, _top_k(model, router, e), bias is not None, layout.gate, layout.alpha,
                                layout.limit)
    except (_core.FormatError, _core.ShapeError, _core.ConfigError) as err:
        raise type(err)(f"apex_ffn.pack_experts: {name}: {err}") from None
    return p, path


def _packed_block(model, name, module, layout, types, file, folder, threads):
    """(PackedExperts, source) of one experts module from the source pack_experts was given."""
    if folder is not None:
        return _map_block(model, name, module, layout, folder)
    if file is not None:
        return (_core.packed_from_gguf(file, _layer_of(name), layout.gate),
                f"{file.description}, block {_layer_of(name)}")
    return _from_float(name, module, layout, types, threads), ""


def pack_experts(model, types=None, gguf=None, threads=None, pack_once=None):
    """Replaces every experts module of `model` with a PackedExpertsModule (see the module comment):
    from the model's weights in storage type `types`, from the GGUF file `gguf` (a path) in the file's
    types, or from the folder `pack_once` that save_pack_once wrote (block-<i>.safetensors for …layers.<i>…),
    whose experts stay in the mapped files: no expert byte is read or copied at load, the pages come in when
    a forward first touches them, and the files must not be changed while the model uses them. Each file
    is checked against its module (experts, widths, gate kind, router bias: FormatError naming the file and
    module). Returns the names of the replaced modules. Nothing is replaced when anything fails."""
    if sum(x is not None for x in (types, gguf, pack_once)) != 1:
        raise _core.ConfigError("apex_ffn.pack_experts: give either types (pack the model's weights), pack_once "
                                "(save_pack_once's folder) or gguf (a GGUF file's experts): exactly one")
    found = experts_modules(model)
    if not found:
        raise _core.ConfigError(f"apex_ffn.pack_experts: {type(model).__name__} has no experts module of "
                                "transformers' experts interface (…experts with has_gate)")
    if pack_once is not None and not os.path.isdir(pack_once):
        raise _core.FormatError(f"apex_ffn.pack_experts: the pack-once folder '{os.fspath(pack_once)}' does not "
                                "exist or is not a folder (save_pack_once writes it)")
    check_threads("apex_ffn.pack_experts: argument 'threads'", threads)  # 0 or -1 would run on one thread
    threads = get_num_threads() if threads is None else threads
    file = _core.GgufFile.open(str(gguf)) if gguf is not None else None
    built = []
    try:
        for name, module in found:
            layout = experts_layout(module)
            layout.expert_parallel = bool(getattr(module, "_is_expert_parallel", False))
            p, source = _packed_block(model, name, module, layout, types, file, pack_once, threads)
            want = _expected_shape(module, layout)
            if (p.experts, p.d_model, p.d_ffn) != want:
                raise _core.ShapeError(f"apex_ffn.pack_experts: {name} has {want[0]} experts of {want[1]} x {want[2]}"
                                       f" (experts, hidden, intermediate), the packed ones {p.experts} x {p.d_model}"
                                       f" x {p.d_ffn}" + (f" ({source})" if source else ""))
            built.append((name, PackedExpertsModule(p, layout, source, module.gate_up_proj.dtype)))
    except BaseException:
        built.clear()  # the handles go with the modules
        raise
    for name, new in built:
        model.set_submodule(name, new)
    return [n for n, _ in built]


def save_pack_once(model, folder):
    """Writes the experts of every PackedExpertsModule of `model` (pack_experts first) to `folder`, one
    pack-once file per MoE block: block-<i>.safetensors for the module …layers.<i>…experts, which
    pack_experts(model, pack_once=folder) maps back without reading the expert bytes.

    Each file is the library's pack-once format (map_packed_moe reads it as a layer): the packed experts in
    their storage types, gpt-oss's biases, and the router beside the experts (its weight, and its bias
    when it has one) in float32. The router and the routing stay the model's; so do a model's shared
    experts, which are not part of the experts module (the file's layer has none). Every module and router
    is checked before the first file is written; each file is written atomically (a temporary file renamed
    over the path), so a failure leaves no half-written file, though files of blocks already written stay.
    Saving copies one block's packed bytes at a time (none when the experts are themselves mapped).
    Returns the paths written."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedExpertsModule)]
    if not found:
        raise _core.ConfigError(f"apex_ffn.save_pack_once: {type(model).__name__} has no packed experts module "
                                "(call pack_experts first)")
    jobs = {}
    for name, m in found:
        path = _block_file(folder, name, "save_pack_once")
        if path in jobs:
            raise _core.ConfigError(f"apex_ffn.save_pack_once: {jobs[path][0]} and {name} are both {path}")
        rname, router, bias = _router_of(model, name, m, m.num_experts, m.hidden_dim, "save_pack_once")
        if any(t is not None and t.device.type == "meta" for t in (router.weight, bias)):
            raise _core.ConfigError(f"apex_ffn.save_pack_once: the router {rname} beside {name} has no weights "
                                    "(a meta-initialised model)")
        t = [None if x is None else _plain(x.detach().to("cpu", torch.float32)) for x in (router.weight, bias)]
        jobs[path] = (name, m.packed, t[0], t[1], _top_k(model, router, m.num_experts))
    os.makedirs(folder, exist_ok=True)
    for path, (_, packed, weight, bias, top_k) in jobs.items():
        _core.save_pack_once(packed, path, weight, bias, top_k)
    return list(jobs)
