"""A transformers model from a llama.cpp GGUF file whose experts are never dequantized.

    from apex_ffn.gguf_model import load_model
    model = load_model("Qwen3-30B-A3B-Q4_K_M.gguf")     # dtype=torch.float32 by default
    model.generate(ids, max_new_tokens=32)

transformers (5.25) loads qwen3moe, qwen2moe and gpt-oss GGUF files on a CPU
by dequantizing every tensor (``load_gguf_checkpoint``), so a 17 GB Q4_K_M
MoE needs the float model's 60-120 GB before anything could be swapped.
Here the model is built on the meta device from the file's configuration
(transformers' own reading of the metadata), its experts modules are
replaced by packed ones read from the file's blocks (apex_ffn.packed:
moved into the library's panels, never dequantized or re-quantized), and
only the other tensors (attention, embeddings, norms, routers, shared
experts: a few per cent of an MoE) are dequantized, by transformers' own
per-architecture tensor processors and name map. Peak memory is the file's
expert bytes plus the float rest of the model.

The panel layout differs from the file's rows, so the experts' bytes are
copied once into the panels; to map them in place instead, save them once
as pack-once files (apex_ffn.packed) and load those.
"""
import os
import re

import numpy as np
import torch

from . import _core
from .packed import pack_experts

# llama.cpp's names of the routed experts' tensors (separate or fused gate/up; gpt-oss's biases): the packed
# experts read them, so they are never dequantized here.
_EXPERTS_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")


def _open_config(path, config_kwargs):
    from transformers import AutoConfig
    folder, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name, **config_kwargs)
    _fill_expert_width(config, path, config_kwargs)
    return config


def _fill_expert_width(config, path, config_kwargs):
    """transformers' qwen3moe/qwen2moe GGUF mapping has no key for the experts' width (llama.cpp's
    expert_feed_forward_length): take it from the file's first down_exps tensor (ggml shape f, d, E)."""
    if not hasattr(config, "moe_intermediate_size") or "moe_intermediate_size" in config_kwargs:
        return
    from gguf import GGUFReader
    for t in GGUFReader(path).tensors:
        if _EXPERTS_TENSOR.match(t.name) and ".ffn_down_exps.weight" in t.name:
            config.moe_intermediate_size = int(t.shape[0])
            return


def _dense_state(model, path, dtype):
    """The file's tensors other than the routed experts, dequantized and named as `model` names them
    (transformers' tensor processor and name map for the file's architecture)."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                           get_gguf_hf_weights_map, load_gguf_checkpoint)
    parsed = load_gguf_checkpoint(path, return_tensors=False)
    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    state = {}
    for t in reader.tensors:
        if _EXPERTS_TENSOR.match(t.name):
            continue
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            state[names[result.name]] = torch.from_numpy(np.copy(result.weights)).to(dtype)
    return state


def _materialize_buffers(model):
    """Buffers the meta device left without values (the rotary embeddings' inverse frequencies): on the CPU,
    set by transformers' own initialisation of their module."""
    for module in model.modules():
        meta = [k for k, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        for k in meta:
            module._buffers[k] = torch.empty_like(module._buffers[k], device="cpu")
        model._init_weights(module)


def _still_meta(model):
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]


def load_model(path, dtype=torch.float32, threads=None, **config_kwargs):
    """The causal LM of the GGUF file `path` with its routed experts packed in the file's own types (see the
    module comment); `config_kwargs` override the configuration transformers reads from the file. Errors are
    the library's typed ones (FormatError for a file that is not a complete model of its architecture)."""
    from transformers import AutoModelForCausalLM
    path = os.fspath(path)
    # The library's reader checks the file first (a regular file, its header, every tensor within its bytes):
    # transformers' and gguf-py's readers, which run next, answer a directory, a device or a truncated file with
    # errors that do not name the problem (a Hub lookup's OSError, a failed reshape, a struct error).
    _core.GgufFile.open(path)
    config = _open_config(path, config_kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    pack_experts(model, gguf=path, threads=threads)
    state = _dense_state(model, path, dtype)
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    _materialize_buffers(model)
    if left := _still_meta(model):
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        raise _core.FormatError(f"apex_ffn.gguf_model.load_model: {path} has no tensor for {shown}")
    return model.eval()
