"""A transformers model from a GGUF file with its experts never dequantized (apex_ffn.gguf_model.load_model):
the same bits as transformers' own load with the file's experts swapped in afterwards, the tied and bf16
cases, and the refusals."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("gguf", reason="gguf-py is not installed")
import apex_ffn  # noqa: E402
from apex_ffn.gguf_model import load_model  # noqa: E402
from apex_ffn.packed import PackedExpertsModule, pack_experts  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
from make_tiny_gguf import make_tiny_qwen3_moe_gguf, tiny_qwen3_moe  # noqa: E402

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])


def transformers_load(path, **kw):
    """transformers' own CPU load of the file: every tensor dequantized (its qwen3moe mapping has no key
    for the experts' width, so it is given)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             moe_intermediate_size=256, **kw).eval()


def logits(model, ids=PROMPT):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_same_bits_as_the_dequantized_load_with_the_experts_swapped(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    make_tiny_qwen3_moe_gguf(path, qtype)
    ours = load_model(path)
    assert ours.config.moe_intermediate_size == 256  # read from the file's expert tensors
    experts = [m for _, m in ours.named_modules() if isinstance(m, PackedExpertsModule)]
    assert len(experts) == 2 and all(m.packed.types == qtype.lower() for m in experts)
    assert not [n for n, _ in ours.named_parameters() if ".experts." in n]  # no float expert weights at all
    assert all(t.device.type == "cpu" for t in list(ours.parameters()) + list(ours.buffers()))

    swapped = transformers_load(path, dtype=torch.float32)
    pack_experts(swapped, gguf=path)
    assert torch.equal(logits(ours), logits(swapped))
    with torch.no_grad():
        a = ours.generate(PROMPT, max_new_tokens=5, do_sample=False)
        b = swapped.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert a.shape == (1, 11) and torch.equal(a, b)


def test_tied_embeddings_and_bf16(tmp_path):
    path = tmp_path / "tied.gguf"
    make_tiny_qwen3_moe_gguf(path, "Q8_0", tiny_qwen3_moe(tied=True))
    ours = load_model(path)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    swapped = transformers_load(path, dtype=torch.float32)
    pack_experts(swapped, gguf=path)
    assert torch.equal(logits(ours), logits(swapped))

    half = load_model(path, dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = logits(ours)
    assert ((logits(half).float() - ref).abs().max() / ref.abs().max()).item() <= 3e-2


def test_config_overrides_reach_the_model(tmp_path):
    path = tmp_path / "tiny.gguf"
    make_tiny_qwen3_moe_gguf(path, "Q8_0")
    assert load_model(path, num_experts_per_tok=3).config.num_experts_per_tok == 3
    with pytest.raises(apex_ffn.ShapeError, match="has 8 experts of 256 x 128"):
        load_model(path, moe_intermediate_size=128)  # the file's experts are 256 wide


def test_refusals(tmp_path):
    with pytest.raises(apex_ffn.FormatError, match="not-there.gguf"):
        load_model(tmp_path / "not-there.gguf")
    # what is not a GGUF file, or not all of one: the library's FormatError naming it, before transformers'
    # reader (a Hub lookup's OSError, a failed reshape) or a read that would wait on a FIFO
    path = tmp_path / "tiny.gguf"
    make_tiny_qwen3_moe_gguf(path, "Q8_0")
    data = path.read_bytes()
    (tmp_path / "half.gguf").write_bytes(data[:len(data) // 2])
    (tmp_path / "header.gguf").write_bytes(data[:100])
    (tmp_path / "folder.gguf").mkdir()
    os.mkfifo(tmp_path / "fifo.gguf")
    for name, why in (("half.gguf", "extends past the end"), ("header.gguf", "cannot fit"),
                      ("folder.gguf", "not a regular file"), ("fifo.gguf", "not a regular file")):
        with pytest.raises(apex_ffn.FormatError, match=f"{name}.*{why}"):
            load_model(tmp_path / name)
    with pytest.raises(apex_ffn.FormatError, match="'/dev/zero' is not a regular file"):
        load_model("/dev/zero")
    # a file with the experts and routers only (tests/python/test_packed.py's writer): the rest is named
    from test_packed import wide_model, write_gguf
    path = tmp_path / "experts-only.gguf"
    write_gguf(wide_model(), path, "Q8_0")
    with pytest.raises(Exception) as e:
        load_model(path, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
                   hidden_size=256, num_hidden_layers=2)
    assert isinstance(e.value, apex_ffn.FormatError), e.value
    assert "has no tensor for model.embed_tokens.weight" in str(e.value)


def test_save_pretrained_writes_the_files_dequantized_model(tmp_path):
    """A GGUF model opened with packed experts, saved with save_pretrained: the folder loads as the float model
    with nothing missing, every tensor (experts included) and the logits equal to transformers' own load of
    the file, bit for bit."""
    path = tmp_path / "tiny.gguf"
    make_tiny_qwen3_moe_gguf(path, "Q8_0")
    load_model(path).save_pretrained(tmp_path / "hf")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager",
                                                                     output_loading_info=True)
    assert not any(info.values())
    ref = transformers_load(path, dtype=torch.float32)
    got, want = loaded.state_dict(), ref.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(logits(loaded.eval()), logits(ref))
