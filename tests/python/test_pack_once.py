"""The pack-once file from Python (apex_ffn.packed.save_pack_once and
pack_experts(model, pack_once=folder)): a mapped model computes the bits of
the model it was saved from, for every storage type and both expert kinds;
the mapping reads no expert byte; LoRA runs on mapped experts; and the
refusals (missing, foreign, truncated files, a FIFO) leave the model as it was."""
import copy
import os
import shutil
import signal

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import apex_ffn  # noqa: E402
from apex_ffn.lora import add_lora  # noqa: E402
from apex_ffn.packed import PackedExpertsModule, pack_experts, save_pack_once  # noqa: E402
from families import FAMILIES, experts_modules, tiny_model  # noqa: E402
from test_packed import logits, routed_inputs, wide_model  # noqa: E402

TYPES = ["f32", "bf16", "f16", "q8_0", "q4_0", "mxfp4", "q4_k", "q6_k", "q4_k/q6_k"]
IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))


def packed_and_saved(family, types, folder):
    """(float model, the same packed in `types`, the files save_pack_once wrote to `folder`)."""
    ref = wide_model(family)
    packed = copy.deepcopy(ref)
    pack_experts(packed, types)
    return ref, packed, save_pack_once(packed, folder)


def mapped_rss_kib(path):
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps): the pages it has touched."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[-1] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("types", TYPES)
def test_mapped_model_computes_the_packed_bits(family, types, tmp_path):
    ref, packed, paths = packed_and_saved(family, types, tmp_path)
    assert paths == [str(tmp_path / f"block-{i}.safetensors") for i in range(2)]
    mapped = copy.deepcopy(ref)
    names = pack_experts(mapped, pack_once=tmp_path)
    assert names == [n for n, _ in experts_modules(ref)]
    x, ids, w = routed_inputs(ref)
    for i, n in enumerate(names):
        a, b = packed.get_submodule(n), mapped.get_submodule(n)
        assert b.packed.mapped and not a.packed.mapped and b.source == paths[i]
        assert (b.packed.types, b.packed.nbytes, b.layout.gate) == (a.packed.types, a.packed.nbytes, a.layout.gate)
        with torch.no_grad():
            assert torch.equal(b(x, ids, w), a(x, ids, w)), n
    assert torch.equal(logits(mapped, IDS), logits(packed, IDS))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_round_trips(family, tmp_path):
    """The router beside the experts is found in each family's block (gate, router; with or without a bias,
    beside shared experts and their gate), and the mapped model computes the packed one's bits."""
    ref = tiny_model(family)
    packed, mapped = copy.deepcopy(ref), copy.deepcopy(ref)
    pack_experts(packed, "bf16")
    save_pack_once(packed, tmp_path)
    pack_experts(mapped, pack_once=tmp_path)
    assert torch.equal(logits(mapped, IDS), logits(packed, IDS))


def test_the_file_is_the_library_layer_and_saves_again_from_its_mapping(tmp_path):
    """The router beside the experts is in the file (with gpt-oss's bias); a mapped model saves the same bytes."""
    st = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    ref, packed, paths = packed_and_saved("gpt_oss", "q8_0", tmp_path / "a")
    router = ref.get_submodule("model.layers.1.mlp.router")
    with st.safe_open(paths[1], "pt") as f:
        assert f.metadata()["apex.layout"] == "panels" and f.metadata()["apex.layout.routed"] == "q8_0"
        assert torch.equal(f.get_tensor("router.weight"), router.weight.detach())
        assert torch.equal(f.get_tensor("router.bias"), router.bias.detach())
        assert torch.equal(f.get_tensor("expert_bias"), torch.zeros(6))
    mapped = copy.deepcopy(ref)
    pack_experts(mapped, pack_once=tmp_path / "a")
    again = save_pack_once(mapped, tmp_path / "b")
    for p, q in zip(paths, again):
        with open(p, "rb") as f, open(q, "rb") as g:
            assert f.read() == g.read(), q


def test_a_meta_initialised_model_maps_the_files(tmp_path):
    ref, packed, _ = packed_and_saved("gpt_oss", "mxfp4", tmp_path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(ref.config)
    pack_experts(meta, pack_once=tmp_path)
    x, ids, w = routed_inputs(ref)
    for n, _ in experts_modules(ref):
        m = meta.get_submodule(n)
        assert isinstance(m, PackedExpertsModule) and m.packed.mapped
        with torch.no_grad():
            assert torch.equal(m(x, ids, w), packed.get_submodule(n)(x, ids, w)), n
    with pytest.raises(apex_ffn.ConfigError, match="the router model.layers.0.mlp.router beside model.layers.0.mlp."
                                                   "experts has no weights \\(a meta-initialised model\\)"):
        save_pack_once(meta, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_mapping_reads_no_expert_byte(tmp_path):
    """The mapping's resident pages (smaps) after the map: the header and the router, not the experts' bytes;
    after a forward through every expert: the experts' bytes (so the measure sees pages when they come in)."""
    ref, packed, paths = packed_and_saved("qwen3_moe", "f32", tmp_path)
    expert_kib = packed.get_submodule("model.layers.0.mlp.experts").packed.nbytes // 1024
    assert expert_kib > 4000 and all(os.path.getsize(p) // 1024 > expert_kib for p in paths)
    mapped = copy.deepcopy(ref)
    pack_experts(mapped, pack_once=tmp_path)
    for p in paths:
        assert mapped_rss_kib(p) <= 256, p  # header, router and the kernel's fault-around, a few pages
    m = mapped.get_submodule("model.layers.0.mlp.experts")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(6).reshape(6, 1)  # every expert once
    with torch.no_grad():
        m(x, ids, torch.ones(6, 1))
    assert mapped_rss_kib(paths[0]) >= expert_kib
    assert mapped_rss_kib(paths[1]) <= 256


def test_lora_on_mapped_experts_as_on_packed_ones(tmp_path):
    base = tiny_model("qwen3_moe")
    packed = copy.deepcopy(base)
    pack_experts(packed, "bf16")
    save_pack_once(packed, tmp_path)
    mapped = copy.deepcopy(base)
    pack_experts(mapped, pack_once=tmp_path)
    results = []
    for model in (packed, mapped):
        add_lora(model, 4, 8, seed=3)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.zero_grad(set_to_none=True)
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and set(grads_a) == set(grads_b) and len(grads_a) == 8
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n


def assert_refused(model, folder, error, match):
    before = [type(m) for _, m in experts_modules(model)]
    with pytest.raises(error, match=match):
        pack_experts(model, pack_once=folder)
    assert [type(m) for _, m in experts_modules(model)] == before and not any(
        isinstance(m, PackedExpertsModule) for m in before)


def test_refusals_leave_the_model_unchanged(tmp_path):
    _, _, paths = packed_and_saved("qwen3_moe", "q8_0", tmp_path / "good")
    model = wide_model()
    assert_refused(model, tmp_path / "none", apex_ffn.FormatError,
                   "the pack-once folder '.*none' does not exist or is not a folder")
    (tmp_path / "empty").mkdir()
    assert_refused(model, tmp_path / "empty", apex_ffn.FormatError,
                   "model.layers.0.mlp.experts: safetensors: cannot open file '.*empty/block-0.safetensors'")
    # another shape, another expert kind: the file's recorded layer against the module's
    small = tiny_model("qwen3_moe")
    pack_experts(small, "f32")
    save_pack_once(small, tmp_path / "small")
    assert_refused(model, tmp_path / "small", apex_ffn.FormatError,
                   "model.layers.0.mlp.experts: map_packed_moe\\(file '.*small/block-0.safetensors'\\): the file "
                   "holds a layer of swiglu experts, d_model 32, d_ffn 16, E 6, S 0 of width 16; the config asks "
                   "for swiglu experts, d_model 256, d_ffn 256, E 6, S 0 of width 256")
    assert_refused(wide_model("gpt_oss"), tmp_path / "good", apex_ffn.FormatError,
                   "the file holds a layer of swiglu experts.*; the config asks for clamped_swiglu experts.*, "
                   "router bias")
    # block 1 truncated: block 0 maps, and is dropped with the rest
    shutil.copytree(tmp_path / "good", tmp_path / "cut")
    cut = tmp_path / "cut" / "block-1.safetensors"
    os.truncate(cut, os.path.getsize(cut) - 1000)
    assert_refused(model, tmp_path / "cut", apex_ffn.FormatError,
                   "model.layers.1.mlp.experts: safetensors: tensor 'experts.5.down.scales' ends at byte .* of a "
                   ".*-byte data buffer \\(in file '.*cut/block-1.safetensors'\\)")
    # a FIFO is refused at once: opening it for reading would wait for a writer
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "block-0.safetensors")
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("pack_experts hung on a FIFO"))
    signal.alarm(20)
    try:
        assert_refused(model, tmp_path / "fifo", apex_ffn.FormatError,
                       "safetensors: file '.*fifo/block-0.safetensors' is not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(apex_ffn.ConfigError, match="give either types .* pack_once .* or gguf .*: exactly one"):
        pack_experts(model, "f32", pack_once=tmp_path / "good")
    assert [os.path.getsize(p) for p in paths] == [os.path.getsize(tmp_path / "good" / os.path.basename(p))
                                                   for p in paths]


def test_save_refusals_and_no_half_written_file(tmp_path):
    model = wide_model()
    with pytest.raises(apex_ffn.ConfigError, match="Qwen3MoeForCausalLM has no packed experts module "
                                                   "\\(call pack_experts first\\)"):
        save_pack_once(model, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    pack_experts(model, "q4_0")
    # checked before the first file: block 1 without a router writes nothing, block 0 included
    no_router = copy.deepcopy(model)
    no_router.model.layers[1].mlp.gate = torch.nn.Identity()
    with pytest.raises(apex_ffn.ConfigError, match=r"save_pack_once: model.layers.1.mlp.experts: 0 router modules "
                                                   r"beside the experts \(siblings with a weight of 6 x 256: \[\]\)"):
        save_pack_once(no_router, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # block 1's path is taken by a folder: block 0 is written whole, block 1 fails, no temporary file stays
    (tmp_path / "out" / "block-1.safetensors").mkdir(parents=True)
    with pytest.raises(apex_ffn.FormatError, match="cannot rename '.*/out/.block-1.safetensors.tmp.*' to "
                                                   "'.*/out/block-1.safetensors': Is a directory"):
        save_pack_once(model, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["block-0.safetensors", "block-1.safetensors"]
    assert (tmp_path / "out" / "block-1.safetensors").is_dir()
    mapped = wide_model()
    with pytest.raises(apex_ffn.FormatError, match="model.layers.1.mlp.experts: .*block-1.safetensors"):
        pack_experts(mapped, pack_once=tmp_path / "out")
