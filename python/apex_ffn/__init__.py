"""apex-ffn's routed experts for PyTorch and Hugging Face transformers, on CPU.

    import apex_ffn
    apex_ffn.isa()                       # the kernel path the operations run on
    apex_ffn.set_num_threads(2)          # default: torch.get_num_threads()

The torch operators are in apex_ffn.ops; in transformers models,
apex_ffn.hf registers the experts implementation "apex_ffn" (float
experts) and apex_ffn.packed.pack_experts swaps the experts modules for
packed ones (the model's weights quantized, a GGUF file's blocks, or the
library's pack-once files, mapped in place; save_pack_once writes them);
apex_ffn.gguf_model.load_model opens a GGUF MoE model with its experts
never dequantized.
"""
from . import _core
from ._core import (ConfigError, Error, FormatError, PackedExperts, ShapeError, available_isas, best_isa, isa,
                    set_isa, storage_types)
from ._core import ValueError as ApexValueError
from ._threads import get_num_threads, set_num_threads

__version__ = _core.__version__
