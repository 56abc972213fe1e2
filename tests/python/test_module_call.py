"""The packed experts module's call skips nn.Module's frames only when nothing but forward would run: its
own and global hooks, Module.compile() and jit tracing still take nn.Module's own call, and a traced model
runs the experts."""
import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
from test_packed import tiny_packed  # noqa: E402


def inputs():
    g = torch.Generator().manual_seed(4)
    return torch.randn(5, 32, generator=g), torch.randint(0, 6, (5, 2), generator=g), torch.rand(5, 2, generator=g)


def test_hooks_of_the_module_and_global_ones_run():
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    m = tiny_packed(False).get_submodule("model.layers.0.mlp.experts")
    x, ids, w = inputs()
    with torch.no_grad():
        plain = m(x, ids, w)
        for register in (m.register_forward_hook, register_module_forward_hook):
            handle = register(lambda mod, args, out: out * 2 if mod is m else None)
            assert torch.equal(m(x, ids, w), 2 * plain)
            handle.remove()
        for register in (m.register_forward_pre_hook, register_module_forward_pre_hook):
            handle = register(lambda mod, args: (args[0] * 0, *args[1:]) if mod is m else None)
            assert torch.equal(m(x, ids, w), torch.zeros_like(plain))
            handle.remove()
        assert torch.equal(m(x, ids, w), plain)
    seen = []
    handle = m.register_full_backward_hook(lambda mod, gin, gout: seen.append(gout[0].shape))
    xs = x.clone().requires_grad_()
    m(xs, ids, w).sum().backward()
    handle.remove()
    assert seen == [torch.Size([5, 32])] and xs.grad is not None


def test_module_compile_takes_the_compiled_call():
    import torch._dynamo
    torch._dynamo.reset()
    m = tiny_packed(False).get_submodule("model.layers.0.mlp.experts")
    x, ids, w = inputs()
    with torch.no_grad():
        want = m(x, ids, w)
        m.compile(fullgraph=True)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got = m(x, ids, w)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_records_the_experts(grad):
    """torch.jit.trace of a model around the module, with grad on or off: the traced model gives the eager
    outputs on other inputs (under no_grad the inference path skips torch's dispatcher, which the tracer
    would not see: the trace held an uninitialised tensor for the experts' output)."""
    m = tiny_packed(False).get_submodule("model.layers.0.mlp.experts")

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = m

        def forward(self, x, ids, w):
            return x + self.experts(x, ids, w)

    model = Residual()
    x, ids, w = inputs()
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(model, (x, ids, w), check_trace=False)
    x2, ids2, w2 = 2 * x, ids.flip(0), w.flip(1)
    with torch.no_grad():
        assert torch.allclose(traced(x2, ids2, w2), model(x2, ids2, w2), rtol=1e-6, atol=1e-6)
        assert torch.allclose(traced(x, ids, w), model(x, ids, w), rtol=1e-6, atol=1e-6)
