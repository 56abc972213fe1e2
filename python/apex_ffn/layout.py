"""What a transformers experts module computes, read from its flags and
checked against the library's expert kinds.

transformers' experts interface (integrations/moe.py) describes a module by
flags: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``,
``has_post_expert_norm``, ``_is_expert_parallel``, and by its activation
(``act_fn`` through the default ``_apply_gate``, or a class's own
``_apply_gate``). The library has two gated kinds: SiLU(G) ⊙ U (SwiGLU) and
gpt-oss's clamped (clamp(U, −L, L) + 1) ⊙ Ĝ·σ(αĜ). The activation is checked
by evaluating the module's own on probe values against each kind, so a
class whose gate looks alike but computes something else is refused, by
name, instead of being run as one.
"""
import torch

from . import _core

_PROBE = None


def _probe(width):
    g = torch.Generator().manual_seed(1234)
    return torch.linspace(-12.0, 12.0, 2 * width).reshape(1, 2 * width) + 0.1 * torch.randn(1, 2 * width, generator=g)


def _silu_concatenated(h):
    g, u = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def _clamped(h, alpha, limit, interleaved):
    g, u = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def _close(a, b):
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)


class ExpertsLayout:
    """The flags of one experts module as the extension takes them."""

    def __init__(self, gate, transposed, interleaved, has_bias, alpha, limit, expert_parallel):
        self.gate, self.transposed, self.interleaved = gate, transposed, interleaved
        self.has_bias, self.alpha, self.limit, self.expert_parallel = has_bias, alpha, limit, expert_parallel

    def __repr__(self):
        return (f"ExpertsLayout(gate={self.gate!r}, transposed={self.transposed}, interleaved={self.interleaved}, "
                f"has_bias={self.has_bias}, alpha={self.alpha}, limit={self.limit}, "
                f"expert_parallel={self.expert_parallel})")


def _refuse(module, what):
    raise _core.ConfigError(f"apex_ffn: {type(module).__name__}: {what}; the library's expert kinds are SiLU-gated "
                            "SwiGLU and gpt-oss's clamped SwiGLU")


def experts_layout(module):
    """The ExpertsLayout of a transformers experts module (ConfigError naming what the library lacks)."""
    name = type(module).__name__
    if not hasattr(module, "has_gate"):
        raise _core.ConfigError(f"apex_ffn: {name} is not an experts module of transformers' experts interface "
                                "(no has_gate flag: the class is not decorated with @use_experts_implementation)")
    if not module.has_gate:
        _refuse(module, "experts without a gate (has_gate=False: up_proj, activation, down_proj) are not supported")
    if getattr(module, "has_post_expert_norm", False):
        _refuse(module, "a norm after each expert (has_post_expert_norm=True) is not supported")
    for t in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(module, t, None), torch.Tensor):
            _refuse(module, f"the module has no 3-D tensor '{t}'")
    transposed = bool(module.is_transposed)
    interleaved = not bool(getattr(module, "is_concatenated", True))
    has_bias = bool(module.has_bias)
    gu = module.gate_up_proj
    f = (gu.shape[2] if transposed else gu.shape[1]) // 2
    width = min(f, 64)
    h = _probe(width)
    with torch.no_grad():
        try:
            got = module._apply_gate(h.clone())
        except Exception as e:  # a gate that cannot run on probe values is not one of ours
            _refuse(module, f"its _apply_gate raised {type(e).__name__}: {e}")
    alpha = float(getattr(module, "alpha", 1.702))
    limit = float(getattr(module, "limit", 7.0))
    if not interleaved and _close(got, _silu_concatenated(h)):
        gate = "silu"
    elif hasattr(module, "alpha") and hasattr(module, "limit") and _close(got, _clamped(h, alpha, limit, interleaved)):
        gate = "clamped"
    else:
        act = getattr(module, "act_fn", None)
        act_name = type(act).__name__ if act is not None else "its own _apply_gate"
        hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
        _refuse(module, f"its gated activation ({act_name}{', hidden_act=' + repr(hidden_act) if hidden_act else ''}"
                        f"{', interleaved gate/up' if interleaved else ''}) is not one the library has")
    if gate == "silu" and has_bias:
        pass  # the float experts take biases with any gate; packed SiLU experts have none (checked there)
    return ExpertsLayout(gate, transposed, interleaved, has_bias, alpha, limit,
                         bool(getattr(module, "_is_expert_parallel", False)))


# What experts_layout reads from a module's own attributes (besides the weights, whose shapes the operations
# check on every call): the flags, gpt-oss's alpha and limit, the activation and a gate of the module's own.
_READ = ("has_gate", "has_post_expert_norm", "is_transposed", "is_concatenated", "has_bias", "alpha", "limit",
         "act_fn", "_apply_gate")


def _layout_key(module):
    """The attributes experts_layout reads, as cheaply as they can be read on every call: the module's own
    (transformers' decorator sets the flags on each instance), its act_fn among its submodules, and its class
    with the class's _apply_gate. Compared by identity, then equality: an attribute replaced (act_fn = GELU(),
    a flag set) changes the key. Not seen: a flag a class of its own declares, changed on the class, and an
    activation module changed in place (torch's SiLU has nothing to change; gpt-oss's clamped gate reads alpha
    and limit from the module, which the key holds): replace such a module's act_fn rather than edit it."""
    d, c = module.__dict__, type(module)
    return (c, getattr(c, "_apply_gate", None), d["_modules"].get("act_fn"), *map(d.get, _READ))


def cached_layout(module):
    """experts_layout, computed again only when an attribute it reads has changed (see _layout_key): a
    module whose act_fn or flags are changed after its first call runs as it now is, or is refused."""
    key = _layout_key(module)
    cached = module.__dict__.get("_apex_ffn_layout")
    if cached is None or cached[0] != key:
        cached = (key, experts_layout(module))
        module.__dict__["_apex_ffn_layout"] = cached
    layout = cached[1]
    layout.expert_parallel = bool(getattr(module, "_is_expert_parallel", False))
    return layout
