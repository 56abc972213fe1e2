"""Packed experts in transformers models (apex_ffn.packed.pack_experts): outputs
against eager to each storage type's tolerance, from the model's weights and
from a GGUF file, generate, and the refusals (nothing half-replaced)."""
import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import apex_ffn  # noqa: E402
from apex_ffn.packed import PackedExpertsModule, experts_modules, pack_experts  # noqa: E402
from families import experts_modules as float_experts_modules, tiny_model  # noqa: E402

# hidden and intermediate widths of 256: every block format holds whole blocks (K-quants: 256)
WIDE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64)

# Storage type → (tolerance of one experts module's output, reference): "dequantized" compares with eager on the
# weights gguf-py quantizes and dequantizes (ggml's rounding), so the tolerance is that of the activations'
# quantization; "float" with eager on the float weights (the K-quants have no quantizer in gguf-py).
TYPES = {"f32": (1e-5, "float"), "bf16": (1e-2, "float"), "f16": (2e-3, "float"), "q8_0": (2e-2, "dequantized"),
         "q4_0": (3e-2, "dequantized"), "mxfp4": (3e-2, "dequantized"), "q4_k": (0.2, "float"),
         "q6_k": (0.08, "float"), "q4_k/q6_k": (0.2, "float")}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def wide_model(family="qwen3_moe", seed=0):
    from families import BASE, FAMILIES
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    extra = dict(FAMILIES[family])
    extra.update({k: v for k, v in WIDE.items() if k in ("hidden_size", "num_attention_heads", "head_dim")})
    for k in ("moe_intermediate_size", "intermediate_size"):
        if k in extra:
            extra[k] = 256
    cfg = AutoConfig.for_model(family, **{**BASE, **extra})
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "router" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.05)
    return model.eval()


def gguf_roundtrip(t, qname):
    """t quantized to ggml type qname by gguf-py and dequantized (float32, same shape)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
    q = quantize(t.detach().numpy().reshape(-1, t.shape[-1]), Q[qname.upper()])
    return torch.from_numpy(dequantize(q, Q[qname.upper()]).reshape(t.shape).copy())


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def routed_inputs(model, tokens=40, seed=2):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    x = torch.randn(tokens, c.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(c.num_experts, generator=g)[:c.num_experts_per_tok] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, c.num_experts_per_tok, generator=g)


@pytest.mark.parametrize("types", sorted(TYPES))
def test_qwen3_moe_packed_matches_eager(types):
    tol, against = TYPES[types]
    ref = wide_model()
    ours = copy.deepcopy(ref)
    names = pack_experts(ours, types)
    assert names == [n for n, _ in float_experts_modules(ref)] and len(names) == 2
    assert all(isinstance(ours.get_submodule(n), PackedExpertsModule) for n in names)
    assert not any("experts" in n for n, _ in ours.named_parameters())  # the float weights are gone
    if against == "dequantized":
        pytest.importorskip("gguf", reason="gguf-py is not installed")
        with torch.no_grad():
            for _, m in float_experts_modules(ref):
                m.gate_up_proj.copy_(gguf_roundtrip(m.gate_up_proj, types))
                m.down_proj.copy_(gguf_roundtrip(m.down_proj, types))
    x, ids, w = routed_inputs(ref)
    for n in names:
        packed = ours.get_submodule(n)
        assert packed.packed.types == types
        with torch.no_grad():
            assert rel(packed(x, ids, w), ref.get_submodule(n)(x, ids, w)) <= tol, n
    if types in ("f32", "bf16", "q8_0"):  # the whole model: routing may flip on a coarser type
        tokens = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
        assert rel(logits(ours, tokens), logits(ref, tokens)) <= 10 * tol


def test_copies_share_the_weights_and_outlive_the_original():
    ref = tiny_model("qwen3_moe")
    ours = copy.deepcopy(ref)
    pack_experts(ours, "f32")
    twin = copy.deepcopy(ours)
    a, b = ours.get_submodule("model.layers.0.mlp.experts"), twin.get_submodule("model.layers.0.mlp.experts")
    assert a.packed is b.packed and a.handle != b.handle
    ids = torch.tensor([[1, 2, 3, 4]])
    expected = logits(ours, ids)
    del ours, a
    import gc
    gc.collect()
    assert torch.equal(logits(twin, ids), expected)


def _routed_grads(module, x, ids, w):
    """The module's output with grad enabled; with adapters also the gradients (∂L/∂x, ∂L/∂w, ∂L/∂ each adapter
    tensor) for L = Σ y·c (without them the packed forward has no backward: packed_experts_train has)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = module(x, ids, w)
    if module.lora is None:
        return [y.detach()]
    adapters = list(module.lora.parameters())
    for p in adapters:
        p.grad = None
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return [y.detach(), x.grad, w.grad] + [p.grad.clone() for p in adapters]


def tiny_packed(lora, seed=0):
    """A tiny Qwen3-MoE model with f32 packed experts, with LoRA adapters of nonzero values when `lora` (B is
    zero when made: the adapters would add nothing)."""
    from apex_ffn.lora import add_lora
    model = tiny_model("qwen3_moe", seed=seed)
    pack_experts(model, "f32")
    if lora:
        add_lora(model, 2, 4)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(5))
    return model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("collected", ["original", "copy"])
def test_shallow_copies_hold_their_own_handle(lora, collected):
    """copy.copy of a packed experts module: the packed weights (and adapters) shared, a registry handle of its
    own, so the gradient and LoRA paths of either keep working when the other is collected; the registry is
    back to its size when both are gone."""
    import gc
    from apex_ffn import ops
    gc.collect()
    start = len(ops._PACKED)
    model = tiny_packed(lora)
    original = model.get_submodule("model.layers.0.mlp.experts")
    del model
    gc.collect()
    assert len(ops._PACKED) == start + 1
    x, ids, w = torch.randn(5, 32), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
    expected = _routed_grads(original, x, ids, w)
    with torch.no_grad():
        inferred = original(x, ids, w)
    twin = copy.copy(original)
    assert type(twin) is PackedExpertsModule and twin.packed is original.packed
    assert twin.lora is original.lora and twin.training == original.training
    handles = {original.handle, twin.handle}
    modules = {"original": original, "copy": twin}
    del original, twin
    del modules[collected]
    kept = modules.popitem()[1]
    gc.collect()
    got = _routed_grads(kept, x, ids, w)  # was: ConfigError, no packed experts with handle N (released?)
    assert len(got) == len(expected) == (7 if lora else 1)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(kept(x, ids, w), inferred)
    assert len(handles) == 2 and len(ops._PACKED) == start + 1 and kept.handle in ops._PACKED
    del kept
    gc.collect()
    assert len(ops._PACKED) == start


def test_shallow_copy_shares_the_adapters_not_their_slot():
    """The copy's adapters are the original's (the same parameters, as nn.Module's shallow copy shares them);
    adapters attached to or removed from one afterwards leave the other's as they were."""
    from apex_ffn.lora import ExpertsLora, add_lora
    model = tiny_model("qwen3_moe")
    pack_experts(model, "f32")
    add_lora(model, 2, 4)
    a = model.get_submodule("model.layers.0.mlp.experts")
    b = copy.copy(a)
    assert b.lora is a.lora and [p for p in b.parameters()] == [p for p in a.parameters()]
    assert b.lora_config == a.lora_config
    lora = a.lora
    b.lora = None
    assert a.lora is lora and b.lora is None and not list(b.parameters())
    add_lora(model, 3, 6)
    assert isinstance(a.lora, ExpertsLora) and a.lora.r == 3 and b.lora is None
    b.register_forward_hook(lambda *args: None)
    assert not a._forward_hooks


def test_forward_seconds_computes_the_forward_and_checks_like_it():
    """PackedExperts.forward_seconds (the C++-timed forward bench_python compares the Python call with)
    writes the module's output and refuses what the forward refuses."""
    model = tiny_model("qwen3_moe")
    pack_experts(model, "bf16")
    module = model.get_submodule("model.layers.0.mlp.experts")
    g = torch.Generator().manual_seed(3)
    n, k, d = 5, 2, model.config.hidden_size
    x = torch.randn(n, d, generator=g)
    ids = torch.stack([torch.randperm(model.config.num_experts, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    with torch.no_grad():
        expected = module(x, ids, w)
    y, ys = torch.empty(n, d), torch.empty(n * k, d)
    seconds = module.packed.forward_seconds(x, ids, w, False, y, ys, 1, 3)
    assert seconds > 0 and torch.equal(y, expected)
    # y_sorted None: the extension's scratch (what the module's inference forward passes)
    for call in (lambda out: module.packed.forward(x, ids, w, False, out, None, 1),
                 lambda out: module.packed.forward_seconds(x, ids, w, False, out, None, 1, 1)):
        y2 = torch.full((n, d), float("nan"))
        call(y2)
        assert torch.equal(y2, expected)
    ys = torch.full((n * k, d), float("nan"))
    module.packed.forward(x, ids, w, False, y2, ys, 1)
    assert torch.equal(y2, expected) and not ys.isnan().any()  # a y_sorted given is written
    with pytest.raises(apex_ffn.ConfigError, match="reps must be at least 1"):
        module.packed.forward_seconds(x, ids, w, False, y, ys, 1, 0)
    with pytest.raises(apex_ffn.ShapeError, match="y_sorted.*expected \\(10, "):
        module.packed.forward_seconds(x, ids, w, False, y, torch.empty(n, d), 1, 1)


@pytest.fixture(params=["exchange table", "attributes"])
def tensor_reads(request):
    """PackedExperts.infer's two ways of reading a tensor: torch's DLPack exchange table (DLPack >= 1.3's; torch 2.15 has it) and
    the tensor's attributes (older torch)."""
    from apex_ffn import _core
    exchange = request.param == "exchange table"
    if not _core._exchange_reads(exchange) and exchange:
        pytest.skip("this torch publishes no DLPack >= 1.3 exchange table (__dlpack_c_exchange_api__): only the "
                    "attribute reads run")
    yield request.param
    _core._exchange_reads(True)


@pytest.mark.parametrize("types", ["bf16", "f32"])
def test_infer_is_the_checked_forward_in_one_call(types, tensor_reads):
    """PackedExperts.infer (the module's inference call: tensors read without DLPack's Python protocol, y
    allocated in C++) gives the checked path's bits for float32 and bf16 inputs, views with an offset or a
    size-1 dimension's stride among them; anything not plain gives None, and the module's checked path then
    computes it or names what is wrong."""
    from apex_ffn import ops
    model = tiny_model("qwen3_moe")
    pack_experts(model, types)
    module = model.get_submodule("model.layers.0.mlp.experts")
    p, n, k, d = module.packed, 7, 2, model.config.hidden_size
    g = torch.Generator().manual_seed(4)
    x32 = torch.randn(n, d, generator=g)
    ids = torch.stack([torch.randperm(model.config.num_experts, generator=g)[:k] for _ in range(n)])
    w32 = torch.rand(n, k, generator=g)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x, w = x32.to(dtype), w32.to(dtype)
            checked = ops.packed_forward(x.float(), ids, w.float(), module.handle, False, dtype == torch.bfloat16)
            y = p.infer(x, ids, w, False, 2)
            assert y.dtype == dtype and torch.equal(y, checked.to(dtype)), dtype
            assert torch.equal(module(x, ids, w), y)
        expected = module(x32, ids, w32)
        big = torch.randn(3 * n, d, generator=g)
        for what, view in {"rows at an offset": big[n:2 * n], "one row of a strided view": big[::3][:1]}.items():
            rows = view.size(0)
            y = p.infer(view, ids[:rows], w32[:rows], False, 1)
            assert y is not None and view.is_contiguous(), what
            assert torch.equal(y, module(view.clone(), ids[:rows], w32[:rows])), what
        assert p.infer(x32.to("meta"), ids, w32, False, 1) is None
        not_plain = {
            "non-contiguous x": (torch.randn(d, n, generator=g).t(), ids, w32),
            "float16 x and weights": (x32.half(), ids, w32.half()),
            "x float32, weights bf16": (x32, ids, w32.bfloat16()),
            "int32 ids": (x32, ids.int(), w32),
            "negative-bit view": (torch._neg_view(-x32), ids, w32),
            "a Parameter": (torch.nn.Parameter(x32, requires_grad=False), ids, w32),
            "a strided column of weights": (x32, ids[:, :1].contiguous(), w32[:, 1:]),
        }
        for what, args in not_plain.items():
            assert p.infer(*args, False, 1) is None, what
            x, i, w = args  # the checked path: float32 computation, the output in x's dtype
            plain = module(x.detach().float().contiguous(), i.long(), w.float())
            assert torch.equal(module(*args), plain.to(x.dtype)), what
        assert torch.equal(module(torch._neg_view(-x32), ids, w32), expected)
        for what, args in {"x one column short": (x32[:, 1:].contiguous(), ids, w32),
                           "3-D x": (x32[None], ids, w32), "weights of another shape": (x32, ids, w32[:, :1])}.items():
            assert p.infer(*args, False, 1) is None, what
            with pytest.raises(apex_ffn.ShapeError):
                module(*args)
        bad = ids.clone()
        bad[3, 1] = model.config.num_experts
        with pytest.raises(apex_ffn.ApexValueError, match="infer: argument 'top_k_index' has expert id"):
            p.infer(x32, bad, w32, False, 1)
        with pytest.raises(apex_ffn.ConfigError, match="threads must be at least 1"):
            p.infer(x32, ids, w32, False, 0)


def test_a_torch_func_transform_is_refused_by_name(tensor_reads):
    """vmap over the module (grad off): its batched tensors have no memory of their own; infer declines them
    (with either read) and the checked path raises a ValueError naming the transform, not a signature
    mismatch or torch's data-pointer error. Under torch.func.grad torch's custom-op autograd raises its own."""
    model = tiny_model("qwen3_moe")
    pack_experts(model, "f32")
    module = model.get_submodule("model.layers.0.mlp.experts")
    n, k, d = 5, 2, model.config.hidden_size
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, n, d, generator=g)
    ids = torch.stack([torch.randperm(model.config.num_experts, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    with torch.no_grad(), pytest.raises(apex_ffn.ApexValueError, match="'hidden_states' is a tensor of a torch.func"):
        torch.vmap(lambda xi: module(xi, ids, w))(x)
    with pytest.raises(RuntimeError, match="functorch"):  # torch's custom-op autograd: no functorch rule
        torch.func.grad(lambda xi: module(xi, ids, w).sum())(x[0])


def test_infer_outputs_are_new_tensors_of_the_call_shape():
    """infer allocates its outputs a few at a time and keeps the spares: every output held stays as it was
    (no two share memory), a call of another shape or dtype gets its own shape and dtype, an output made
    under no_grad after calls under inference_mode is an ordinary tensor (and the other way round), and a
    call without a thread count runs on apex_ffn's setting."""
    model = tiny_model("qwen3_moe")
    pack_experts(model, "bf16")
    module = model.get_submodule("model.layers.0.mlp.experts")
    p, k, d = module.packed, 2, model.config.hidden_size
    g = torch.Generator().manual_seed(6)

    def inputs(n, dtype):
        ids = torch.stack([torch.randperm(model.config.num_experts, generator=g)[:k] for _ in range(n)])
        return torch.randn(n, d, generator=g).to(dtype), ids, torch.rand(n, k, generator=g).to(dtype)

    held = []
    with torch.no_grad():
        for n, dtype in [(1, torch.float32)] * 11 + [(3, torch.float32), (1, torch.bfloat16), (1, torch.float32)]:
            x, ids, w = inputs(n, dtype)
            y = module(x, ids, w)
            assert y.shape == (n, d) and y.dtype == dtype
            x2, ids2, w2 = inputs(n, dtype)
            held.append((y, y.clone(), module(x.clone(), ids, w), p.infer(x2, ids2, w2, False, 1), (x2, ids2, w2)))
        assert len({t.data_ptr() for h in held for t in (h[0], h[3])}) == 2 * len(held)
        for y, copy_at_return, again, other, other_args in held:
            assert torch.equal(y, copy_at_return) and torch.equal(y, again)
            assert torch.equal(other, p.infer(*other_args, False, 1))
    x, ids, w = inputs(1, torch.float32)
    for first, then in ((torch.inference_mode, torch.no_grad), (torch.no_grad, torch.inference_mode)):
        with first():
            made_first = module(x, ids, w)
        with then():
            made_then = module(x, ids, w)
        assert made_first.is_inference() == (first is torch.inference_mode)
        assert made_then.is_inference() == (then is torch.inference_mode)
        assert torch.equal(made_first, made_then)
    try:
        apex_ffn.set_num_threads(2)
        assert apex_ffn.get_num_threads() == 2
        with torch.no_grad():
            x, ids, w = inputs(5, torch.float32)
            assert torch.equal(p.infer(x, ids, w, False), p.infer(x, ids, w, False, 1))
    finally:
        apex_ffn.set_num_threads(None)
    for bad in (True, 0, 2**31):
        with pytest.raises(ValueError, match="positive int"):
            apex_ffn.set_num_threads(bad)


def test_tensors_without_memory_are_refused():
    """Under a fake-tensor mode or functionalize at inference, tensors have shapes but no memory: a clear
    error naming the argument, never a write through a null pointer."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = tiny_model("qwen3_moe")
    pack_experts(model, "bf16")
    module = model.get_submodule("model.layers.0.mlp.experts")
    x, ids, w = routed_inputs(model, tokens=3)
    with torch.no_grad():
        with pytest.raises(ValueError, match="has no memory"), FakeTensorMode(allow_non_fake_inputs=True):
            module(x, ids, w)
        with pytest.raises(ValueError, match="has no memory"):
            torch.func.functionalize(module)(x, ids, w)
        assert torch.equal(module(x, ids, w), module(x.clone(), ids, w))  # and the module still computes


def test_packed_module_compiles_fullgraph():
    """The packed experts module under torch.compile(fullgraph=True), with and without adapters, with and
    without grad: the same outputs as eager (the compiled graph calls the custom ops)."""
    from apex_ffn.lora import add_lora
    for lora in (False, True):
        model = tiny_model("qwen3_moe")
        pack_experts(model, "bf16")
        if lora:
            add_lora(model, 2, 4)
        module = model.get_submodule("model.layers.0.mlp.experts")
        x, ids, w = routed_inputs(model, tokens=5)
        eager = module(x, ids, w).detach()
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x, ids, w).detach(), eager), lora
        with torch.no_grad():
            assert torch.equal(compiled(x, ids, w), eager), lora


def test_gpt_oss_packed_clamped_with_biases():
    ref = wide_model("gpt_oss")
    ours = copy.deepcopy(ref)
    pack_experts(ours, "f32")
    ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert rel(logits(ours, ids), logits(ref, ids)) <= 1e-5
    assert ours.get_submodule("model.layers.0.mlp.experts").layout.gate == "clamped"


def test_bf16_model_and_generate():
    ref = tiny_model("qwen3_moe")
    ours = copy.deepcopy(ref)
    pack_experts(ours, "f32")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=8, do_sample=False)
        b = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)
    half = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    ref16 = copy.deepcopy(half)
    pack_experts(half, "bf16")
    assert rel(logits(half, ids).float(), logits(ref16, ids).float()) <= 2e-2


def write_gguf(model, path, qname):
    """The model's routers and experts as a GGUF file (arch qwen3moe), quantized by gguf-py."""
    gguf = pytest.importorskip("gguf", reason="gguf-py is not installed")
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    f = c.moe_intermediate_size
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight.detach().numpy())
        gu, dn = mlp.experts.gate_up_proj.detach(), mlp.experts.down_proj.detach()
        for tensor, t in (("ffn_gate_exps", gu[:, :f]), ("ffn_up_exps", gu[:, f:]), ("ffn_down_exps", dn)):
            q = quantize(t.contiguous().numpy().reshape(-1, t.shape[-1]), Q[qname])
            w.add_tensor(f"blk.{i}.{tensor}.weight", q.reshape(t.shape[0], t.shape[1], -1), raw_dtype=Q[qname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_experts_equal_the_library_quantization(tmp_path):
    """gguf-py's Q8_0 bytes are ggml's, as are the library's: the file's experts and the model's own weights
    packed as q8_0 give the same bits; a meta-initialised model runs from the file alone."""
    ref = wide_model()
    path = tmp_path / "tiny-q8_0.gguf"
    write_gguf(ref, path, "Q8_0")
    from_file, from_weights = copy.deepcopy(ref), copy.deepcopy(ref)
    pack_experts(from_file, gguf=path)
    pack_experts(from_weights, "q8_0")
    ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(from_file, ids), logits(from_weights, ids))
    with torch.no_grad():
        a = from_file.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
        b = from_weights.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
    assert a.shape == (1, 10) and torch.equal(a, b)
    m = from_file.get_submodule("model.layers.1.mlp.experts")
    assert m.packed.types == "q8_0" and "block 1" in m.source
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(ref.config)
    with pytest.raises(apex_ffn.ConfigError, match="has no weights \\(a meta-initialised model\\)"):
        pack_experts(meta, "q8_0")
    pack_experts(meta, gguf=path)
    assert isinstance(meta.get_submodule("model.layers.0.mlp.experts"), PackedExpertsModule)


def test_errors_leave_the_model_unchanged(tmp_path):
    model = wide_model()
    before = [type(m) for _, m in float_experts_modules(model)]
    with pytest.raises(apex_ffn.ConfigError, match="unknown storage type 'q3_k'"):
        pack_experts(model, "q3_k")
    with pytest.raises(apex_ffn.ConfigError, match="give either types .* or gguf"):
        pack_experts(model)
    small = tiny_model("qwen3_moe")  # widths 32 and 16: not whole q8_0 blocks, found at the first module
    with pytest.raises(apex_ffn.ConfigError, match="reduction length 16 is not a multiple of 32"):
        pack_experts(small, "q8_0")
    assert all(not isinstance(m, PackedExpertsModule) for _, m in float_experts_modules(small))
    path = tmp_path / "other.gguf"
    write_gguf(small, path, "F32")
    with pytest.raises(apex_ffn.ShapeError, match="model.layers.0.mlp.experts has 6 experts of 256 x 256"):
        pack_experts(model, gguf=path)
    # the last layer's block is missing from the file: the first layer stays as it was too
    one = tmp_path / "one-block.gguf"
    cut = copy.deepcopy(model)
    cut.model.layers = cut.model.layers[:1]
    cut.config.num_hidden_layers = 1
    write_gguf(cut, one, "Q8_0")
    with pytest.raises(apex_ffn.ConfigError, match="block 1 does not exist \\(qwen3moe.block_count = 1\\)"):
        pack_experts(model, gguf=one)
    assert [type(m) for _, m in float_experts_modules(model)] == before
    with pytest.raises(apex_ffn.FormatError, match="not-there.gguf"):
        pack_experts(model, gguf=tmp_path / "not-there.gguf")
    with pytest.raises(apex_ffn.ConfigError, match="has no experts module"):
        pack_experts(torch.nn.Linear(2, 2), "f32")


def test_thread_counts_are_refused_as_set_num_threads_refuses():
    """0 or -1 threads ran on one thread without a word, where apex_ffn.set_num_threads refuses them."""
    model = tiny_model("qwen3_moe")
    before = [type(m) for _, m in float_experts_modules(model)]
    for n in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"pack_experts: argument 'threads': expected a positive int or None, "
                                             f"got {n!r}"):
            pack_experts(model, "f32", threads=n)
    assert [type(m) for _, m in float_experts_modules(model)] == before
    assert pack_experts(model, "f32", threads=2) == [n for n, _ in float_experts_modules(model)]
    gu, dn = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    for n in (0, -1):
        with pytest.raises(ValueError, match=f"from_float: argument 'threads': expected a positive int, got {n}"):
            apex_ffn.PackedExperts.from_float(gu, dn, None, None, "silu", False, False, 1.7, 7.0, "f32", n)
    assert apex_ffn.PackedExperts.from_float(gu, dn, None, None, "silu", False, False, 1.7, 7.0, "f32", 1).experts == 2


def test_transformers_gguf_load_with_packed_experts(tmp_path):
    """A whole GGUF model file (examples/python/make_tiny_gguf.py) loaded by transformers, dequantized, against
    the same load with the file's expert blocks swapped in: the logits to q8_0's tolerance, the greedy tokens."""
    pytest.importorskip("gguf", reason="gguf-py is not installed")
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
    from make_tiny_gguf import make_tiny_qwen3_moe_gguf
    path = tmp_path / "tiny.gguf"
    make_tiny_qwen3_moe_gguf(path, "Q8_0")
    load = dict(gguf_file=path.name, moe_intermediate_size=256, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **load).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **load).eval()
    pack_experts(ours, gguf=path)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    assert rel(logits(ours, prompt), logits(ref, prompt)) <= 3e-2
    with torch.no_grad():
        a = ref.generate(prompt, max_new_tokens=4, do_sample=False)
        b = ours.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_inputs_of_wrong_dtypes_are_refused():
    """The module casts its inputs to float32 and int64: float or boolean ids (1.7 would be expert 1), integer or
    complex hidden states and integer weights are refused by name instead, in inference and with gradients.
    Every integer id dtype and floating-point input dtype is read."""
    model = tiny_model("qwen3_moe")
    ref = copy.deepcopy(model)
    pack_experts(model, "f32")
    mod, (_, eager) = model.get_submodule("model.layers.0.mlp.experts"), float_experts_modules(ref)[0]
    x, ids, w = torch.randn(5, 32), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for args, name, dtype in (((x, ids.float() + 0.7, w), "top_k_index", "torch.float32"),
                                      ((x, ids > 2, w), "top_k_index", "torch.bool"),
                                      ((x.long(), ids, w), "hidden_states", "torch.int64"),
                                      ((x.to(torch.complex64), ids, w), "hidden_states", "torch.complex64"),
                                      ((x, ids, (w * 3).long()), "top_k_weights", "torch.int64")):
                with pytest.raises(ValueError, match=f"PackedExpertsModule: argument '{name}' has dtype {dtype}"):
                    mod(*args)
            y = eager(x, ids, w)
            for args in ((x, ids.int(), w), (x, ids.to(torch.uint8), w), (x.double(), ids, w.double())):
                assert rel(mod(*args).float(), y) <= 1e-5
