"""Gradients through packed experts without adapters (to the hidden states, the routing weights, the router
and the layers before: the packed experts frozen, the rest of the model trained), and a backward that runs
on the experts its forward ran on when the module is collected or loaded anew in between."""
import copy
import gc

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
from apex_ffn import ops  # noqa: E402
from apex_ffn.packed import experts_as_float, pack_experts  # noqa: E402
from families import tiny_model  # noqa: E402
from test_packed import rel, tiny_packed, wide_model  # noqa: E402


def loss_grads(module, x, ids, w):
    """y and (∂L/∂x, ∂L/∂w) of L = Σ y·c through `module`."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = module(x, ids, w)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("family,types", [("qwen3_moe", "f32"), ("qwen3_moe", "q8_0"), ("qwen3_moe", "q4_k"),
                                          ("gpt_oss", "mxfp4")])
def test_gradients_pass_frozen_packed_experts(family, types):
    """A packed experts module without adapters, inputs requiring grad: ∂L/∂x and ∂L/∂w equal eager autograd
    through the float module holding the packed weights (the exported state dict), to float32 rounding."""
    ref = wide_model(family)
    model = copy.deepcopy(ref)
    pack_experts(model, types)
    with experts_as_float(model):
        ref.load_state_dict(model.state_dict())  # the eager model runs on exactly the packed weights
    name = "model.layers.0.mlp.experts"
    g = torch.Generator().manual_seed(3)
    c = ref.config
    e = c.num_local_experts if family == "gpt_oss" else c.num_experts
    x = torch.randn(9, c.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:c.num_experts_per_tok] for _ in range(9)])
    w = torch.rand(9, c.num_experts_per_tok, generator=g)
    got = loss_grads(model.get_submodule(name), x, ids, w)
    want = loss_grads(ref.get_submodule(name), x, ids, w)
    for a, b in zip(got, want):
        assert rel(a, b) <= 1e-5


def test_router_and_attention_train_through_packed_experts():
    """The whole model with packed (frozen) experts: the router's and an attention projection's gradients
    equal those of the eager model on the same weights."""
    ref = tiny_model("qwen3_moe")
    model = copy.deepcopy(ref)
    pack_experts(model, "f32")
    ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (model, ref):
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        grads.append([m.get_parameter(p).grad for p in ("model.layers.0.mlp.gate.weight",
                                                        "model.layers.0.self_attn.q_proj.weight")])
    for a, b in zip(*grads):
        assert a is not None and rel(a, b) <= 1e-4


@pytest.mark.parametrize("lora", [False, True])
def test_backward_runs_on_its_forwards_experts(lora):
    """A forward's backward uses the experts the forward ran on: the same gradients when the module is
    collected before the backward, or loaded with other weights (load_state_dict) in between; the kept
    experts are released with the graph."""
    gc.collect()
    start = len(ops._PACKED)
    model = tiny_packed(lora)
    module = model.get_submodule("model.layers.0.mlp.experts")
    other = tiny_packed(False, seed=9)
    x, ids, w = torch.randn(5, 32), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
    expected = loss_grads(module, x, ids, w)
    with experts_as_float(model), experts_as_float(other):
        original, others = model.state_dict(), other.state_dict()
    for change in ("load", "collect"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = module(xs, ids, ws)
        if change == "load":
            model.load_state_dict(others, strict=False)  # the experts, not the adapters
            assert not torch.equal(module(x, ids, w).detach(), expected[0])  # the module runs on the new experts
        else:
            del model, module
            gc.collect()
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        assert torch.equal(xs.grad, expected[1]) and torch.equal(ws.grad, expected[2]), change
        if change == "load":
            model.load_state_dict(original)
    del y, other
    gc.collect()
    assert len(ops._PACKED) == start


def test_compiled_gradients_pass_frozen_packed_experts():
    """torch.compile(fullgraph=True) traces the adapter-free training forward and its backward."""
    model = tiny_model("qwen3_moe")
    pack_experts(model, "f32")
    module = model.get_submodule("model.layers.0.mlp.experts")
    x, ids, w = torch.randn(5, 32), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
    want = loss_grads(module, x, ids, w)
    got = loss_grads(torch.compile(module, fullgraph=True), x, ids, w)
    for a, b in zip(got, want):
        assert rel(a, b) <= 1e-6
