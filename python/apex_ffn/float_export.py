"""A packed model's experts as the float model's tensors: in save_pretrained's folder, and in its state dict
where asked for.

A packed model's ``state_dict`` holds what is not packed. The packed experts are not float weights to hand
out, and state_dict is called where nobody wants them dequantized: peft's adapter save takes its keys out of
the model's whole state dict, accelerate and Trainer call it for their own ends, and a 30B MoE's experts are
60 GB in bf16. A packed model's own state dict loads back into it (its experts stay as they are); loaded into
a float model, torch's strict load names the experts missing, so they are not lost without a word. Two ways
to have them as float tensors:

- ``model.save_pretrained(folder)`` of a model pack_experts packed writes them (its method, wrapped on the
  instance by pack_experts): the folder loads as the float model with nothing missing, the experts' values
  those the kernels multiply by, in the model's dtype;
- ``with experts_as_float(model): model.state_dict()`` holds them (torch.save, accelerate, a float model's
  load_state_dict).

Either checks first that the float tensors fit in physical memory beside what the model holds (the library's
rule for what it allocates: ConfigError naming the bytes, unless APEX_FFN_ALLOW_OVERCOMMIT=1). The
packed bytes themselves are kept with apex_ffn.packed.save_pack_once, adapters with apex_ffn.lora.save_peft.
"""
import contextlib
import os
import types

import torch

from . import _core
from .float_weights import float_weights, weight_shapes

_ALLOW_OVERCOMMIT = "APEX_FFN_ALLOW_OVERCOMMIT"


def _packed_modules(model):
    from .packed_module import PackedExpertsModule
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PackedExpertsModule)]


def export_bytes(m):
    """Bytes module `m`'s experts take as float tensors of its dtype (the float32 staging aside)."""
    return sum(m.weight_dtype.itemsize * torch.Size(s).numel() for s in weight_shapes(m).values())


def physical_memory():
    """Bytes of physical memory (0: unknown), as the library's check_memory_fit reads it."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _gb(n):
    return f"{n / 1e9:.2f} GB ({n} bytes)"


def check_export_fits(model, packed):
    """ConfigError when `model`'s packed experts `packed` as float tensors and what the model holds exceed
    physical memory (nothing when APEX_FFN_ALLOW_OVERCOMMIT=1 or the size is unknown)."""
    if os.environ.get(_ALLOW_OVERCOMMIT) == "1":
        return
    export = sum(export_bytes(m) for m in packed)
    held = sum(m.packed.nbytes for m in packed if not m.packed.mapped)
    held += sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()) if t.device.type == "cpu")
    available = physical_memory()
    if available and export + held > available:
        raise _core.ConfigError(
            f"apex_ffn: {type(model).__name__}'s packed experts as float tensors need {_gb(export)} beside the "
            f"{_gb(held)} the model holds, the machine has {_gb(available)} of physical memory; keep the packed "
            f"experts with apex_ffn.packed.save_pack_once (and adapters with apex_ffn.lora.save_peft), or set "
            f"{_ALLOW_OVERCOMMIT}=1 to export them anyway")


@contextlib.contextmanager
def experts_as_float(model):
    """Within it, `model`'s state dict holds its packed experts as the float modules' tensors (see the module
    comment); checked against physical memory first. Nests."""
    packed = [m for _, m in _packed_modules(model)]
    check_export_fits(model, packed)
    for m in packed:
        m.__dict__["_apex_ffn_float_export"] = m.__dict__.get("_apex_ffn_float_export", 0) + 1
    try:
        yield model
    finally:
        for m in packed:
            m.__dict__["_apex_ffn_float_export"] -= 1


def _save_pretrained(model, save_directory, *args, **kwargs):
    """The model class's save_pretrained with the packed experts as float tensors (a state_dict given by the
    caller, as Trainer gives one, gets those it lacks)."""
    with experts_as_float(model):
        given = kwargs.get("state_dict")
        if given is not None:
            given = dict(given)
            for name, m in _packed_modules(model):
                missing = [n for n in weight_shapes(m) if f"{name}.{n}" not in given]
                if missing:
                    given.update({f"{name}.{n}": t for n, t in float_weights(m).items() if n in missing})
            kwargs["state_dict"] = given
        return type(model).save_pretrained(model, save_directory, *args, **kwargs)


def watch_save(model):
    """Wraps `model`'s save_pretrained (a transformers model's), once, on the instance, so its folder holds the
    packed experts as float tensors. A bound method: copy.deepcopy binds it to the copy."""
    if callable(getattr(type(model), "save_pretrained", None)) and "save_pretrained" not in model.__dict__:
        model.__dict__["save_pretrained"] = types.MethodType(_save_pretrained, model)
