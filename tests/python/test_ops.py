"""The custom operators: outputs and gradients against the PyTorch
reference, opcheck, torch.compile(fullgraph=True), threads, kernel paths,
the GIL, and the errors of bad input."""
import threading
import time

import pytest
import torch

import apex_ffn
from apex_ffn import ops
from reference import experts as reference, rel

E, D, F, N, K = 5, 32, 24, 7, 2


def case(transposed=False, bias=False, seed=0, n=N, requires_grad=True, d=D, f=F):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(n, d)
    ids = torch.randint(0, E, (n, K), generator=g)
    w = torch.rand(n, K, generator=g)
    gu = r(E, d, 2 * f) * 0.3 if transposed else r(E, 2 * f, d) * 0.3
    dn = r(E, f, d) * 0.3 if transposed else r(E, d, f) * 0.3
    gb, db = (r(E, 2 * f) * 0.1, r(E, d) * 0.1) if bias else (None, None)
    ts = [x, w, gu, dn, gb, db]
    if requires_grad:
        for t in ts:
            if t is not None:
                t.requires_grad_()
    return x, ids, w, gu, dn, gb, db


LAYOUTS = [  # gate, transposed, interleaved, bias: the interface's flags as the families set them
    ("silu", False, False, False),   # Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V3
    ("silu", True, False, False),    # is_transposed (Aria-style)
    ("silu", False, False, True),    # has_bias with a SiLU gate
    ("clamped", True, True, True),   # gpt-oss
    ("clamped", False, False, True),
]


@pytest.mark.parametrize("gate,transposed,interleaved,bias", LAYOUTS)
def test_float_experts_forward_backward(gate, transposed, interleaved, bias):
    x, ids, w, gu, dn, gb, db = case(transposed, bias)
    y, _, _ = ops.float_experts(x, ids, w, gu, dn, gb, db, gate, transposed, interleaved, 1.702, 7.0, False)
    y_ref = reference(x, ids, w, gu, dn, gb, db, gate, transposed, interleaved)
    assert rel(y, y_ref) <= 1e-5
    params = [t for t in (x, w, gu, dn, gb, db) if t is not None]
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(y_ref, params, dy)):
        assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("n", [3, 40, 160])
@pytest.mark.parametrize("gate,transposed,interleaved,bias", LAYOUTS)
def test_float_experts_both_product_paths_odd_widths(gate, transposed, interleaved, bias, n):
    """An expert's rows below 16 take the streaming products, 16 and more the engine's tiles (N = 40: both
    in one call; 160: the tiles everywhere); odd widths leave partial panels and remainders."""
    x, ids, w, gu, dn, gb, db = case(transposed, bias, seed=n, n=n, d=37, f=29)
    y, _, _ = ops.float_experts(x, ids, w, gu, dn, gb, db, gate, transposed, interleaved, 1.702, 7.0, False)
    y_ref = reference(x, ids, w, gu, dn, gb, db, gate, transposed, interleaved)
    assert rel(y, y_ref) <= 1e-5
    rows = torch.bincount(ids.flatten(), minlength=E)
    assert n != 40 or (rows.min() < 16 <= rows.max())
    params = [t for t in (x, w, gu, dn, gb, db) if t is not None]
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(y_ref, params, dy)):
        assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("gate,transposed,interleaved,bias", LAYOUTS)
def test_float_experts_opcheck(gate, transposed, interleaved, bias):
    x, ids, w, gu, dn, gb, db = case(transposed, bias)
    torch.library.opcheck(torch.ops.apex_ffn.float_experts.default,
                          (x, ids, w, gu, dn, gb, db, gate, transposed, interleaved, 1.702, 7.0, False))
    dy = torch.randn(N, D)
    _, ys, work = ops.float_experts(x, ids, w, gu, dn, gb, db, gate, transposed, interleaved, 1.702, 7.0, False)
    torch.library.opcheck(torch.ops.apex_ffn.float_experts_backward.default,
                          (x.detach(), ids, w.detach(), gu.detach(), dn.detach(), None if gb is None else gb.detach(),
                           None if db is None else db.detach(), gate, transposed,
                           interleaved, 1.702, 7.0, False, dy, ys, work, True, bias),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def packed(gate="silu", transposed=False, types="f32", seed=0):
    _, _, _, gu, dn, gb, db = case(transposed, gate == "clamped", seed, requires_grad=False)
    p = apex_ffn.PackedExperts.from_float(gu, dn, gb, db, gate, transposed, transposed and gate == "clamped", 1.702,
                                          7.0, types, 2)
    return p, ops.register_packed(p), (gu, dn, gb, db)


def test_packed_f32_equals_float_experts():
    p, h, (gu, dn, gb, db) = packed()
    x, ids, w, *_ = case(requires_grad=False)
    y = ops.packed_experts(x, ids, w, h, False)
    y_ref = reference(x, ids, w, gu, dn)
    assert rel(y, y_ref) <= 1e-5
    assert p.types == "f32" and p.experts == E and p.d_model == D and p.d_ffn == F


@pytest.mark.parametrize("gate,transposed", [("silu", False), ("clamped", True)])
def test_bf16_activations_pair_products_only_where_they_can(gate, transposed):
    """bf16 SiLU experts on the avx512_bf16 and amx_bf16 paths multiply in bf16 pairs when told the inputs are a bf16
    model's; every other path, type and gate gives the widened (exact-activation) bits either way."""
    x, ids, w, *_ = case(n=40, requires_grad=False)
    x = x.bfloat16().float()  # a bf16 model's values
    first = apex_ffn.isa()
    try:
        for types in ("bf16", "f16", "f32"):
            p, h, (gu, dn, gb, db) = packed(gate, transposed, types)
            y_ref = reference(x, ids, w, gu, dn, gb, db, gate, transposed, transposed and gate == "clamped")
            for isa in apex_ffn.available_isas():
                apex_ffn.set_isa(isa)
                wide = ops.packed_experts(x, ids, w, h, False)
                pairs = ops.packed_experts(x, ids, w, h, False, True)
                assert torch.equal(ops.packed_forward(x, ids, w, h, False, True), pairs)
                if types == "bf16" and gate == "silu" and isa in ("avx512_bf16", "amx_bf16"):
                    assert not torch.equal(pairs, wide)  # A rounded to bf16: other bits
                    assert rel(pairs, y_ref) <= 1e-2 and rel(wide, y_ref) <= 1e-2
                else:
                    assert torch.equal(pairs, wide), (types, gate, isa)
            torch.library.opcheck(torch.ops.apex_ffn.packed_experts.default, (x, ids, w, h, False, True))
            ops.release_packed(h)
    finally:
        apex_ffn.set_isa(first)


@pytest.mark.parametrize("gate,transposed", [("silu", False), ("clamped", True)])
def test_packed_train_with_lora(gate, transposed):
    p, h, (gu, dn, gb, db) = packed(gate, transposed)
    x, ids, w, *_ = case(requires_grad=True)
    g = torch.Generator().manual_seed(9)
    lora = [torch.randn(E, 3, D, generator=g) * 0.2, torch.randn(E, 2 * F, 3, generator=g) * 0.2,
            torch.randn(E, 2, F, generator=g) * 0.2, torch.randn(E, D, 2, generator=g) * 0.2]
    lora = [t.requires_grad_() for t in lora]
    y, _, _ = ops.packed_experts_train(x, ids, w, *lora, 0.7, h, False)
    interleaved = transposed and gate == "clamped"
    y_ref = reference(x, ids, w, gu, dn, gb, db, gate, transposed, interleaved, lora=lora, scale=0.7)
    assert rel(y, y_ref) <= 1e-5
    params = [x, w] + lora
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(y_ref, params, dy)):
        assert rel(a, b) <= 1e-5
    torch.library.opcheck(torch.ops.apex_ffn.packed_experts_train.default, (x, ids, w, *lora, 0.7, h, False))
    torch.library.opcheck(torch.ops.apex_ffn.packed_experts.default, (x.detach(), ids, w.detach(), h, False))
    _, ys, work = ops.packed_experts_train(x, ids, w, *lora, 0.7, h, False)
    torch.library.opcheck(torch.ops.apex_ffn.packed_experts_train_backward.default,
                          (x.detach(), ids, w.detach(), *[t.detach() for t in lora], 0.7, h, False, dy, ys, work),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_packed_train_without_adapters_one_pair():
    p, h, (gu, dn, _, _) = packed()
    x, ids, w, *_ = case()
    a_dn = (torch.randn(E, 2, F) * 0.2).requires_grad_()
    b_dn = (torch.randn(E, D, 2) * 0.2).requires_grad_()
    y, _, _ = ops.packed_experts_train(x, ids, w, None, None, a_dn, b_dn, 2.0, h, False)
    y_ref = reference(x, ids, w, gu, dn, lora=(None, None, a_dn, b_dn), scale=2.0)
    assert rel(y, y_ref) <= 1e-5
    for a, b in zip(torch.autograd.grad(y.sum(), [x, w, a_dn, b_dn]), torch.autograd.grad(y_ref.sum(), [x, w, a_dn, b_dn])):
        assert rel(a, b) <= 1e-5


def test_compile_fullgraph():
    x, ids, w, gu, dn, _, _ = case()
    p, h, _ = packed()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(D)
            self.gu, self.dn = torch.nn.Parameter(gu.detach().clone()), torch.nn.Parameter(dn.detach().clone())

        def forward(self, x, ids, w):
            z = self.norm(x)
            y, _, _ = ops.float_experts(z, ids, torch.softmax(w, -1), self.gu, self.dn, None, None, "silu", False,
                                        False, 1.702, 7.0, False)
            y2 = ops.packed_experts(z.detach(), ids, w.detach(), h, False)
            return torch.tanh(y) + 0.5 * y2

    block = Block()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x1 = x.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    a, b = block(x1, ids, w.detach()), compiled(x2, ids, w.detach())
    assert rel(b, a) <= 1e-6
    a.sum().backward()
    b.sum().backward()
    assert rel(x2.grad, x1.grad) <= 1e-6


def test_threads_give_the_same_bits():
    x, ids, w, gu, dn, _, _ = case(n=300, requires_grad=False)
    ids = torch.randint(0, E, (300, K))
    try:
        outs = []
        for t in (1, 2):
            apex_ffn.set_num_threads(t)
            outs.append(ops.float_experts(x, ids, w, gu, dn, None, None, "silu", False, False, 1.7, 7.0, False)[0])
        assert torch.equal(outs[0], outs[1])
        assert apex_ffn.get_num_threads() == 2
    finally:
        apex_ffn.set_num_threads(None)
    assert apex_ffn.get_num_threads() == torch.get_num_threads()
    with pytest.raises(ValueError, match="positive int"):
        apex_ffn.set_num_threads(0)


def test_kernel_paths_visible_and_equal():
    assert apex_ffn.isa() in apex_ffn.available_isas()
    assert apex_ffn.best_isa() == apex_ffn.available_isas()[-1]
    p, h, _ = packed()
    x, ids, w, *_ = case(n=40, requires_grad=False)
    first = apex_ffn.isa()
    outs = []
    try:
        for isa in apex_ffn.available_isas():
            apex_ffn.set_isa(isa)
            assert apex_ffn.isa() == isa
            outs.append(ops.packed_experts(x, ids, w, h, False))
    finally:
        apex_ffn.set_isa(first)
    for o in outs[1:]:
        assert rel(o, outs[0]) <= 1e-6
    with pytest.raises(apex_ffn.ConfigError, match="unknown kernel path 'sse9'"):
        apex_ffn.set_isa("sse9")


def test_gil_released_while_computing():
    g = torch.Generator().manual_seed(5)
    gu, dn = torch.randn(E, 128, 64, generator=g), torch.randn(E, 64, 64, generator=g)  # q8_0: blocks of 32
    p = apex_ffn.PackedExperts.from_float(gu, dn, None, None, "silu", False, False, 1.7, 7.0, "q8_0", 1)
    x = torch.randn(4000, 64)
    ids = torch.randint(0, E, (4000, K))
    w = torch.rand(4000, K)
    ticks, done = [0], threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)

    t = threading.Thread(target=count)
    t.start()
    before = ticks[0]
    t0 = time.perf_counter()
    for _ in range(20):
        p.forward(x, ids, w, False, torch.empty(4000, 64), torch.empty(4000 * K, 64), 1)
    elapsed = time.perf_counter() - t0
    done.set()
    t.join()
    assert elapsed > 0.01 and ticks[0] - before > 100  # the other thread ran during the calls


def test_bad_input_errors():
    x, ids, w, gu, dn, _, _ = case(requires_grad=False)
    call = lambda *a: ops.float_experts(*a, None, None, "silu", False, False, 1.7, 7.0, False)  # noqa: E731
    # Another device (CUDA where there is one): the op's body refuses it before the extension sees it. Meta
    # tensors reach the fake implementation through the dispatcher, so the body is called as the CPU kernel is.
    body = ops.float_experts._init_fn
    with pytest.raises(ValueError, match="argument 'hidden_states' is on meta; apex_ffn computes on CPU"):
        body(x.to("meta"), ids, w, gu, dn, None, None, "silu", False, False, 1.7, 7.0, False)
    with pytest.raises(ValueError, match="argument 'down_proj' is on meta"):
        body(x, ids, w, gu, dn.to("meta"), None, None, "silu", False, False, 1.7, 7.0, False)
    with pytest.raises(ValueError, match="apex_ffn::packed_experts: argument 'top_k_weights' is on meta"):
        ops.packed_experts._init_fn(x, ids, w.to("meta"), 1, False)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="argument 'hidden_states' is on cuda"):
            call(x.cuda(), ids, w, gu, dn)
    with pytest.raises(ValueError, match="argument 'hidden_states' is not contiguous"):
        call(torch.randn(D, N).T, ids, w, gu, dn)
    with pytest.raises(ValueError, match="argument 'hidden_states' has dtype float64, expected float32"):
        call(x.double(), ids, w, gu, dn)
    with pytest.raises(ValueError, match="argument 'top_k_index' has dtype int32, expected int64"):
        call(x, ids.int(), w, gu, dn)
    with pytest.raises(apex_ffn.ShapeError, match="argument 'down_proj' has shape \\(5, 24, 32\\), expected \\(5, 32, 24\\)"):
        call(x, ids, w, gu, dn.transpose(1, 2).contiguous())
    with pytest.raises(apex_ffn.ShapeError, match="argument 'top_k_weights' has shape \\(7, 3\\), expected \\(7, 2\\)"):
        call(x, ids, torch.rand(N, 3), gu, dn)
    bad = ids.clone()
    bad[3, 1] = E
    with pytest.raises(ValueError, match="expert id 5 at \\(3, 1\\), expected a value in \\[0, 5\\)"):
        call(x, bad, w, gu, dn)
    bad[3, 1] = -1
    with pytest.raises(ValueError, match="expert id -1 at \\(3, 1\\)"):
        call(x, bad, w, gu, dn)
    with pytest.raises(apex_ffn.ConfigError, match="gate 'gelu' is not one of the library's"):
        ops.float_experts(x, ids, w, gu, dn, None, None, "gelu", False, False, 1.7, 7.0, False)
    p, h, _ = packed()
    with pytest.raises(apex_ffn.ShapeError, match="argument 'gate_up lora_A' has shape \\(5, 3, 31\\), expected \\(5, 3, 32\\)"):
        ops.packed_experts_train(x, ids, w, torch.randn(E, 3, D - 1), torch.randn(E, 2 * F, 3), None, None, 1.0, h,
                                 False)
    with pytest.raises(apex_ffn.ConfigError, match="an adapter needs both lora_A and lora_B"):
        ops.packed_experts_train(x, ids, w, torch.randn(E, 3, D), None, None, None, 1.0, h, False)
    with pytest.raises(apex_ffn.ConfigError, match="unknown storage type 'q3_k'"):
        apex_ffn.PackedExperts.from_float(gu, dn, None, None, "silu", False, False, 1.7, 7.0, "q3_k", 1)
    with pytest.raises(apex_ffn.ConfigError, match="no packed experts with handle 987654"):
        ops.packed_experts(x, ids, w, 987654, False)


def test_inputs_of_other_dimensions_are_shape_errors():
    """The ops read their output shapes from the inputs' before the extension checks them: an input of other
    dimensions is a ShapeError naming it, not an unpacking error naming nothing."""
    x, ids, w, gu, dn, _, _ = case(requires_grad=False)
    call = lambda *a: ops.float_experts(*a, None, None, "silu", False, False, 1.7, 7.0, False)  # noqa: E731
    for args, name, dims in (((x[0], ids, w, gu, dn), "hidden_states", 1),
                             ((x[None], ids, w, gu, dn), "hidden_states", 3),
                             ((x, ids[:, 0], w, gu, dn), "top_k_index", 1),
                             ((x, ids, w, gu[0], dn), "gate_up_proj", 2)):
        with pytest.raises(apex_ffn.ShapeError, match=f"float_experts: argument '{name}' has {dims} dimensions"):
            call(*args)
    _, h, _ = packed()
    train = lambda *a: ops.packed_experts_train(*a, None, None, None, None, 1.0, h, False)  # noqa: E731
    for args, name, dims in (((x[0], ids, w), "hidden_states", 1), ((x[None], ids, w), "hidden_states", 3),
                             ((x, ids[:, 0], w), "top_k_index", 1)):
        with pytest.raises(apex_ffn.ShapeError, match=f"packed_experts_train: argument '{name}' has {dims} dim"):
            train(*args)
    with pytest.raises(apex_ffn.ShapeError, match="argument 'a_gate_up' has 2 dimensions, expected 3"):
        ops.packed_experts_train(x, ids, w, torch.randn(3, D), torch.randn(E, 2 * F, 3), None, None, 1.0, h, False)
    with pytest.raises(apex_ffn.ShapeError, match="argument 'hidden_states' has 1 dimensions, expected 2"):
        ops.packed_experts(x[0], ids, w, h, False)


def test_packed_forward_reads_negated_views_as_their_values():
    """ops.packed_forward skips torch's dispatcher, which resolves a lazily negated view for the ops: it
    resolves the views itself (their memory holds the values un-negated, and DLPack hands it over as it is)."""
    _, h, _ = packed()
    x, ids, w, *_ = case(requires_grad=False)
    y = ops.packed_forward(x, ids, w, h, False)
    assert torch.equal(ops.packed_forward(torch._neg_view(-x), ids, torch._neg_view(-w), h, False), y)
    assert torch.equal(ops.packed_forward(x, torch._neg_view(-ids), w, h, False), y)


def test_empty_inputs_of_any_strides():
    """A tensor without elements has no layout to check: torch gives it any strides (torch.empty(n, 0) has
    (1, 1), a transposed empty one its transpose's) and calls it contiguous, so none is refused as not
    contiguous. No tokens give no rows; no slots (K = 0) give zeros."""
    x, ids, w, gu, dn, _, _ = case(requires_grad=False)
    _, h, _ = packed()
    run = {"float": lambda a, b, c: ops.float_experts(a, b, c, gu, dn, None, None, "silu", False, False, 1.7, 7.0,
                                                      False)[0],
           "packed": lambda a, b, c: ops.packed_experts(a, b, c, h, False),
           "forward": lambda a, b, c: ops.packed_forward(a, b, c, h, False),
           "train": lambda a, b, c: ops.packed_experts_train(a, b, c, None, None, None, None, 1.0, h, False)[0]}
    no_tokens = (torch.randn(D, 0).T, torch.empty(K, 0, dtype=torch.long).T, torch.empty(K, 0).T)
    no_slots = (x, torch.empty(N, 0, dtype=torch.long), torch.empty(N, 0))
    assert no_slots[1].stride() == (1, 1) and no_tokens[0].stride() != (D, 1)
    for name, f in run.items():
        assert f(*no_tokens).shape == (0, D), name
        assert torch.equal(f(*no_slots), torch.zeros(N, D)), name
    xr = x.clone().requires_grad_()
    y, _, _ = ops.float_experts(xr, no_slots[1], no_slots[2].requires_grad_(), gu, dn, None, None, "silu", False,
                                False, 1.7, 7.0, False)
    y.sum().backward()
    assert torch.equal(xr.grad, torch.zeros(N, D))


def test_arguments_on_other_devices_than_hidden_states():
    """torch's dispatcher runs an op's fake implementation, not its body, when any argument is a meta tensor
    (experts weights left on the meta device, say); the outputs follow hidden_states' device, so CPU hidden
    states would come back as uninitialised CPU tensors. Such mixes are a ValueError naming the argument;
    all-meta arguments still give meta outputs (shapes only)."""
    x, ids, w, gu, dn, _, _ = case(requires_grad=False)
    meta = lambda t: t.to("meta")  # noqa: E731
    flags = ("silu", False, False, 1.7, 7.0, False)
    for i, name in ((1, "top_k_index"), (2, "top_k_weights"), (3, "gate_up_proj"), (4, "down_proj")):
        args = [x, ids, w, gu, dn]
        args[i] = meta(args[i])
        with pytest.raises(ValueError, match=f"float_experts: argument '{name}' is on meta and 'hidden_states' on cpu"):
            ops.float_experts(*args, None, None, *flags)
    y, ys, work = ops.float_experts(*map(meta, (x, ids, w, gu, dn)), None, None, *flags)
    assert y.is_meta and y.shape == (N, D)
    _, ys, work = ops.float_experts(x, ids, w, gu, dn, None, None, *flags)
    with pytest.raises(ValueError, match="float_experts_backward: argument 'dy' is on meta"):
        ops.float_experts_backward(x, ids, w, gu, dn, None, None, *flags, meta(torch.randn(N, D)), ys, work, True,
                                   False)
    _, h, _ = packed()
    with pytest.raises(ValueError, match="packed_experts: argument 'top_k_weights' is on meta and 'hidden_states'"):
        ops.packed_experts(x, ids, meta(w), h, False)
    a, b = torch.randn(E, 3, D), torch.zeros(E, 2 * F, 3)
    with pytest.raises(ValueError, match="packed_experts_train: argument 'a_gate_up' is on meta"):
        ops.packed_experts_train(x, ids, w, meta(a), meta(b), None, None, 1.0, h, False)
    _, ys, work = ops.packed_experts_train(x, ids, w, a, b, None, None, 1.0, h, False)
    with pytest.raises(ValueError, match="packed_experts_train_backward: argument 'work' is on meta"):
        ops.packed_experts_train_backward(x, ids, w, a, b, None, None, 1.0, h, False, torch.randn(N, D), ys,
                                          meta(work))


def test_one_bias_without_the_other_is_refused():
    """The biases come as a pair: a down_proj bias without gate_up_proj's was dropped without a word."""
    x, ids, w, gu, dn, gb, db = case(bias=True, requires_grad=False)
    flags = ("clamped", False, False, 1.7, 7.0, False)
    _, ys, work = ops.float_experts(x, ids, w, gu, dn, gb, db, *flags)
    for biases, given in (((gb, None), "gate_up_proj_bias"), ((None, db), "down_proj_bias")):
        with pytest.raises(apex_ffn.ConfigError, match=f"give both biases or neither; only '{given}' was given"):
            ops.float_experts(x, ids, w, gu, dn, *biases, *flags)
        with pytest.raises(apex_ffn.ConfigError, match=f"give both biases or neither; only '{given}' was given"):
            ops.float_experts_backward(x, ids, w, gu, dn, *biases, *flags, torch.randn(N, D), ys, work, False, False)


def test_bias_gradients_without_biases_are_refused():
    """bias_grads=True asks for the biases' gradients: without the biases it was a TypeError from allocating
    them like None; a ConfigError naming the missing bias, in the op and in its fake (meta tensors)."""
    x, ids, w, gu, dn, gb, db = case(bias=True, requires_grad=False)
    flags = ("clamped", False, False, 1.7, 7.0, False)
    _, ys, work = ops.float_experts(x, ids, w, gu, dn, None, None, *flags)
    dy = torch.randn(N, D)
    for biases, missing in (((None, None), "gate_up_proj_bias"), ((gb, None), "down_proj_bias"),
                            ((None, db), "gate_up_proj_bias")):
        for to in (lambda t: t, lambda t: None if t is None else t.to("meta")):
            args = [to(t) for t in (x, ids, w, gu, dn, *biases)]
            with pytest.raises(apex_ffn.ConfigError, match=f"float_experts_backward: bias_grads is True but "
                                                           f"argument '{missing}' is None"):
                ops.float_experts_backward(*args, *flags, to(dy), to(ys), to(work), True, True)
