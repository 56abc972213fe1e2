"""A GGUF MoE model in transformers, its experts packed: generate on CPU.

    python examples/python/gguf_generate.py [--type Q8_0|Q4_0|MXFP4|F32] [--tokens 16]

Writes a small random Qwen3-MoE model as a GGUF file (make_tiny_gguf.py: no
download), loads it with transformers, then swaps every experts module for
the file's own expert blocks (apex_ffn.packed.pack_experts(model,
gguf=path)): the experts run packed in the file's type instead of
dequantized to float32. Prints the logits' difference, both greedy
continuations, the experts' bytes and the tokens per second of each.

transformers (5.25) loads the file dequantized first (its CPU path), so the
peak memory of the load is that of the float model; after the swap the
experts hold the file's bytes only.
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_gguf import make_tiny_qwen3_moe_gguf  # noqa: E402

import apex_ffn  # noqa: E402
from apex_ffn.packed import pack_experts  # noqa: E402


def tokens_per_second(model, prompt, n):
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out, n / (time.perf_counter() - t0)


def experts_bytes(model):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q8_0", choices=["F32", "Q8_0", "Q4_0", "MXFP4"])
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="apex-ffn-gguf-") as folder:
        run(args, folder)


def run(args, folder):
    from transformers import AutoModelForCausalLM
    path = os.path.join(folder, "tiny-qwen3-moe.gguf")
    make_tiny_qwen3_moe_gguf(path, args.type)
    print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB, experts in {args.type}")

    # transformers' qwen3moe GGUF mapping has no expert_feed_forward_length: give the experts' width
    load = dict(gguf_file=os.path.basename(path), moe_intermediate_size=256, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, **load).eval()
    ours = AutoModelForCausalLM.from_pretrained(folder, **load).eval()
    float_bytes = experts_bytes(ours)
    pack_experts(ours, gguf=path)
    packed = [m for _, m in ours.named_modules() if isinstance(m, apex_ffn.packed.PackedExpertsModule)]
    print(f"experts: {float_bytes / 1e6:.1f} MB as float32 -> {sum(m.packed.nbytes for m in packed) / 1e6:.1f} MB "
          f"packed ({packed[0].packed.types}), kernel path {apex_ffn.isa()}")

    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        a, b = ref(prompt).logits, ours(prompt).logits
    print(f"logits: max |packed - dequantized| / max |dequantized| = {((a - b).abs().max() / a.abs().max()).item():.2e}")
    out_ref, tps_ref = tokens_per_second(ref, prompt, args.tokens)
    out, tps = tokens_per_second(ours, prompt, args.tokens)
    print(f"transformers (dequantized): {out_ref[0, prompt.shape[1]:].tolist()}  {tps_ref:.1f} tokens/s")
    print(f"apex_ffn packed experts:    {out[0, prompt.shape[1]:].tolist()}  {tps:.1f} tokens/s")
    print("same greedy tokens" if torch.equal(out, out_ref) else "greedy tokens differ (the type's rounding)")


if __name__ == "__main__":
    main()
