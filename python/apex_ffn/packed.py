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

save_pretrained of a packed model writes its experts as the float model's
tensors, dequantized, so the folder loads as the float model; its state_dict
holds them only within experts_as_float(model) (apex_ffn.float_export says
why); load_state_dict packs such tensors again.

Inference runs the library's packed forward, which quantizes the activations
as ggml does for the block formats. LoRA adapters on packed experts: see
apex_ffn.lora.
"""
import os
import re

import torch

from . import _core
from ._tensors import plain
from ._threads import check_threads, get_num_threads
from .float_export import experts_as_float, watch_save
from .layout import experts_layout
from .packed_module import PackedExpertsModule

__all__ = ["PackedExpertsModule", "experts_as_float", "experts_modules", "pack_experts", "save_pack_once"]

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


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
    t = [plain(x.detach().to("cpu", torch.float32)) for x in t]
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
    watch_save(model)
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
        t = [None if x is None else plain(x.detach().to("cpu", torch.float32)) for x in (router.weight, bias)]
        jobs[path] = (name, m.packed, t[0], t[1], _top_k(model, router, m.num_experts))
    os.makedirs(folder, exist_ok=True)
    for path, (_, packed, weight, bias, top_k) in jobs.items():
        _core.save_pack_once(packed, path, weight, bias, top_k)
    return list(jobs)
