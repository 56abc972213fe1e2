"""A packed model's experts as the float modules' tensors, each the value the kernels multiply by (a block
format's ggml-dequantized value): in save_pretrained's folder, which the float model loads, and in the state
dict within experts_as_float (not otherwise: an adapter save reads the whole state dict); load_state_dict
packs float tensors again; the refusals (shapes, partial sets, meta tensors, memory, pickling) name what is
wrong."""
import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import apex_ffn  # noqa: E402
from apex_ffn.packed import PackedExpertsModule, experts_as_float, pack_experts  # noqa: E402
from families import tiny_model  # noqa: E402
from test_packed import gguf_roundtrip, logits, rel, wide_model, write_gguf  # noqa: E402

EXPERT_KEYS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def expert_state(model):
    with experts_as_float(model):
        return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] in EXPERT_KEYS}


def ggml_values(t, qname, transposed):
    """t's values after ggml's quantization to qname (blocks along each row's input axis: the last one, or the
    middle one of a transposed module's (E, in, out) tensors)."""
    if transposed:
        return gguf_roundtrip(t.transpose(1, 2).contiguous(), qname).transpose(1, 2)
    return gguf_roundtrip(t, qname)


@pytest.mark.parametrize("family,types", [("qwen3_moe", "f32"), ("gpt_oss", "f32"), ("qwen3_moe", "q8_0"),
                                          ("qwen3_moe", "q4_0"), ("gpt_oss", "mxfp4"), ("qwen3_moe", "q4_k/q6_k")])
def test_state_dict_holds_the_weights_the_kernels_multiply_by(family, types):
    model = wide_model(family)
    before = expert_state(model)
    pack_experts(model, types)
    after = expert_state(model)
    assert list(after) == list(before)  # the float module's names, in its order
    transposed = family == "gpt_oss"
    for k, v in before.items():
        got = after[k]
        assert got.shape == v.shape and got.dtype == v.dtype, k
        if types == "f32" or k.endswith("_bias"):  # f32 weights and gpt-oss's biases are kept as they are
            assert torch.equal(got, v), k
        elif types in ("q8_0", "q4_0", "mxfp4"):  # gguf-py quantizes these as ggml does: bit for bit
            pytest.importorskip("gguf", reason="gguf-py is not installed")
            assert torch.equal(got, ggml_values(v, types, transposed)), k
        else:  # the K-quants (no quantizer in gguf-py): to their storage error
            assert 0 < rel(got, v) <= 0.1, k


def test_save_pretrained_folder_loads_as_the_float_model(tmp_path):
    """What a packed q8_0 model saves, the float model loads with nothing missing, and its eager experts give
    what the packed ones give up to the activations' quantization; a bf16 model saves bf16 tensors."""
    model = wide_model()
    pack_experts(model, "q8_0")
    saved = expert_state(model)
    model.save_pretrained(tmp_path / "q8")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "q8", experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert rel(logits(model, ids), logits(loaded.eval(), ids)) <= 0.2
    half = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    before = expert_state(half)
    pack_experts(half, "bf16")
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, before[k]) for k, v in expert_state(half).items())
    half.float()  # the state dict follows the model's dtype
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k].float()) for k, v in expert_state(half).items())


@pytest.mark.parametrize("types", ["f32", "bf16", "q8_0", "q4_k"])
def test_load_state_dict_packs_the_float_tensors(types):
    """load_state_dict into a packed model packs the tensors in the module's types: the same outputs as the
    model packed from them directly; a graph compiled before the load runs on the new experts."""
    source = wide_model(seed=3)
    target = wide_model(seed=4)
    pack_experts(target, types)
    direct = copy.deepcopy(source)
    pack_experts(direct, types)
    experts = target.get_submodule("model.layers.0.mlp.experts")
    handle = experts.handle
    target.load_state_dict(source.state_dict())
    assert experts.handle == handle and experts.packed.types == types
    ids = torch.randint(0, source.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(target, ids), logits(direct, ids))
    if types in ("f32", "bf16"):  # exact storage: a packed model's own state dict comes back unchanged
        again = wide_model(seed=5)
        pack_experts(again, types)
        with experts_as_float(direct):
            again.load_state_dict(direct.state_dict())
        assert all(torch.equal(v, expert_state(direct)[k]) for k, v in expert_state(again).items())


def test_gguf_experts_save_as_their_dequantized_values(tmp_path):
    """Experts mapped from a GGUF file's Q8_0 blocks export the file's values (gguf-py's dequantization);
    loading float tensors into such a module packs them in memory: the file is no longer read."""
    gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
    ref = wide_model()
    path = tmp_path / "tiny-q8_0.gguf"
    write_gguf(ref, path, "Q8_0")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(ref.config)
    pack_experts(meta, gguf=path)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    m = meta.get_submodule("model.layers.1.mlp.experts")
    w = m.float_weights()
    assert w["gate_up_proj"].dtype == torch.float32  # a meta model's dtype: float32
    for name, got in (("ffn_gate_exps", w["gate_up_proj"][:, :256]), ("ffn_up_exps", w["gate_up_proj"][:, 256:]),
                      ("ffn_down_exps", w["down_proj"])):
        t = tensors[f"blk.1.{name}.weight"]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(got.shape)
        assert torch.equal(got, torch.from_numpy(want.copy())), name
    m.load_float_weights({k: v.double() for k, v in w.items()})
    assert m.source == "" and torch.equal(m.float_weights()["down_proj"], w["down_proj"])


def test_bad_state_dicts_are_refused_and_leave_the_experts():
    model = wide_model()
    pack_experts(model, "q8_0")
    m = model.get_submodule("model.layers.0.mlp.experts")
    kept = m.float_weights()
    with experts_as_float(model):
        state = model.state_dict()
    prefix = "model.layers.0.mlp.experts."
    partial = {k: v for k, v in state.items() if k != prefix + "down_proj"}
    with pytest.raises(RuntimeError, match="experts: gives \\['gate_up_proj'\\] without \\['down_proj'\\]: packed experts "
                                           "are loaded from all"):
        model.load_state_dict(partial)
    wrong = dict(state)
    wrong[prefix + "down_proj"] = state[prefix + "down_proj"][:, :, :128]
    with pytest.raises(RuntimeError, match="'down_proj' has shape \\(6, 256, 128\\).*expected a float tensor of "
                                           "shape \\(6, 256, 256\\)"):
        model.load_state_dict(wrong)
    wrong[prefix + "down_proj"] = torch.empty(6, 256, 256, device="meta")
    with pytest.raises(RuntimeError, match="'down_proj' has no values \\(a meta tensor\\)"):
        model.load_state_dict(wrong)
    wrong[prefix + "down_proj"] = state[prefix + "down_proj"].long()
    with pytest.raises(RuntimeError, match="'down_proj' has shape \\(6, 256, 256\\) and dtype torch.int64"):
        model.load_state_dict(wrong)
    assert all(torch.equal(v, kept[k]) for k, v in m.float_weights().items())
    with pytest.raises(apex_ffn.ConfigError, match="expected the tensors \\['down_proj', 'gate_up_proj'\\]"):
        m.load_float_weights({"down_proj": kept["down_proj"]})
    with pytest.raises(apex_ffn.ConfigError, match="argument 'dtype': expected a float dtype, got torch.int8"):
        m.float_weights(torch.int8)
    with pytest.raises(TypeError, match="cannot be pickled .*save_pack_once"):
        pickle.dumps(m)
    assert isinstance(model.get_submodule("model.layers.0.mlp.experts"), PackedExpertsModule)


def test_plain_state_dict_holds_no_experts_and_says_so_on_a_float_load():
    """Outside experts_as_float the state dict holds what is not packed: it loads back into the packed model
    (strict, experts kept), and a float model's strict load names the experts missing."""
    model = wide_model()
    pack_experts(model, "q8_0")
    m = model.get_submodule("model.layers.0.mlp.experts")
    kept = m.float_weights()
    state = model.state_dict()
    assert not any(k.rsplit(".", 1)[-1] in EXPERT_KEYS for k in state)
    assert model.load_state_dict(state).missing_keys == []
    assert all(torch.equal(v, kept[k]) for k, v in m.float_weights().items())
    with pytest.raises(RuntimeError, match="Missing key\\(s\\).*model.layers.0.mlp.experts.gate_up_proj"):
        wide_model().load_state_dict(state)


def test_adapter_saves_and_trainer_state_dicts(tmp_path):
    """peft's adapter save reads the model's whole state dict: no expert is dequantized for it; save_pretrained
    given a state dict (as Trainer gives one) gets the experts it lacks; a deep copy's save_pretrained saves the
    copy."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from apex_ffn import float_weights
    model = wide_model()
    pack_experts(model, "q8_0")
    copied = copy.deepcopy(model)
    calls = []
    real = float_weights.float_weights
    float_weights.float_weights = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
        adapted.save_pretrained(tmp_path / "adapter")
        assert not calls and (tmp_path / "adapter" / "adapter_model.safetensors").exists()
        adapted = adapted.unload()
    finally:
        float_weights.float_weights = real
    saved = expert_state(model)
    model.save_pretrained(tmp_path / "given", state_dict=model.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "given", experts_implementation="eager")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    other = wide_model(seed=8)
    copied.load_state_dict(other.state_dict())  # the copy's experts only
    copied.save_pretrained(tmp_path / "copy")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy", experts_implementation="eager")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expert_state(copied).items())
    assert not torch.equal(expert_state(copied)[next(iter(saved))], next(iter(saved.values())))


def test_an_export_larger_than_memory_is_refused_before_it_starts(monkeypatch, tmp_path):
    """Float experts and the model's own bytes beyond physical memory: experts_as_float and save_pretrained are
    a ConfigError naming the bytes before any expert is dequantized or any file written (the library's memory
    rule; the override exports anyway)."""
    from apex_ffn import float_export, float_weights
    model = wide_model()
    pack_experts(model, "q4_0")
    calls = []
    monkeypatch.setattr(float_weights, "float_weights", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(float_export, "physical_memory", lambda: 10_000_000)
    export = 2 * 6 * 3 * 256 * 256 * 4  # two blocks of 6 experts, float32
    refusal = (f"packed experts as float tensors need 0.01 GB \\({export} bytes\\) beside the .* the machine has "
               "0.01 GB \\(10000000 bytes\\) of physical memory; keep the packed experts with .*save_pack_once")
    with pytest.raises(apex_ffn.ConfigError, match=refusal):
        with experts_as_float(model):
            pass
    with pytest.raises(apex_ffn.ConfigError, match=refusal):
        model.save_pretrained(tmp_path / "big")
    assert not calls and not (tmp_path / "big").exists()
    assert len(model.state_dict()) > 0  # without the experts: nothing to check
    monkeypatch.undo()  # the real export, with the override
    monkeypatch.setattr(float_export, "physical_memory", lambda: 10_000_000)
    monkeypatch.setenv("APEX_FFN_ALLOW_OVERCOMMIT", "1")
    assert len(expert_state(model)) == 4


@pytest.mark.parametrize("staging", [1, 4 * 12 * 256 * 256])
def test_exports_to_another_dtype_stage_a_few_experts_at_a_time(monkeypatch, staging):
    """An export to bf16 dequantizes a few experts at a time into float32 (one, or four here, of six: the last
    part short): the same values as the float32 export rounded; experts asked beyond the block are refused."""
    from apex_ffn import float_weights
    model = wide_model("gpt_oss")
    pack_experts(model, "mxfp4")
    m = model.get_submodule("model.layers.1.mlp.experts")
    whole = m.float_weights(torch.float32)
    monkeypatch.setattr(float_weights, "_STAGING_BYTES", staging)
    parts = m.float_weights(torch.bfloat16)
    assert all(parts[k].dtype == torch.bfloat16 and torch.equal(parts[k], v.bfloat16()) for k, v in whole.items())
    t = {n: torch.empty((2,) + s[1:]) for n, s in m.weight_shapes().items()}
    with pytest.raises(apex_ffn.ShapeError, match="2 experts from expert 5 asked of a block of 6"):
        m.packed.to_float(t["gate_up_proj"], t["down_proj"], t["gate_up_proj_bias"], t["down_proj_bias"], True, True,
                          5, 1)


def test_assigned_state_dicts_set_the_experts_dtype():
    """load_state_dict(assign=True) makes the parameters the given tensors' dtype: the packed experts' export
    follows (their storage type stays)."""
    model = tiny_model("qwen3_moe")
    pack_experts(model, "f32")
    half = tiny_model("qwen3_moe", seed=7).bfloat16()
    model.load_state_dict(half.state_dict(), assign=True)
    state = expert_state(model)
    assert model.get_parameter("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, expert_state(half)[k]) for k, v in state.items())
    assert model.get_submodule("model.layers.0.mlp.experts").packed.types == "f32"
