"""A packed experts module's weights as the float module's tensors, both ways, and its state dict on them.

The state dict of a PackedExpertsModule holds ``gate_up_proj`` and ``down_proj`` (and gpt-oss's
``gate_up_proj_bias`` and ``down_proj_bias``) under the float module's names, in its layout and dtype,
each weight the value the kernels multiply by: a block format's ggml-dequantized value. So
``save_pretrained`` of a packed model writes a folder that ``from_pretrained`` loads as the float model, and
``load_state_dict`` packs such tensors again in the module's storage types.

The export holds a block's E·3·d·f weights in float at once, and the state dict all blocks': a model with
packed experts checks, before the first is dequantized, that they fit in physical memory beside the model
(``check_export_fits``, the library's rule for what it allocates: ConfigError naming the bytes, unless
APEX_FFN_ALLOW_OVERCOMMIT=1).
"""
import os

import torch

from . import _core, ops
from ._tensors import plain
from ._threads import check_threads, get_num_threads

_ALLOW_OVERCOMMIT = "APEX_FFN_ALLOW_OVERCOMMIT"
_STAGING_BYTES = 64 << 20  # float32 staging of an export to another dtype, at most (one expert at least)


def weight_shapes(m):
    """{name: shape} of the float module's expert tensors: gate_up_proj and down_proj, (E, 2f, d) and (E, d, f),
    or (E, d, 2f) and (E, f, d) transposed; with biases, gate_up_proj_bias (E, 2f) and down_proj_bias (E, d),
    in the order of gpt-oss's parameters."""
    e, d, f = m.num_experts, m.hidden_dim, m.intermediate_dim
    gate_up, down = ((e, d, 2 * f), (e, f, d)) if m.layout.transposed else ((e, 2 * f, d), (e, d, f))
    if not m.layout.has_bias:
        return {"gate_up_proj": gate_up, "down_proj": down}
    return {"gate_up_proj": gate_up, "gate_up_proj_bias": (e, 2 * f), "down_proj": down, "down_proj_bias": (e, d)}


def float_weights(m, dtype=None, threads=None):
    """The experts of module `m` as the float module's tensors (weight_shapes: names, shapes, layout), new
    tensors in `dtype` (the float module's by default): each weight the value the kernels multiply by, which
    for a block format is its dequantized value, so a float model given these computes what the packed one
    does up to the activations' quantization."""
    check_threads("apex_ffn.PackedExpertsModule.float_weights: argument 'threads'", threads)
    threads = get_num_threads() if threads is None else threads
    dtype = m.weight_dtype if dtype is None else dtype
    out = {n: torch.empty(s, dtype=dtype) for n, s in weight_shapes(m).items()}
    # another dtype: float32 a few experts at a time, so the export holds little beyond its own tensors
    step = m.num_experts if dtype == torch.float32 else max(1, _STAGING_BYTES // (12 * m.hidden_dim * m.intermediate_dim))
    for first in range(0, m.num_experts, step):
        part = {n: t[first:first + step] for n, t in out.items()}
        if dtype != torch.float32:
            part = {n: torch.empty(t.shape, dtype=torch.float32) for n, t in part.items()}
        m.packed.to_float(part["gate_up_proj"], part["down_proj"], part.get("gate_up_proj_bias"),
                          part.get("down_proj_bias"), m.layout.transposed, m.layout.interleaved, first, threads)
        if dtype != torch.float32:
            for n, t in part.items():
                out[n][first:first + step] = t
    return out


def load_float_weights(m, tensors, threads=None):
    """Packs the float module's tensors `tensors` ({name: tensor}, every name of weight_shapes, any float dtype
    and device) in module `m`'s storage types and puts them in place of its experts (a block format quantized
    as pack_experts quantizes). Graphs holding the module's handle run on the new experts; a module mapped
    from a file no longer reads it. Errors (ShapeError, ConfigError) leave it as it was."""
    where = "apex_ffn.PackedExpertsModule.load_float_weights"
    shapes = weight_shapes(m)
    if set(tensors) != set(shapes):
        raise _core.ConfigError(f"{where}: expected the tensors {sorted(shapes)}, got {sorted(tensors)}")
    for n, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shapes[n]:
            got = f"shape {tuple(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _core.ShapeError(f"{where}: '{n}' has {got}, expected a float tensor of shape {shapes[n]}")
        if t.device.type == "meta":
            raise _core.ConfigError(f"{where}: '{n}' has no values (a meta tensor)")
    check_threads(f"{where}: argument 'threads'", threads)
    t = {n: plain(x.detach().to("cpu", torch.float32)) for n, x in tensors.items()}
    lay = m.layout
    p = _core.PackedExperts.from_float(t["gate_up_proj"], t["down_proj"], t.get("gate_up_proj_bias"),
                                       t.get("down_proj_bias"), lay.gate, lay.transposed, lay.interleaved, lay.alpha,
                                       lay.limit, m.packed.types, get_num_threads() if threads is None else threads)
    ops.replace_packed(m.handle, p)
    m.packed, m.source = p, ""


def load_from_state_dict(m, state_dict, prefix, strict, missing_keys, error_msgs):
    """Module `m`'s part of load_state_dict: its float tensors packed (all of them or none: a partial set or a
    refused tensor is an error message, as torch reports a size mismatch), or their names missing when none is
    given and `strict`. Returns the state dict without them, for nn.Module's own part."""
    keys = {prefix + n: n for n in weight_shapes(m)}
    given = {n: state_dict[k] for k, n in keys.items() if k in state_dict}
    if not given:
        if strict:
            missing_keys.extend(keys)
        return state_dict
    try:
        if len(given) != len(keys):
            raise _core.ConfigError(f"gives {sorted(given)} without {sorted(set(keys.values()) - set(given))}: "
                                    "packed experts are loaded from all their tensors at once")
        load_float_weights(m, given)
    except (_core.ShapeError, _core.ConfigError, _core.ValueError) as e:
        error_msgs.append(f"{prefix or 'the module'}: {e}")
    return {k: v for k, v in state_dict.items() if k not in keys}


def export_bytes(m):
    """Bytes module `m`'s experts take as float tensors of its dtype (the float32 staging aside: _STAGING_BYTES)."""
    per = torch.empty(0, dtype=m.weight_dtype).element_size()
    return sum(per * torch.Size(s).numel() for s in weight_shapes(m).values())


def physical_memory():
    """Bytes of physical memory (0: unknown), as the library's check_memory_fit reads it."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _gb(n):
    return f"{n / 1e9:.2f} GB ({n} bytes)"


def check_export_fits(model, prefix="", keep_vars=False):
    """state_dict pre-hook of a model with packed experts (pack_experts registers it): ConfigError before any
    expert is dequantized when their float tensors and what the model holds already exceed physical memory."""
    if os.environ.get(_ALLOW_OVERCOMMIT) == "1":
        return
    from .packed_module import PackedExpertsModule
    packed = [m for m in model.modules() if isinstance(m, PackedExpertsModule)]
    export = sum(export_bytes(m) for m in packed)
    held = sum(m.packed.nbytes for m in packed if not m.packed.mapped)
    held += sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()) if t.device.type == "cpu")
    available = physical_memory()
    if available and export + held > available:
        raise _core.ConfigError(
            f"apex_ffn: the state dict of {type(model).__name__} holds its packed experts as float tensors: "
            f"{_gb(export)} beside the {_gb(held)} the model holds, the machine has {_gb(available)} of physical "
            f"memory; keep the packed experts with apex_ffn.packed.save_pack_once (and adapters with "
            f"apex_ffn.lora.save_peft), or set {_ALLOW_OVERCOMMIT}=1 to export them anyway")


def watch_export(model):
    """Registers check_export_fits on `model` once."""
    if not model.__dict__.get("_apex_ffn_export_checked"):
        model.register_state_dict_pre_hook(check_export_fits)
        model.__dict__["_apex_ffn_export_checked"] = True
