"""The "apex_ffn" experts implementation in every family: outputs and
gradients against transformers' eager experts, and the refusals."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import apex_ffn.hf  # noqa: E402,F401  (registers "apex_ffn")
from families import FAMILIES, experts_modules, tiny_model  # noqa: E402


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def forward_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb).logits
    out.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), emb.grad.clone(), grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_eager(family):
    ref = tiny_model(family)
    ours = copy.deepcopy(ref)
    ours.set_experts_implementation("apex_ffn")
    ids = torch.randint(0, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    y_ref, dx_ref, g_ref = forward_and_grads(ref, ids)
    y, dx, g = forward_and_grads(ours, ids)
    assert rel(y, y_ref) <= 1e-5
    assert rel(dx, dx_ref) <= 1e-5
    assert set(g) == set(g_ref)
    checked = [n for n in g if "experts" in n or "router" in n or n.endswith("gate.weight")]
    assert any("experts" in n for n in checked) and len(checked) >= 4
    for n in g:  # every parameter: the experts' weights (and biases), the routers, the rest
        assert rel(g[n], g_ref[n]) <= 2e-5, n


def test_from_pretrained_and_generate(tmp_path):
    from transformers import AutoModelForCausalLM
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="apex_ffn")
    assert ours.config._experts_implementation == "apex_ffn"
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=6, do_sample=False)
        b = ours.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_model(family):
    ref = tiny_model(family, dtype=torch.bfloat16)
    ours = copy.deepcopy(ref)
    ours.set_experts_implementation("apex_ffn")
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = ref(ids).logits.float(), ours(ids).logits.float()
    assert rel(b, a) <= 3e-2  # bf16 rounding of the activations on either side


def test_bf16_weights_replaced_at_a_freed_address_are_packed_again():
    """Without gradients, bf16 experts run packed, once per weight version. A weight deleted and replaced by a
    new tensor of its size mostly gets the freed memory back, with the same version count: the new weights
    are what runs, not the packing of the freed ones."""
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    _, experts = experts_modules(model)[0]
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(6, 32, generator=g).bfloat16(), torch.randint(0, 6, (6, 2), generator=g), torch.rand(6, 2)
    with torch.no_grad():
        apex_ffn.hf.apex_experts_forward(experts, x, ids, w)
        for _ in range(4):
            shape = experts.gate_up_proj.shape
            del experts.gate_up_proj
            experts.gate_up_proj = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16), requires_grad=False)
            experts.gate_up_proj.normal_(0.0, 0.2, generator=g)
            fresh = copy.deepcopy(experts)  # packs its own copy of the new weights
            assert torch.equal(apex_ffn.hf.apex_experts_forward(experts, x, ids, w),
                               apex_ffn.hf.apex_experts_forward(fresh, x, ids, w))


def test_bf16_packed_copy_goes_with_its_module():
    """The bf16 experts' packed copy is registered with the ops by a handle: it is given back when the module
    is collected (and when a changed weight is packed again), not kept for the life of the process; the
    module still copies and pickles."""
    import gc
    import pickle
    gc.collect()
    before = len(apex_ffn.ops._PACKED)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model.set_experts_implementation("apex_ffn")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        y = model(ids).logits
        assert len(apex_ffn.ops._PACKED) == before + 2  # one per experts module
        experts_modules(model)[0][1].down_proj.mul_(1.0)  # a new version: packed again, the old one released
        model(ids)
        assert len(apex_ffn.ops._PACKED) == before + 2
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, y)
        assert len(apex_ffn.ops._PACKED) == before + 4
        assert torch.equal(pickle.loads(pickle.dumps(model))(ids).logits, y)
    del model, twin
    gc.collect()
    assert len(apex_ffn.ops._PACKED) == before


@pytest.mark.parametrize("trained", ["gate_up_proj_bias", "down_proj_bias", "gate_up_proj", "down_proj"])
def test_bf16_experts_with_one_trained_tensor_give_its_gradient(trained):
    """bf16 experts run packed (no gradients) only when nothing needs a gradient: with just one weight or
    bias of gpt-oss's experts trainable, it gets its gradient, as eager gives it."""
    model = tiny_model("gpt_oss", dtype=torch.bfloat16)
    model.requires_grad_(False)
    _, experts = experts_modules(model)[0]
    getattr(experts, trained).requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(6, 32, generator=g).bfloat16(), torch.randint(0, 6, (6, 2), generator=g), torch.rand(6, 2)
    grads = []
    for run in (apex_ffn.hf.apex_experts_forward, lambda m, *a: type(m).forward(m, *a)):
        getattr(experts, trained).grad = None
        run(experts, x, ids, w.bfloat16()).float().pow(2).sum().backward()
        grads.append(getattr(experts, trained).grad)
    assert grads[0] is not None and rel(grads[0].float(), grads[1].float()) <= 3e-2


def test_expert_parallel_empty_slots():
    model = tiny_model("qwen3_moe")
    _, experts = experts_modules(model)[0]
    e = experts.num_experts
    x = torch.randn(5, 32)
    ids = torch.tensor([[0, e], [1, 2], [e + 3, 4], [5, e], [e, e + 1]])
    w = torch.rand(5, 2)
    w = w.masked_fill(ids >= e, 0.0)
    experts._is_expert_parallel = True
    y_ref = transformers.integrations.moe.batched_mm_experts_forward(experts, x, ids, w)
    y = apex_ffn.hf.apex_experts_forward(experts, x, ids, w)
    assert rel(y, y_ref) <= 1e-5
    experts._is_expert_parallel = False
    with pytest.raises(ValueError, match="expert id 6 at \\(0, 1\\).*only in an expert-parallel module"):
        apex_ffn.hf.apex_experts_forward(experts, x, ids, w)


def test_unsupported_activation_is_named():
    model = tiny_model("qwen3_moe")
    _, experts = experts_modules(model)[0]
    experts.act_fn = torch.nn.GELU()
    x, ids, w = torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2)
    with pytest.raises(apex_ffn.ConfigError, match="Qwen3MoeExperts: its gated activation \\(GELU.*not one the library has"):
        apex_ffn.hf.apex_experts_forward(experts, x, ids, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_changed_after_the_first_call_is_seen(dtype):
    """The layout read at a module's first call was kept for good: an act_fn changed afterwards ran as the
    first one (SiLU), silently, in float32 and in the bf16 packing. It is read again when what it reads changes."""
    model = tiny_model("qwen3_moe", dtype=dtype)
    _, experts = experts_modules(model)[0]
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(6, 32, generator=g).to(dtype), torch.randint(0, 6, (6, 2), generator=g), torch.rand(6, 2)
    with torch.no_grad():
        y = apex_ffn.hf.apex_experts_forward(experts, x, ids, w)
        experts.act_fn = torch.nn.GELU()
        with pytest.raises(apex_ffn.ConfigError, match="its gated activation \\(GELU.*not one the library has"):
            apex_ffn.hf.apex_experts_forward(experts, x, ids, w)
        experts.act_fn = torch.nn.SiLU()
        assert torch.equal(apex_ffn.hf.apex_experts_forward(experts, x, ids, w), y)
        experts.is_concatenated = False  # interleaved gate/up: no SiLU kind of the library reads it
        with pytest.raises(apex_ffn.ConfigError, match="interleaved gate/up\\) is not one the library has"):
            apex_ffn.hf.apex_experts_forward(experts, x, ids, w)


def test_no_gate_and_post_norm_refused():
    class Fake(torch.nn.Module):
        has_gate = False
    with pytest.raises(apex_ffn.ConfigError, match="has_gate=False"):
        apex_ffn.hf.apex_experts_forward(Fake(), torch.randn(1, 4), torch.zeros(1, 1, dtype=torch.long),
                                         torch.ones(1, 1))
    Fake.has_gate, Fake.has_post_expert_norm = True, True
    with pytest.raises(apex_ffn.ConfigError, match="has_post_expert_norm"):
        apex_ffn.hf.apex_experts_forward(Fake(), torch.randn(1, 4), torch.zeros(1, 1, dtype=torch.long),
                                         torch.ones(1, 1))


def test_negative_bit_views_are_read_as_their_values():
    """A lazily negated view (negative bit set, as z.conj().imag gives) holds its values un-negated in
    memory, and DLPack hands that memory over as it is: the implementation's ops go through torch's
    dispatcher, which resolves the bit before a kernel sees the tensor (the packed module's inference
    call, which skips the dispatcher, resolves it itself: test_packed.py)."""
    model = tiny_model("qwen3_moe")
    ours = copy.deepcopy(model)
    ours.set_experts_implementation("apex_ffn")
    (_, ref), (_, mod) = experts_modules(model)[0], experts_modules(ours)[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, model.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(model.config.num_experts, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    neg = torch._neg_view(-x)
    assert neg.is_neg() and torch.equal(neg, x)
    with torch.no_grad():
        assert rel(mod(neg, ids, torch._neg_view(-w)), ref(x, ids, w)) <= 1e-5
    # Autograd hands a gradient to the backward as it is, negative bit included.
    dy = torch.randn(6, model.config.hidden_size, generator=g)
    assert torch.equal(grads_for(mod, x, ids, w, torch._neg_view(-dy)), grads_for(mod, x, ids, w, dy))


def grads_for(module, x, ids, w, dy):
    """The gradients of x, w and the module's parameters when its output is given gradient dy, flattened."""
    module.zero_grad(set_to_none=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    module(xr, ids, wr).backward(dy)
    found = [xr.grad, wr.grad] + [p.grad for p in module.parameters() if p.grad is not None]
    assert len(found) > 2  # the weights' gradients too
    return torch.cat([t.reshape(-1) for t in found])


def test_inputs_of_wrong_dtypes_are_refused():
    """The implementation casts its inputs to float32 and int64: float or boolean ids, integer or complex
    hidden states and integer weights are refused by name instead of truncated; integer ids of any width run."""
    model = tiny_model("qwen3_moe")
    _, experts = experts_modules(model)[0]
    x, ids, w = torch.randn(5, 32), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
    for args, name, dtype in (((x, ids.float() + 0.7, w), "top_k_index", "torch.float32"),
                              ((x, ids > 2, w), "top_k_index", "torch.bool"),
                              ((x.long(), ids, w), "hidden_states", "torch.int64"),
                              ((x.to(torch.complex64), ids, w), "hidden_states", "torch.complex64"),
                              ((x, ids, (w * 3).long()), "top_k_weights", "torch.int64")):
        with pytest.raises(ValueError, match=f"Qwen3MoeExperts: argument '{name}' has dtype {dtype}"):
            apex_ffn.hf.apex_experts_forward(experts, *args)
    y = apex_ffn.hf.apex_experts_forward(experts, x, ids, w)
    assert torch.equal(apex_ffn.hf.apex_experts_forward(experts, x, ids.int(), w), y)
