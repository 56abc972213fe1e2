"""A packed experts module's weights as the float module's tensors, both ways.

``gate_up_proj`` and ``down_proj`` (and gpt-oss's ``gate_up_proj_bias`` and ``down_proj_bias``) under the
float module's names, in its layout, each weight the value the kernels multiply by (a block format's
ggml-dequantized value) in float32, rounded to the module's dtype when that is another. What a state dict
holds of them, and when: apex_ffn.float_export; load_state_dict packs such tensors when it is given them.
"""
import torch

from . import _core, ops
from ._tensors import plain
from ._threads import check_threads, get_num_threads

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
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise _core.ConfigError(f"apex_ffn.PackedExpertsModule.float_weights: argument 'dtype': expected a float "
                                f"dtype, got {dtype}")
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


def save_to_state_dict(m, destination, prefix):
    """Module `m`'s experts into a state dict, as float tensors, inside apex_ffn.float_export.experts_as_float
    (or save_pretrained); nothing otherwise (the packed experts are not float weights to hand out)."""
    if m.__dict__.get("_apex_ffn_float_export"):
        destination.update({prefix + n: t for n, t in float_weights(m).items()})


def load_from_state_dict(m, state_dict, prefix, local_metadata, error_msgs):
    """Module `m`'s part of load_state_dict: its float tensors packed when the state dict has them (all of them
    or none: a partial set or a refused tensor is an error message, as torch reports a size mismatch; with
    assign=True the module's dtype becomes theirs, as the parameters' do), nothing when it has none (a packed
    model's own state dict holds no experts). Returns the state dict without them, for nn.Module's part."""
    keys = {prefix + n: n for n in weight_shapes(m)}
    given = {n: state_dict[k] for k, n in keys.items() if k in state_dict}
    if not given:
        return state_dict
    try:
        if len(given) != len(keys):
            raise _core.ConfigError(f"gives {sorted(given)} without {sorted(set(keys.values()) - set(given))}: "
                                    "packed experts are loaded from all their tensors at once")
        load_float_weights(m, given)
        if local_metadata.get("assign_to_params_buffers", False):
            m.weight_dtype = given["gate_up_proj"].dtype
    except (_core.ShapeError, _core.ConfigError, _core.ValueError) as e:
        error_msgs.append(f"{prefix.rstrip('.') or 'the module'}: {e}")
    return {k: v for k, v in state_dict.items() if k not in keys}
