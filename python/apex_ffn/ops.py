"""The library's routed experts as torch.library custom operators.

Each forward is an op whose outputs include what its backward reads (the
experts' outputs in plan order, ``y_sorted``, and the work rows); the
backward is an op of its own (so ``torch.compile`` traces both), registered
with ``register_autograd``, and every op has a ``register_fake`` for
tracing. The computation is the C++ extension's (``apex_ffn._core``, no
libtorch link): tensors pass by DLPack, outputs are allocated here and
written there, the GIL is released while it computes.

    apex_ffn::float_experts              float experts on a module's own tensors
    apex_ffn::float_experts_backward     ∂L/∂x, ∂L/∂g, ∂L/∂W (and biases)
    apex_ffn::packed_experts             packed experts, inference (activations quantized as ggml does)
    apex_ffn::packed_experts_train       packed experts with LoRA adapters (or none), exact activations
    apex_ffn::packed_experts_train_backward  ∂L/∂x, ∂L/∂g, ∂L/∂A, ∂L/∂B

Packed experts are held by the extension; an op names them by a handle
(``register_packed``), an int the ops look up.
"""
import atexit
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._threads import get_num_threads

_PACKED = {}
_NEXT = [1]
_KEPT = set()  # the handles _Kept holds


def _release_kept():
    """At the interpreter's exit, before the extension counts its objects: the experts autograd graphs still
    alive then keep (_Kept) would otherwise be freed after, reported as leaked."""
    for h in list(_KEPT):
        _PACKED.pop(h, None)


atexit.register(_release_kept)


def register_packed(packed):
    """A handle for `packed` (an _core.PackedExperts) that the ops can take."""
    h = _NEXT[0]
    _NEXT[0] += 1
    _PACKED[h] = packed
    return h


def release_packed(handle):
    _PACKED.pop(handle, None)


def replace_packed(handle, packed):
    """Puts `packed` under an existing handle (a module's experts loaded anew): graphs that hold the handle,
    compiled ones among them, run on the new experts."""
    packed_of(handle)  # ConfigError for a released handle
    _PACKED[handle] = packed


def packed_of(handle):
    try:
        return _PACKED[handle]
    except KeyError:
        raise _core.ConfigError(f"apex_ffn: no packed experts with handle {handle} (released?)") from None


# torch.func's wrapped tensors (vmap's batched, grad's and jvp's levels, functionalize's) look like plain CPU
# tensors to Python
_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


def _cpu(op, **tensors):
    """ValueError naming the op and argument for a tensor on another device (the C++ side checks again), or one
    a torch.func transform wrapped: the ops have no rules for those transforms, and such a tensor has no memory
    of its own to hand over (the extension would reject it with a signature mismatch naming nothing)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_cpu:
            raise _core.ValueError(f"apex_ffn::{op}: argument '{name}' is on {t.device}; apex_ffn computes on CPU "
                                   "tensors: move it with .cpu()")
        if _functorch_wrapped(t):
            raise _core.ValueError(f"apex_ffn::{op}: argument '{name}' is a tensor of a torch.func transform (vmap, "
                                   "grad, jvp, functionalize, ...), which has no memory of its own and which "
                                   "apex_ffn's ops do not support: call them outside it")


def _one_device(op, x, **tensors):
    """ValueError naming the op and argument for tensors on other devices than hidden_states. The fake
    implementations need it: torch's dispatcher runs them, not the op's body, when any argument is a meta tensor,
    and their outputs follow hidden_states' device, so CPU hidden states with meta weights would come back as
    uninitialised CPU tensors, as if computed."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise _core.ValueError(f"apex_ffn::{op}: argument '{name}' is on {t.device} and 'hidden_states' on "
                                   f"{x.device}; apex_ffn computes on CPU tensors: move them with .cpu()")


def _dims(op, **tensors):
    """ShapeError naming the op and argument for a tensor without the dimensions the op reads its shapes from
    (checked before those reads, which would otherwise fail with an unpacking error naming nothing)."""
    for name, (t, dims) in tensors.items():
        if t is not None and t.dim() != dims:
            raise _core.ShapeError(f"apex_ffn::{op}: argument '{name}' has {t.dim()} dimensions, expected {dims}")


def check_routed_dtypes(where, hidden_states, top_k_index, top_k_weights):
    """ValueError unless the hidden states and routing weights are floating point and the expert ids integers:
    the experts modules cast what they are given to float32 and int64, which would truncate float ids (1.7 is
    expert 1), read booleans as ids 0 and 1 and drop a complex input's imaginary part without a word."""
    for name, t in (("hidden_states", hidden_states), ("top_k_weights", top_k_weights)):
        if not t.is_floating_point():
            raise _core.ValueError(f"{where}: argument '{name}' has dtype {t.dtype}, expected a floating-point dtype")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise _core.ValueError(f"{where}: argument 'top_k_index' has dtype {top_k_index.dtype}, expected an "
                               "integer dtype (expert ids)")


def _empty(*shape, like):
    return torch.empty(*shape, dtype=torch.float32, device=like.device)


def _none_if_empty(t):
    return None if t is None or t.numel() == 0 and t.dim() == 1 else t


# --- float experts ---------------------------------------------------------

def _bias_grads(bias_grads, gate_up_bias, down_bias):
    """ConfigError naming the missing bias when bias gradients are asked of experts without it (checked before
    the gradients are allocated like the biases, which would fail on None with a TypeError naming nothing)."""
    if bias_grads:
        for name, t in (("gate_up_proj_bias", gate_up_bias), ("down_proj_bias", down_bias)):
            if t is None:
                raise _core.ConfigError(f"apex_ffn::float_experts_backward: bias_grads is True but argument "
                                        f"'{name}' is None: bias gradients need both biases")


def _float_dims(x, top_k_index, gate_up):
    _dims("float_experts", hidden_states=(x, 2), top_k_index=(top_k_index, 2), gate_up_proj=(gate_up, 3))


@torch.library.custom_op("apex_ffn::float_experts", mutates_args=())
def float_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                  gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], gate: str, transposed: bool,
                  interleaved: bool, alpha: float, limit: float, expert_parallel: bool
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    _cpu("float_experts", hidden_states=x, top_k_index=top_k_index, top_k_weights=top_k_weights,
         gate_up_proj=gate_up, down_proj=down, gate_up_proj_bias=gate_up_bias, down_proj_bias=down_bias)
    _float_dims(x, top_k_index, gate_up)
    n, d = x.shape
    k = top_k_index.shape[1]
    f = (gate_up.shape[2] if transposed else gate_up.shape[1]) // 2
    y, ys, work = _empty(n, d, like=x), _empty(n * k, d, like=x), _empty(n * k, 3 * f, like=x)
    _core.float_experts(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate, transposed,
                        interleaved, alpha, limit, expert_parallel, y, ys, work, get_num_threads())
    return y, ys, work


@float_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate, transposed, interleaved, alpha,
      limit, expert_parallel):
    _one_device("float_experts", x, top_k_index=top_k_index, top_k_weights=top_k_weights, gate_up_proj=gate_up,
                down_proj=down, gate_up_proj_bias=gate_up_bias, down_proj_bias=down_bias)
    _float_dims(x, top_k_index, gate_up)
    n, d = x.shape
    k = top_k_index.shape[1]
    f = (gate_up.shape[2] if transposed else gate_up.shape[1]) // 2
    return x.new_empty(n, d), x.new_empty(n * k, d), x.new_empty(n * k, 3 * f)


@torch.library.custom_op("apex_ffn::float_experts_backward", mutates_args=())
def float_experts_backward(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                           gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], gate: str,
                           transposed: bool, interleaved: bool, alpha: float, limit: float, expert_parallel: bool,
                           dy: Tensor, y_sorted: Tensor, work: Tensor, weight_grads: bool, bias_grads: bool
                           ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _bias_grads(bias_grads, gate_up_bias, down_bias)
    dx, dw = torch.empty_like(x), torch.empty_like(top_k_weights)
    dgu = torch.empty_like(gate_up) if weight_grads else None
    ddn = torch.empty_like(down) if weight_grads else None
    dgb = torch.empty_like(gate_up_bias) if bias_grads else None
    ddb = torch.empty_like(down_bias) if bias_grads else None
    _core.float_experts_backward(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate,
                                 transposed, interleaved, alpha, limit, expert_parallel, dy, y_sorted, work, dx, dw,
                                 dgu, ddn, dgb, ddb, get_num_threads())
    empty = lambda: x.new_empty(0)  # noqa: E731  (one each: outputs may not alias)
    return dx, dw, dgu if weight_grads else empty(), ddn if weight_grads else empty(), \
        dgb if bias_grads else empty(), ddb if bias_grads else empty()


@float_experts_backward.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate, transposed, interleaved, alpha,
      limit, expert_parallel, dy, y_sorted, work, weight_grads, bias_grads):
    _one_device("float_experts_backward", x, top_k_index=top_k_index, top_k_weights=top_k_weights,
                gate_up_proj=gate_up, down_proj=down, gate_up_proj_bias=gate_up_bias, down_proj_bias=down_bias, dy=dy,
                y_sorted=y_sorted, work=work)
    _bias_grads(bias_grads, gate_up_bias, down_bias)
    empty = lambda: x.new_empty(0)  # noqa: E731
    return (torch.empty_like(x), torch.empty_like(top_k_weights),
            torch.empty_like(gate_up) if weight_grads else empty(), torch.empty_like(down) if weight_grads else empty(),
            torch.empty_like(gate_up_bias) if bias_grads else empty(),
            torch.empty_like(down_bias) if bias_grads else empty())


def _float_setup(ctx, inputs, output):
    x, ids, w, gu, dn, gb, db, gate, transposed, interleaved, alpha, limit, ep = inputs
    _, ys, work = output
    ctx.save_for_backward(x, ids, w, gu, dn, gb, db, ys, work)
    ctx.flags = (gate, transposed, interleaved, alpha, limit, ep)
    ctx.mark_non_differentiable(ys, work)


def _float_backward(ctx, dy, _dys, _dwork):
    x, ids, w, gu, dn, gb, db, ys, work = ctx.saved_tensors
    need = ctx.needs_input_grad
    weight_grads = bool(need[3] or need[4])
    bias_grads = gb is not None and bool(need[5] or need[6])
    dy = dy.contiguous()  # a negated view autograd hands over is resolved by the op's dispatcher
    dx, dw, dgu, ddn, dgb, ddb = float_experts_backward(x, ids, w, gu, dn, gb, db, *ctx.flags, dy, ys, work,
                                                        weight_grads, bias_grads)
    return (dx, None, dw, dgu if weight_grads else None, ddn if weight_grads else None,
            dgb if bias_grads else None, ddb if bias_grads else None, None, None, None, None, None, None)


float_experts.register_autograd(_float_backward, setup_context=_float_setup)


# --- packed experts --------------------------------------------------------

def packed_forward(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, handle: int, expert_parallel: bool,
                   bf16_activations: bool = False) -> Tensor:
    """The packed_experts op's computation without torch's dispatcher: what inference under no_grad calls
    (PackedExpertsModule), where the dispatcher's tens of microseconds are a visible share of a decode step.
    bf16_activations: x holds a bf16 model's values (PackedExperts.forward: bf16 experts then multiply in
    bf16 pairs where the kernel path has them). The experts' outputs in plan order go to the extension's
    scratch: nothing reads them after an inference forward."""
    _cpu("packed_experts", hidden_states=x, top_k_index=top_k_index, top_k_weights=top_k_weights)
    # Called without the dispatcher, which resolves a lazily negated view (e.g. from z.conj().imag) for the ops:
    # DLPack would hand over its memory un-negated, so the values are resolved here.
    if x.is_neg() or top_k_index.is_neg() or top_k_weights.is_neg():
        x, top_k_index, top_k_weights = x.resolve_neg(), top_k_index.resolve_neg(), top_k_weights.resolve_neg()
    p = packed_of(handle)
    y = _empty(*x.shape, like=x)
    p.forward(x, top_k_index, top_k_weights, expert_parallel, y, None, get_num_threads(), bf16_activations)
    return y


@torch.library.custom_op("apex_ffn::packed_experts", mutates_args=())
def packed_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, handle: int, expert_parallel: bool,
                   bf16_activations: bool = False) -> Tensor:
    return packed_forward(x, top_k_index, top_k_weights, handle, expert_parallel, bf16_activations)


@packed_experts.register_fake
def _(x, top_k_index, top_k_weights, handle, expert_parallel, bf16_activations=False):
    _one_device("packed_experts", x, top_k_index=top_k_index, top_k_weights=top_k_weights)
    _dims("packed_experts", hidden_states=(x, 2))
    return x.new_empty(x.shape[0], x.shape[1])


def _no_packed_backward(ctx, dy):
    raise RuntimeError("apex_ffn::packed_experts is the inference forward (activations quantized as ggml does); "
                       "differentiate apex_ffn::packed_experts_train")


packed_experts.register_autograd(_no_packed_backward)


def _train_dims(x, top_k_index, a_gate_up, a_down):
    _dims("packed_experts_train", hidden_states=(x, 2), top_k_index=(top_k_index, 2), a_gate_up=(a_gate_up, 3),
          a_down=(a_down, 3))


@torch.library.custom_op("apex_ffn::packed_experts_train", mutates_args=())
def packed_experts_train(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, a_gate_up: Optional[Tensor],
                         b_gate_up: Optional[Tensor], a_down: Optional[Tensor], b_down: Optional[Tensor],
                         scale: float, handle: int, expert_parallel: bool) -> Tuple[Tensor, Tensor, Tensor]:
    _cpu("packed_experts_train", hidden_states=x, top_k_index=top_k_index, top_k_weights=top_k_weights,
         a_gate_up=a_gate_up, b_gate_up=b_gate_up, a_down=a_down, b_down=b_down)
    p = packed_of(handle)
    _train_dims(x, top_k_index, a_gate_up, a_down)
    n, d = x.shape
    k = top_k_index.shape[1]
    cols = p.train_work_cols(0 if a_gate_up is None else a_gate_up.shape[1], 0 if a_down is None else a_down.shape[1])
    y, ys, work = _empty(n, d, like=x), _empty(n * k, d, like=x), _empty(n * k, cols, like=x)
    p.train_forward(x, top_k_index, top_k_weights, a_gate_up, b_gate_up, a_down, b_down, scale, expert_parallel, y,
                    ys, work, get_num_threads())
    return y, ys, work


@packed_experts_train.register_fake
def _(x, top_k_index, top_k_weights, a_gate_up, b_gate_up, a_down, b_down, scale, handle, expert_parallel):
    _one_device("packed_experts_train", x, top_k_index=top_k_index, top_k_weights=top_k_weights, a_gate_up=a_gate_up,
                b_gate_up=b_gate_up, a_down=a_down, b_down=b_down)
    p = packed_of(handle)
    _train_dims(x, top_k_index, a_gate_up, a_down)
    n, d = x.shape
    k = top_k_index.shape[1]
    cols = p.train_work_cols(0 if a_gate_up is None else a_gate_up.shape[1], 0 if a_down is None else a_down.shape[1])
    return x.new_empty(n, d), x.new_empty(n * k, d), x.new_empty(n * k, cols)


@torch.library.custom_op("apex_ffn::packed_experts_train_backward", mutates_args=())
def packed_experts_train_backward(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, a_gate_up: Optional[Tensor],
                                  b_gate_up: Optional[Tensor], a_down: Optional[Tensor], b_down: Optional[Tensor],
                                  scale: float, handle: int, expert_parallel: bool, dy: Tensor, y_sorted: Tensor,
                                  work: Tensor) -> List[Tensor]:
    p = packed_of(handle)
    dx, dw = torch.empty_like(x), torch.empty_like(top_k_weights)
    grads = [torch.empty_like(t) if t is not None else None for t in (a_gate_up, b_gate_up, a_down, b_down)]
    p.train_backward(x, top_k_index, top_k_weights, a_gate_up, b_gate_up, a_down, b_down, scale, expert_parallel, dy,
                     y_sorted, work, dx, dw, *grads, get_num_threads())
    return [dx, dw] + [g if g is not None else x.new_empty(0) for g in grads]


@packed_experts_train_backward.register_fake
def _(x, top_k_index, top_k_weights, a_gate_up, b_gate_up, a_down, b_down, scale, handle, expert_parallel, dy,
      y_sorted, work):
    _one_device("packed_experts_train_backward", x, top_k_index=top_k_index, top_k_weights=top_k_weights,
                a_gate_up=a_gate_up, b_gate_up=b_gate_up, a_down=a_down, b_down=b_down, dy=dy, y_sorted=y_sorted,
                work=work)
    return [torch.empty_like(x), torch.empty_like(top_k_weights)] + [
        torch.empty_like(t) if t is not None else x.new_empty(0) for t in (a_gate_up, b_gate_up, a_down, b_down)]


class _Kept:
    """The experts a training forward ran on, kept for its backward: their module may be collected, or loaded
    anew (load_state_dict puts other experts under its handle), before the backward runs. Held in the registry
    under a handle of its own, released with this object, rather than by the autograd graph itself: a graph
    alive at the interpreter's exit is freed after the extension has counted its objects (a warning of leaked
    instances), the registry before (atexit above)."""
    __slots__ = ("handle", "packed_id")

    def __init__(self, handle):
        packed = _PACKED.get(handle)
        self.handle = None if packed is None else register_packed(packed)
        self.packed_id = id(packed)
        _KEPT.add(self.handle)

    def handle_for(self, handle):
        """`handle` while it holds the forward's experts (always, unless changed since: a compiled backward keeps
        the handle its graph was traced with); the kept one otherwise."""
        same = self.handle is None or id(_PACKED.get(handle)) == self.packed_id
        return handle if same else self.handle

    def __del__(self, _release=_PACKED.pop, _kept=_KEPT):  # bound now: at exit the module's names may be gone
        _kept.discard(self.handle)
        _release(self.handle, None)


def _packed_setup(ctx, inputs, output):
    x, ids, w, a_gu, b_gu, a_dn, b_dn, scale, handle, ep = inputs
    _, ys, work = output
    ctx.save_for_backward(x, ids, w, a_gu, b_gu, a_dn, b_dn, ys, work)
    ctx.flags = (scale, handle, ep)
    # eager only: a compiled backward calls the op with the handle its graph was traced with (a backward
    # straddling load_state_dict then runs on the loaded experts), and a _Kept made while tracing would keep
    # the traced experts for as long as the compiled graph lives
    ctx.kept = None if torch.compiler.is_compiling() else _Kept(handle)
    ctx.mark_non_differentiable(ys, work)


def _packed_backward(ctx, dy, _dys, _dwork):
    x, ids, w, a_gu, b_gu, a_dn, b_dn, ys, work = ctx.saved_tensors
    scale, handle, ep = ctx.flags
    dy = dy.contiguous()  # a negated view autograd hands over is resolved by the op's dispatcher
    if ctx.kept is not None:
        handle = ctx.kept.handle_for(handle)
    dx, dw, da_gu, db_gu, da_dn, db_dn = packed_experts_train_backward(x, ids, w, a_gu, b_gu, a_dn, b_dn, scale,
                                                                       handle, ep, dy, ys, work)
    some = lambda g, t: g if t is not None else None  # noqa: E731
    return (dx, None, dw, some(da_gu, a_gu), some(db_gu, b_gu), some(da_dn, a_dn), some(db_dn, b_dn), None, None,
            None)


packed_experts_train.register_autograd(_packed_backward, setup_context=_packed_setup)
