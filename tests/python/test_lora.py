"""LoRA on packed experts (apex_ffn.lora) against peft's LoRA on the float
model's fused experts: outputs and gradients, peft's files both ways, a
torch optimizer's steps, and the refusals."""
import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")
pytest.importorskip("safetensors", reason="safetensors is not installed")
import apex_ffn  # noqa: E402
from apex_ffn.lora import add_lora, load_peft, peft_tensors, save_peft  # noqa: E402
from apex_ffn.packed import pack_experts  # noqa: E402
from families import tiny_model  # noqa: E402

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def peft_model(base, r=4, alpha=8, targets=TARGETS, rslora=False):
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_parameters=targets, init_lora_weights=False,
                          use_rslora=rslora)
    return peft.get_peft_model(copy.deepcopy(base), cfg)


def packed_with_random_lora(base, r=4, alpha=8, targets=("gate_up_proj", "down_proj"), rslora=False):
    ours = copy.deepcopy(base)
    pack_experts(ours, "f32")
    add_lora(ours, r, alpha, targets, use_rslora=rslora, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ours


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb).logits
    out.pow(2).mean().backward()
    return out.detach(), emb.grad.clone()


IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_saved_adapter_loads_in_peft_with_equal_outputs_and_gradients(family, tmp_path):
    base = tiny_model(family)
    ours = packed_with_random_lora(base, rslora=family == "mixtral")
    save_peft(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == TARGETS and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path, is_trainable=True)
    y, dx = loss_and_grads(ours, IDS)
    y_ref, dx_ref = loss_and_grads(theirs, IDS)
    assert rel(y, y_ref) <= 1e-5
    assert rel(dx, dx_ref) <= 1e-5
    # every adapter's gradient, compared in peft's layout
    grads = {}
    for n, m in ours.named_modules():
        if getattr(m, "lora", None) is not None and hasattr(m, "packed"):
            for p in m.lora.parameters():
                p.data, p.grad = p.grad, None  # peft_tensors writes the values: put the gradients there
    grads = peft_tensors(ours)
    theirs_grads = {k.replace(".default", ""): p.grad for k, p in theirs.named_parameters() if p.grad is not None}
    assert set(grads) == set(theirs_grads) and len(grads) == 8  # 2 layers x (A, B) x 2 targets
    for k in grads:
        assert rel(grads[k], theirs_grads[k]) <= 1e-5, k


def test_peft_saved_adapter_loads_here(tmp_path):
    base = tiny_model("qwen3_moe")
    theirs = peft_model(base, r=3, alpha=5)
    theirs.save_pretrained(tmp_path)
    ours = copy.deepcopy(base)
    pack_experts(ours, "f32")
    load_peft(ours, tmp_path)
    with torch.no_grad():
        assert rel(ours(IDS).logits, theirs(IDS).logits) <= 1e-5
    m = ours.get_submodule("model.layers.1.mlp.experts")
    assert m.lora.r == 3 and m.lora.scale == pytest.approx(5 / 3)


def test_one_target_and_a_quantized_base(tmp_path):
    base = tiny_model("qwen3_moe")
    theirs = peft_model(base, targets=["mlp.experts.down_proj"])
    theirs.save_pretrained(tmp_path)
    ours = copy.deepcopy(base)
    pack_experts(ours, "bf16")  # a packed base other than f32: the adapters ride on the packed weights
    load_peft(ours, tmp_path)
    assert ours.get_submodule("model.layers.0.mlp.experts").lora.lora_A_gate_up is None
    with torch.no_grad():
        assert rel(ours(IDS).logits, theirs(IDS).logits) <= 2e-2


def test_a_negated_gradient_view_is_read_as_its_values():
    """Autograd hands the backward a gradient as it is, negative bit included (a lazily negated view
    holds its values un-negated in memory): the LoRA op's gradients must be those of the values."""
    ours = packed_with_random_lora(tiny_model("qwen3_moe"))
    experts = ours.get_submodule("model.layers.0.mlp.experts")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, ours.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(ours.config.num_experts, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    dy = torch.randn(5, ours.config.hidden_size, generator=g)

    def grads(gradient):
        experts.zero_grad(set_to_none=True)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        experts(xr, ids, wr).backward(gradient)
        found = [xr.grad, wr.grad] + [p.grad for n, p in experts.named_parameters() if "lora_" in n]
        assert all(t is not None for t in found) and len(found) == 6
        return torch.cat([t.reshape(-1) for t in found])

    assert torch.equal(grads(torch._neg_view(-dy)), grads(dy))


def test_trains_with_a_torch_optimizer(tmp_path):
    base = tiny_model("qwen3_moe")
    ours = copy.deepcopy(base)
    pack_experts(ours, "f32")
    add_lora(ours, 4, 8)
    trainable = [p for p in ours.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in ours.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(6))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = ours(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05
    save_peft(ours, tmp_path)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    twin = copy.deepcopy(ours)  # the adapters copied, the packed weights shared
    with torch.no_grad():
        assert rel(ours(tokens).logits, theirs(tokens).logits) <= 1e-5
        assert torch.equal(twin(tokens).logits, ours(tokens).logits)
    lora = twin.get_submodule("model.layers.0.mlp.experts").lora
    assert lora.lora_B_down.data_ptr() != ours.get_submodule("model.layers.0.mlp.experts").lora.lora_B_down.data_ptr()


def test_refusals_leave_the_model_unchanged(tmp_path):
    base = tiny_model("qwen3_moe")
    with pytest.raises(apex_ffn.ConfigError, match="has no packed experts"):
        add_lora(copy.deepcopy(base), 4, 8)
    ours = copy.deepcopy(base)
    pack_experts(ours, "f32")
    with pytest.raises(apex_ffn.ConfigError, match="has no adapters \\(add_lora first\\)"):
        save_peft(ours, tmp_path / "none")
    # an adapter of another model (more experts): ShapeError naming the tensor, nothing attached
    from families import BASE, FAMILIES
    cfg = transformers.AutoConfig.for_model("qwen3_moe", **{**BASE, **FAMILIES["qwen3_moe"], "num_experts": 8})
    bigger = transformers.AutoModelForCausalLM.from_config(cfg)
    peft_model(bigger).save_pretrained(tmp_path / "bigger")
    with pytest.raises(apex_ffn.ShapeError, match="lora_A.weight' has shape \\(32, 32\\), expected \\(24, 32\\)"):
        load_peft(ours, tmp_path / "bigger")
    assert all(getattr(m, "lora", None) is None for _, m in ours.named_modules())
    # attention adapters too: not read
    peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=TARGETS)
                        ).save_pretrained(tmp_path / "attn")
    with pytest.raises(apex_ffn.ConfigError, match="besides the experts' gate_up_proj and down_proj"):
        load_peft(ours, tmp_path / "attn")
    # DoRA: refused by the library's config reader
    peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
                        ).save_pretrained(tmp_path / "dora")
    with pytest.raises(apex_ffn.ConfigError, match="use_dora"):
        load_peft(ours, tmp_path / "dora")
    assert all(getattr(m, "lora", None) is None for _, m in ours.named_modules())
    with pytest.raises(apex_ffn.ConfigError, match="rank 0, expected >= 1"):
        add_lora(ours, 0, 8)


def test_unreadable_adapter_file_and_non_finite_alpha_leave_the_model_unchanged(tmp_path):
    base = tiny_model("qwen3_moe")
    peft_model(base).save_pretrained(tmp_path / "whole")
    ours = copy.deepcopy(base)
    pack_experts(ours, "f32")
    add_lora(ours, 2, 4, seed=7)
    before = {n: p.detach().clone() for n, p in ours.named_parameters() if "lora" in n}

    def unchanged():
        after = {n: p.detach() for n, p in ours.named_parameters() if "lora" in n}
        return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)

    # a truncated tensor file: the library's FormatError naming it (not safetensors' own error type)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "adapter_config.json").write_bytes((tmp_path / "whole" / "adapter_config.json").read_bytes())
    data = (tmp_path / "whole" / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(apex_ffn.FormatError, match="adapter_model.safetensors is not a safetensors file that can be"):
        load_peft(ours, cut)
    assert unchanged()
    # a NaN or infinite alpha would scale every adapter to NaN
    for alpha in (float("nan"), float("inf"), "8"):
        with pytest.raises(apex_ffn.ConfigError, match="lora_alpha .*, expected a finite number"):
            add_lora(ours, 4, alpha)
    assert unchanged()


def test_no_targets_or_a_string_of_one_are_refused_before_any_change():
    """targets=() attached adapters with no tensors to every module (and froze the base): adapters on nothing,
    which peft refuses too. A string was read letter by letter ('unknown target 'd''). Both are refused by
    name, the model left as it was."""
    ours = tiny_model("qwen3_moe")
    pack_experts(ours, "f32")
    grads = {n: p.requires_grad for n, p in ours.named_parameters()}
    for targets, match in (((), "no targets, expected gate_up_proj, down_proj or both"), ([], "no targets"),
                           ("down_proj", "targets 'down_proj' is a string, expected a tuple of names"),
                           (None, "targets None, expected a tuple"), (("down_proj", "up_proj"), "unknown target 'up_")):
        with pytest.raises(apex_ffn.ConfigError, match=f"apex_ffn.add_lora: {match}"):
            add_lora(ours, 4, 8, targets)
        assert all(getattr(m, "lora", None) is None for _, m in ours.named_modules())
        assert {n: p.requires_grad for n, p in ours.named_parameters()} == grads
    assert add_lora(ours, 4, 8, ["down_proj"]) and all(
        m.lora.targets == ("down_proj",) for _, m in ours.named_modules() if hasattr(m, "lora"))
